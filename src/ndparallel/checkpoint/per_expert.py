"""Stacked experts from a Hub checkpoint that stores one tensor per expert, each rank reading only its own experts.

Qwen2/3-MoE and DeepSeek-V3 checkpoints store ``model.layers.L.mlp.experts.N.{gate_proj,up_proj,down_proj}.weight``,
Mixtral's ``model.layers.L.block_sparse_moe.experts.N.{w1,w3,w2}.weight``; the model (transformers >= 5) stacks them:
``mlp.experts.gate_up_proj`` (E, 2I, H) = gate's and up's weights of every expert, ``down_proj`` (E, H, I). The names
are data (`ndparallel.models.families.PerExpertNames`, transformers' own conversion written out).

- `plan` (rank 0, from the safetensors headers alone): which per-expert tensors make up each stacked parameter and
  the name every other tensor has in the files; anything that does not fit -- a per-expert name the table does not
  know, a missing or extra expert, shapes that disagree -- is refused, naming it (`load_pretrained` hands the error
  to every rank before any collective).
- `read_local_experts` (every rank): for each stacked parameter, the block of it this rank holds (its ep slice, and
  its FSDP2 shard of that: the same chunk `torch.distributed.checkpoint` would read), filled expert by expert from the
  rows and columns of the per-expert tensors it covers (safetensors slices: no rank reads another rank's experts).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list
from torch.distributed.tensor import DTensor

from ..models.families import PerExpertNames
from ..parallel.experts.modules import expert_count, expert_modules, family_experts
from .manifest import _listing
from .storage import CheckpointError

ONE_PER_EXPERT = re.compile(r"(?:.*\.)?experts\.\d+\..+")  # any name of a per-expert tensor


@dataclass
class Sources:
    """Where each tensor of the model is in a per-expert checkpoint."""

    # stacked parameter -> for each projection it concatenates (in order): its rows, the tensor name of each expert
    experts: dict[str, list[tuple[int, list[str]]]] = field(default_factory=dict)
    renamed: dict[str, str] = field(default_factory=dict)  # model name -> checkpoint name, where they differ
    shapes: dict[str, list[int]] = field(default_factory=dict)  # model name -> shape, as the checkpoint gives it


def plan(saved: dict[str, list[int]], names: PerExpertNames | None, module: str, count: int,
         model_type: str | None, path: Path) -> Sources:
    """Map a checkpoint's tensors (`saved`: name -> shape) onto the model's names, its per-expert tensors onto stacked
    parameters of `count` experts under ``...layers.L.<module>``; raise naming what does not fit."""
    example = next(k for k in saved if ONE_PER_EXPERT.fullmatch(k))
    where = f"pretrained weights in {path} store the experts one tensor per expert (e.g. {example!r})"
    if names is None:
        raise CheckpointError(
            f"{where}, and ndparallel's family table has no per-expert names for model_type {model_type!r} "
            "(ndparallel.models.families: Experts.per_expert); load the real weights on rank 0 "
            "(from_pretrained there, init_empty_weights elsewhere) to broadcast them, or read a directory written "
            "by accelerator.save_model")
    out = Sources()

    def as_saved(name: str) -> str:  # a model-side name as the checkpoint spells it
        for old, new in names.renamed.items():
            name = name.replace(new, old)
        return name

    projections = [p for parts in names.stacked.values() for p in parts]
    pattern = re.compile(rf"(?P<prefix>(?:.*\.)?layers\.\d+\.){re.escape(module)}\.(?P<expert>\d+)\."
                         rf"(?P<projection>{'|'.join(map(re.escape, projections))})\.weight")
    found: dict[tuple[str, str], dict[int, str]] = {}  # (layer prefix, projection) -> expert -> checkpoint name
    unknown = []
    for original, shape in saved.items():
        name = original
        for old, new in names.renamed.items():
            name = name.replace(old, new)
        match = pattern.fullmatch(name)
        if match:
            found.setdefault((match["prefix"], match["projection"]), {})[int(match["expert"])] = original
        elif ONE_PER_EXPERT.fullmatch(name):
            unknown.append(original)
        else:
            out.shapes[name] = list(shape)
            if name != original:
                out.renamed[name] = original
    if unknown:
        known = ", ".join(as_saved(f".layers.L.{module}.N.{p}.weight")[1:] for p in projections)
        raise CheckpointError(f"{where}, but {len(unknown)} per-expert tensor(s) fit no name the family table knows "
                              f"for {model_type!r} ({known}): {_listing(sorted(unknown), 6)}")
    missing, extra, shapes = [], [], []
    for prefix in sorted({prefix for prefix, _ in found}):
        for stacked, parts in names.stacked.items():
            columns, assembled = None, []
            for projection in parts:
                experts = found.get((prefix, projection), {})
                missing += [as_saved(f"{prefix}{module}.{e}.{projection}.weight") for e in range(count)
                            if e not in experts]
                extra += [experts[e] for e in sorted(experts) if e >= count]
                present = [experts[e] for e in range(count) if e in experts]
                first = saved[present[0]] if present else None
                shapes += [f"{n} {tuple(saved[n])} vs {present[0]} {tuple(first)}" for n in present
                           if list(saved[n]) != list(first)]
                if first is not None and len(first) != 2:
                    shapes.append(f"{present[0]} {tuple(first)} is not a 2-D (out, in) weight")
                elif first is not None and columns not in (None, first[1]):
                    shapes.append(f"{present[0]} {tuple(first)} has {first[1]} input features where the other "
                                  f"projection(s) of {stacked} have {columns}")
                elif first is not None:
                    columns = first[1]
                    assembled.append((first[0], [experts.get(e) for e in range(count)]))
            if len(assembled) == len(parts):
                name = f"{prefix}{module}.{stacked}"
                out.experts[name] = assembled
                out.shapes[name] = [count, sum(rows for rows, _ in assembled), columns]
    problems = [f"{len(items)} {what}: {_listing(items, 6)}" for items, what in (
        (missing, f"expert tensor(s) are missing ({count} experts)"),
        (extra, f"tensor(s) belong to experts beyond the model's {count}"),
        (shapes, "expert tensor(s) disagree in shape")) if items]
    if problems:
        raise CheckpointError(f"{where}, which cannot be stacked into the model's experts: " + "; ".join(problems))
    return out


def stores_one_per_expert(saved: dict[str, list[int]], expected: dict[str, list[int]]) -> bool:
    """Whether a checkpoint (`saved`) stores experts one tensor per expert where the model (`expected`) does not."""
    return any(ONE_PER_EXPERT.fullmatch(k) for k in saved) and not any(ONE_PER_EXPERT.fullmatch(k) for k in expected)


def stacked_sources(saved: dict[str, list[int]], model: nn.Module, path: Path) -> Sources:
    """`plan` for `model`'s family (the family table's per-expert names, experts module and count)."""
    model_type, experts = family_experts(model)
    if experts is None or experts.per_expert is None:
        return plan(saved, None, "", 0, model_type, path)  # raises: no names to map
    transposed = [n for n, m in expert_modules(model, experts) if getattr(m, "is_transposed", False)]
    if transposed:
        raise CheckpointError(f"pretrained weights in {path} store the experts one tensor per expert, and "
                              f"{transposed[0]!r} stacks them transposed ((experts, in, out)), which the family "
                              "table's per-expert names do not describe; load the real weights on rank 0 "
                              "(from_pretrained) to broadcast them")
    return plan(saved, experts.per_expert, experts.modules, expert_count(model, experts), model_type, path)


class ExpertReader:
    """Slices of tensors of the safetensors files under `path`, each file opened once (`files`: name -> file)."""

    def __init__(self, path: Path, files: dict[str, str], stack: contextlib.ExitStack) -> None:
        self.path, self.files, self.stack, self.handles = path, files, stack, {}

    def slice(self, name: str, rows: slice, columns: slice) -> torch.Tensor:
        from safetensors import safe_open  # installed with transformers

        file = self.files[name]
        if file not in self.handles:
            self.handles[file] = self.stack.enter_context(safe_open(str(self.path / file), framework="pt"))
        return self.handles[file].get_slice(name)[rows, columns]


def read_local_experts(state: dict[str, Any], sources: Sources, files: dict[str, str], path: Path) -> None:
    """Fill this rank's block of every stacked expert parameter of `state` from the per-expert tensors it covers."""
    with contextlib.ExitStack() as stack, torch.no_grad():
        reader = ExpertReader(path, files, stack)
        for name in [n for n in state if n in sources.experts]:
            target = state[name]
            local = target.to_local() if isinstance(target, DTensor) else target
            (chunk,) = _create_chunk_list(target)  # the block of the stacked parameter this rank holds
            (first, top, left), sizes = chunk.offsets, chunk.sizes
            if tuple(local.shape) != tuple(sizes):
                raise CheckpointError(f"{name}: this rank's block {tuple(sizes)} at {tuple(chunk.offsets)} is not "
                                      f"its local tensor {tuple(local.shape)}")
            start = 0  # the first row of the projection in the stacked parameter
            for rows, experts in sources.experts[name]:
                low, high = max(top, start), min(top + sizes[1], start + rows)
                for e in range(first, first + sizes[0]) if low < high else ():
                    part = reader.slice(experts[e], slice(low - start, high - start), slice(left, left + sizes[2]))
                    local[e - first, low - top:high - top].copy_(part)
                start += rows
