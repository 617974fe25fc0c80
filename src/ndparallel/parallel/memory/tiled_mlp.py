"""Tiled MLPs: each decoder block's MLP over tiles of the sequence, recomputed tile by tile in backward.

A decoder MLP is token-wise: ``down(act(gate(x)) * up(x))`` of each token depends on that token only, and its
``tokens x intermediate`` activations (gate, up, their activation and product: 4 x 3.5 h per token for Llama) are
the largest a block saves. With ``MemoryKwargs(tiled_mlp=True)`` the MLP's forward runs on tiles of the sequence,
each through torch's non-reentrant checkpoint, so it keeps only its input, and backward recomputes one tile at a time
(autograd runs the tiles' backward one after the other): the intermediate exists for one tile, never for the whole
sequence. The results are those of the untiled MLP (the same operations on fewer rows at a time); it costs one extra
forward of the MLP, as activation checkpointing does (under activation checkpointing, the block's recomputation
runs the tiles again, and the tiles' own checkpoint adds one more forward of the MLP per tile).

Where it composes: under context / Ulysses sequence parallelism each rank tiles its own shard; under tensor
parallelism every tp rank holds the same tokens and cuts the same tiles, so the row-wise projection's all-reduce runs
once per tile on every rank; under Megatron-style sequence parallelism (the MLP's input a DTensor split along the
sequence) each rank tiles its own shard and hands each tile on as a shard of the same layout (the MLP gathers and
scatters it back; a token-wise function does not mind the order) -- when the shards are uneven (the length does not
divide tp) that call runs untiled, as it must stay exact. Mixture-of-experts blocks are left untiled, and so are MLPs
with dropout (masks drawn per tile would differ from the untiled MLP's).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

from ..adapted import adapter_free
from ..blocks import block_classes, blocks_of

MLP_NAMES = ("mlp", "feed_forward", "ffn")
STATUS_ATTR = "_ndparallel_tiled_mlp"
MIN_TILE = 1024
SEQ_DIM = -2  # (..., sequence, hidden)


def _untileable(mlp: nn.Module) -> str | None:
    """Why `mlp` is not tiled, or None: mixture-of-experts blocks; MLPs with dropout (drawn per tile, its masks would
    differ from the untiled MLP's)."""
    name = type(mlp).__name__.lower()
    if hasattr(mlp, "experts") or "moe" in name or "sparse" in name:
        return "mixture-of-experts"
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in mlp.modules()):
        return "dropout"
    return None


