"""Step 3 of `ndparallel.parallel.parallelize`: context and Ulysses sequence parallelism for one model.

`check_sequence_parallel` refuses, before any collective, a model whose attention cannot be made exact over sharded
sequences (an attention implementation other than sdpa/eager, heads that Ulysses cannot split);
`apply_sequence_parallel` installs the hooks (`hooks.prepare_model`). The sequences themselves are sharded per batch
by ``Accelerator.maybe_context_parallel`` (`sharding.SequenceSharding.sharded`).
"""

from __future__ import annotations

from torch import nn

from ...distributed.mesh import ParallelMesh
from ..options import PrepareOptions
from ..target import target_of
from . import block, hooks
from .sharding import describe_sizes
from .ulysses import check_head_chunks, check_heads


def _sizes(mesh: ParallelMesh) -> str:
    return describe_sizes(mesh.size("cp"), mesh.size("sp"))


def check_sequence_parallel(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> None:
    """Raise if `model` cannot run under the mesh's cp x sp sharding (nothing to check without CP or SP)."""
    if mesh.size("cp") == 1 and mesh.size("sp") == 1:
        return
    hooks.check_model(model, _sizes(mesh))
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if isinstance(heads, int):
        if mesh.size("sp") > 1:
            kv = getattr(config, "num_key_value_heads", None) or heads
            check_heads(heads, kv, mesh.size("sp"), mesh.size("tp"), where=type(model).__name__)
        check_head_chunks(options.memory.ulysses_head_chunks, heads, mesh.size("sp"), mesh.size("tp"),
                          where=type(model).__name__)


def apply_sequence_parallel(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> nn.Module:
    """Route `model`'s attention through `sharding.context_parallel_attention` while sequences are sharded.

    Hugging Face models with ``attn_implementation`` "sdpa" or "eager" are switched to ndparallel's registered
    attention function; any other model must call `ndparallel.context_parallel_attention` itself. With head chunks
    (``MemoryKwargs(ulysses_head_chunks=...)``, no tp) Llama attention blocks run their projections' backward per
    chunk as well (`block.install`).
    """
    if mesh.size("cp") > 1 or mesh.size("sp") > 1:
        inner = target_of(model, options).inner
        hooks.prepare_model(model, _sizes(mesh), inner)
        if options.memory.ulysses_head_chunks is not None and mesh.size("tp") == 1:
            block.install(inner)  # the projections' backward inside each head chunk too (`block`)
    return model
