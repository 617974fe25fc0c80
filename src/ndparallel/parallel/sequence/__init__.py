"""Context parallelism (``cp``) and Ulysses sequence parallelism (``sp``): sequences sharded over ``cp x sp``, attention
exact over the whole sequence. One module per concern, each importing only those above it in this list:

- `positions`: which positions of a sequence each rank holds (`SequenceChunking` for cp, `SequenceShards` for cp x sp);
- `kernels`: attention of one query block against one key block, with its log-sum-exp, and the merge of partial
  results;
- `communication`: K/V all-gather and its reduce-scatter, the ring's point-to-point exchange, Ulysses' all-to-alls;
- `allgather`, `ring`: the two context-parallel strategies; `ulysses`: head sharding around them;
- `attention`: `sequence_parallel_attention`, the one function they all meet in (shapes checked once);
- `sharding`: `SequenceSharding`, this rank's geometry built once from the mesh -- it counts each shard's loss tokens
  for the data loader, shards buffers for ``maybe_context_parallel`` and attends -- and `context_parallel_attention`,
  the entry point of models' attention;
- `hooks`: how prepared models (Hugging Face or not) reach that entry point, and the checks on their inputs;
- `apply`: the check and apply steps of `ndparallel.parallel.parallelize`.
"""

from .apply import apply_sequence_parallel, check_sequence_parallel
from .attention import CP_ATTENTION, sequence_parallel_attention
from .positions import SequenceChunking, SequenceShards
from .sharding import SequenceSharding, active, context_parallel_attention

__all__ = [
    "CP_ATTENTION",
    "SequenceChunking",
    "SequenceShards",
    "SequenceSharding",
    "active",
    "apply_sequence_parallel",
    "check_sequence_parallel",
    "context_parallel_attention",
    "sequence_parallel_attention",
]
