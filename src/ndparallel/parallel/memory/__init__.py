"""Long sequences in less memory: what lives outside attention once CP/SP shard it.

- `cross_entropy`: the LM head and its cross-entropy over chunks of tokens (`linear_cross_entropy`), exact, also
  vocabulary-parallel over ``tp``; `head_source`: what a model does to its logits between head and loss, read from its
  source; `loss_head`: the hooks that put the chunked loss on a Hugging Face causal LM;
- `tiled_mlp`: decoder MLPs over tiles of the sequence, recomputed tile by tile in backward;
- `rms_norm`: RMSNorms that keep only their input and 1/rms per token for backward, run over chunks of tokens;
- `offload`: activations saved for backward (the inputs of checkpointed blocks) moved to host memory and back, into
  blocks of `host_pool` (kept step after step, pinned on CUDA without the caching host allocator's rounding);
- `config`: `MemoryKwargs`, the switches; `apply`: the step of `ndparallel.parallel.parallelize`.
"""

from .config import MemoryKwargs
from .cross_entropy import linear_cross_entropy
from .loss_head import chunked_loss_of, chunked_loss_status
from .rms_norm import fused_rms_norm_status, rms_norm

__all__ = ["MemoryKwargs", "chunked_loss_of", "chunked_loss_status", "fused_rms_norm_status", "linear_cross_entropy",
           "rms_norm"]