class TiledMLP:
    """The forward of one tiled MLP (module docstring)."""

    def __init__(self, mlp: nn.Module, tile: int) -> None:
        self.forward_untiled = mlp.forward
        self.tile = tile
        self.calls = 0  # forwards that ran tiled (tests read it)

    def tiles(self, length: int) -> int:
        return math.ceil(length / self.tile)

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or not isinstance(x, torch.Tensor) or x.dim() < 2:
            return self.forward_untiled(x, *args, **kwargs)
        if isinstance(x, DTensor):
            return self._dtensor(x)
        n = self.tiles(x.shape[SEQ_DIM])
        if n <= 1:
            return self.forward_untiled(x)
        self.calls += 1
        return torch.cat([self._run(part) for part in x.tensor_split(n, dim=SEQ_DIM)], dim=SEQ_DIM)

    def _run(self, part: torch.Tensor, wrap: Any = None) -> torch.Tensor:
        untiled = self.forward_untiled if wrap is None else wrap

        def fn(view: torch.Tensor) -> torch.Tensor:  # a tile of several rows is a strided view: made contiguous
            return untiled(view.contiguous())  # inside the checkpoint, so only the view is kept

        if torch.is_grad_enabled():
            return checkpoint(fn, part, use_reentrant=False)
        return fn(part)

    def _dtensor(self, x: DTensor) -> torch.Tensor:
        """Tensor parallelism: the MLP's input a DTensor on the tp mesh -- replicated (the block hands its projections
        one shared input), or split along the sequence (Megatron-style SP) -- and its output a plain tensor or a
        DTensor split along the sequence (the row-wise projection reduce-scatters). Each tile takes piece i of every
        rank's share of the sequence, in rank order, so a reduce-scatter of tile i gives each rank piece i of its own
        share, and the rank's pieces in order are its share of the whole output."""
        local, mesh, placements = x.to_local(), x.device_mesh, x.placements
        dim = SEQ_DIM % x.dim()
        length, ranks = x.shape[dim], mesh.size()
        n = self.tiles(length)
        split = [p for p in placements if isinstance(p, Shard)]
        if n <= 1 or mesh.ndim != 1 or length % ranks or any(p.dim % x.dim() != dim for p in split):
            return self.forward_untiled(x)  # uneven shares (the length does not divide tp): untiled, still exact
        self.calls += 1
        share = length // ranks
        # piece i of rank r's share: positions r * share + (this range)
        ranges = torch.arange(share, device=local.device).tensor_split(n)

        def tile_forward(part: torch.Tensor) -> torch.Tensor:
            out = self.forward_untiled(DTensor.from_local(part, mesh, placements, run_check=False))
            return out.to_local() if isinstance(out, DTensor) and any(isinstance(p, Shard) for p in out.placements) \
                else (out.full_tensor() if isinstance(out, DTensor) else out)

        if split:  # this rank holds its share: tile i is its piece i (the MLP's all-gather adds the others')
            outs = [self._run(local.narrow(dim, int(r[0]), len(r)), tile_forward) for r in ranges]
            return DTensor.from_local(torch.cat(outs, dim=dim), mesh, placements, run_check=False)
        index = [torch.cat([r + rank * share for rank in range(ranks)]) for r in ranges]
        outs = [self._run_indexed(local, idx, dim, tile_forward) for idx in index]
        if outs[0].shape[dim] == len(index[0]):  # whole tiles came back (all-reduced): put the rows back in place
            return torch.cat(outs, dim=dim).index_select(dim, torch.argsort(torch.cat(index)))
        return DTensor.from_local(torch.cat(outs, dim=dim), mesh, [Shard(dim)], run_check=False)

    def _run_indexed(self, whole: torch.Tensor, index: torch.Tensor, dim: int, fn: Any) -> torch.Tensor:
        def tile(whole: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # the rows are picked inside the
            return fn(whole.index_select(dim, index))  # checkpoint: it keeps the whole input (already kept), not a copy

        if torch.is_grad_enabled():
            return checkpoint(tile, whole, index, use_reentrant=False)
        return tile(whole, index)


def default_tile(hidden: int | None) -> int:
    """Tokens per tile when none is asked for: the hidden size, at least `MIN_TILE`."""
    return max(MIN_TILE, int(hidden or 0))


def apply_tiled_mlp(model: nn.Module, tile: int | None, block_names: list[str] | None = None,
                    inner: nn.Module | None = None, blocks: list[nn.Module] | None = None) -> list[TiledMLP]:
    """Tile the dense MLP of every transformer block of `model` (tiles of `tile` tokens; None: the hidden size, at
    least `MIN_TILE`). Raises ValueError when there is none. `inner`, `blocks`: `model` under its adapter wrapper and
    its blocks, as `parallelize` resolved them (`target.Target`; else found here, the blocks by `block_names`)."""
    inner = adapter_free(model) if inner is None else inner
    hidden = getattr(getattr(inner, "config", None), "hidden_size", None)
    tile = tile or default_tile(hidden)
    tiled: list[TiledMLP] = []
    skipped: dict[str, int] = {}
    for block in blocks_of(model, block_classes(inner, block_names)) if blocks is None else blocks:
        mlp = next((getattr(block, name) for name in MLP_NAMES if isinstance(getattr(block, name, None), nn.Module)),
                   None)
        if mlp is None:
            continue
        why = _untileable(mlp)
        if why is not None:
            skipped[why] = skipped.get(why, 0) + 1
            continue
        existing = getattr(mlp, STATUS_ATTR, None)
        if isinstance(existing, TiledMLP):
            tiled.append(existing)
            continue
        wrapper = TiledMLP(mlp, tile)
        mlp.forward = wrapper
        object.__setattr__(mlp, STATUS_ATTR, wrapper)
        tiled.append(wrapper)
    untiled = ", ".join(f"{n} with {why}" for why, n in skipped.items())
    if not tiled:
        raise ValueError(f"MemoryKwargs(tiled_mlp=True): {type(inner).__name__} has no decoder MLP to tile (transformer "
                         f"blocks' children named {list(MLP_NAMES)}{'; untiled: ' + untiled if untiled else ''}); set "
                         "tiled_mlp=False")
    object.__setattr__(inner, STATUS_ATTR, f"on: {len(tiled)} MLPs in tiles of {tile} tokens"
                       + (f" (untiled: {untiled})" if untiled else ""))
    return tiled


def tiled_mlp_status(model: nn.Module) -> str:
    """"on: ..." with how many MLPs and the tile size, or "off"."""
    status = getattr(adapter_free(model), STATUS_ATTR, None)
    return status if isinstance(status, str) else "off"


def tiled_mlps(model: nn.Module) -> list[TiledMLP]:
    """The tiled MLPs of a prepared model, in module order."""
    return [m.forward for m in model.modules() if isinstance(getattr(m, STATUS_ATTR, None), TiledMLP)]
