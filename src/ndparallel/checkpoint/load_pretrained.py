"""Pretrained weights into a sharded model without a full copy on every rank (``cpu_ram_efficient_loading``).

With ``FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True)``, `Accelerator.prepare(model)` accepts a
model whose parameters are on the meta device (no memory) and fills them after sharding, in one of two ways:

- **rank 0 reads and broadcasts** -- Accelerate's way. Rank 0 holds the real weights (``from_pretrained``), the
  other ranks a meta model (``with ndparallel.init_empty_weights(): from_config(...)``). After sharding, each
  tensor is broadcast from rank 0 and every rank keeps its shard. Peak memory: the full model on rank 0, one shard
  plus one whole tensor elsewhere. (As Accelerate does, the Accelerator sets ``ACCELERATE_USE_FSDP`` and
  ``FSDP_CPU_RAM_EFFICIENT_LOADING``; transformers 4.x then builds the meta model on ranks other than each node's
  local rank 0 inside ``from_pretrained`` by itself; transformers 5.x loads real weights on every rank, which still
  works -- rank 0's weights win -- but saves nothing.)
- **each rank reads only what it owns** -- every rank builds the model on the meta device
  (``with ndparallel.init_empty_weights(): model = AutoModelForCausalLM.from_config(config)``, the config loaded
  from a local directory); after sharding, every rank reads just its own slices of the safetensors files named
  by ``model.config.name_or_path`` (`torch.distributed.checkpoint.HuggingFaceStorageReader`; a mixture of experts
  stored one tensor per expert, the Hub's layout, is stacked from its own experts' tensors: `per_expert`). Peak
  memory: one shard on every rank, rank 0 included.

Either way, parameters and persistent buffers are made meta on every rank before the parallelisms are applied
(so every rank sees the same tensors during parallelisation), then materialised on the rank's device and loaded.
Non-persistent buffers (rotary frequencies...) are not in checkpoints: they must be real on every rank
(`init_empty_weights` and ``from_pretrained`` leave them real).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from ..parallel import interface, state_module
from ..parallel.adapted import is_peft_model
from . import per_expert
from .manifest import compare_tensors, model_tensors
from .storage import CheckpointError, agree, is_distributed, on_main, rank

# What transformers' from_pretrained reads to build real weights on local rank 0 only (as under Accelerate).
TRANSFORMERS_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}


def announce(plugin: Any) -> None:
    """Called by the Accelerator: the environment Accelerate sets for ``cpu_ram_efficient_loading`` (read by
    transformers' ``from_pretrained``; see the module doc)."""
    if plugin is not None and getattr(plugin, "cpu_ram_efficient_loading", False):
        os.environ.update(TRANSFORMERS_ENV)


@contextlib.contextmanager
def init_empty_weights() -> Iterator[None]:
    """Create every parameter of the modules built inside on the meta device (no memory, no init cost that
    matters); buffers stay real, so computed ones (rotary frequencies) keep their values. Load the weights with
    ``cpu_ram_efficient_loading`` (see the module doc)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _non_persistent(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for prefix, module in model.named_modules():
        for name in module._non_persistent_buffers_set:
            if module._buffers.get(name) is not None:
                out[f"{prefix}.{name}" if prefix else name] = module._buffers[name]
    return out


def _to_meta(model: nn.Module) -> None:
    """Replace parameters (keeping tied ones tied) and persistent buffers by meta tensors."""
    memo: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in memo:
                    memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"),
                                                   requires_grad=param.requires_grad)
                module._parameters[name] = memo[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                module._buffers[name] = torch.empty_like(buffer, device="meta")


@dataclass
class _Plan:
    mode: str  # "broadcast" (from rank 0's weights) or "files" (each rank reads its slices)
    source: dict[str, torch.Tensor] = field(default_factory=dict)  # rank 0's weights (broadcast)
    path: Path | None = None  # the safetensors directory (files)


def _weights_dir(model: nn.Module) -> Path:
    name = getattr(getattr(model, "config", None), "name_or_path", None) or getattr(model, "name_or_path", None)
    if not name or not Path(name).is_dir():
        raise CheckpointError(
            f"prepare(): every rank's {type(model).__name__} is on the meta device and there is no local directory to "
            f"read its weights from (config.name_or_path={name!r}); build it from AutoConfig.from_pretrained(<local "
            "directory>), or load the real weights on rank 0 (from_pretrained) to broadcast them")
    path = Path(name)
    if not any(path.glob("*.safetensors")):
        raise CheckpointError(f"prepare(): {path} holds no *.safetensors files to load {type(model).__name__} from")
    return path


def _plan(model: nn.Module, plugin: Any) -> _Plan | None:
    """Collective: whether (and how) this model's weights arrive after sharding; the same verdict on every rank."""
    meta = any(p.is_meta for p in model.parameters())
    flags = [meta]
    if is_distributed():
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, meta)
    if not any(flags):
        return None
    error = None
    if not getattr(plugin, "cpu_ram_efficient_loading", False):
        error = (f"prepare(): parameters of {type(model).__name__} are on the meta device on rank(s) "
                 f"{[r for r, f in enumerate(flags) if f]}; set FullyShardedDataParallelPlugin("
                 "cpu_ram_efficient_loading=True) to load its weights after sharding")
    elif flags[0] and not all(flags):
        error = (f"prepare(): rank 0's {type(model).__name__} is on the meta device but rank(s) "
                 f"{[r for r, f in enumerate(flags) if not f]} hold real weights; with cpu_ram_efficient_loading, "
                 "rank 0 holds the real weights (which are broadcast), or no rank does (each reads its own slices)")
    else:
        stuck = [n for n, b in _non_persistent(model).items() if b.is_meta]
        if stuck:
            error = (f"prepare(): non-persistent buffer(s) {stuck[:5]} of {type(model).__name__} are on the meta "
                     "device and no checkpoint holds them; build the model under ndparallel.init_empty_weights() "
                     "(buffers stay real) instead of torch.device('meta')")
    if error is None and flags[0] and is_peft_model(model):
        error = (f"prepare(): every rank's {type(model).__name__} (PEFT) is on the meta device, and the adapter's "
                 "weights are in no pretrained file: with cpu_ram_efficient_loading, load the base's real weights on "
                 "rank 0 (from_pretrained there, init_empty_weights elsewhere) before get_peft_model, so that the "
                 "base and the adapter are broadcast")
    agree(error)
    if flags[0]:  # no rank holds real weights: each reads its own slices
        return _Plan("files", path=on_main(lambda: _weights_dir(model)))
    source = {name: t.detach() for name, t in model.state_dict().items()} if rank() == 0 else {}
    return _Plan("broadcast", source=source)


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate (uninitialised) storage for every meta tensor, sharded ones as their local shards."""
    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)


def _check_files(model: nn.Module, path: Path, expected: dict[str, list[int]], unwrapped: nn.Module) -> dict[str, Any]:
    """Rank 0: the model's state dict names/shapes (`expected`, the whole model's) against the safetensors headers
    (experts stored one tensor per expert stacked as the model stacks them, `per_expert`; `unwrapped`: the model whose
    family and experts modules tell how); raise listing mismatches."""
    from safetensors import (
        safe_open,  # installed with transformers, which pretrained weights come from
    )

    saved: dict[str, list[int]] = {}
    files: dict[str, str] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                saved[key] = list(f.get_slice(key).get_shape())
                files[key] = file.name
    sources = per_expert.Sources(shapes=saved)
    if per_expert.stores_one_per_expert(saved, expected):
        sources = per_expert.stacked_sources(saved, unwrapped, path)
    shapes = sources.shapes
    tied = [n for n in expected if n not in shapes and _tied_source(model, n) in shapes]
    what = f"pretrained weights in {path}" + (" (experts stacked from one tensor per expert)" if sources.experts
                                              else "")
    problem = compare_tensors({**shapes, **{n: expected[n] for n in tied}}, expected, what)
    if problem:
        raise CheckpointError(problem)
    needed = {n for parts in sources.experts.values() for _, names in parts for n in names}
    return {"tied": tied, "sources": sources, "files": {n: f for n, f in files.items() if n in needed}}


def _tied_source(model: nn.Module, name: str) -> str | None:
    """The first name under which the parameter called `name` appears (its tied original), or None."""
    by_id: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), n)
        if n == name:
            return by_id[id(p)] if by_id[id(p)] != name else None
    return None


def _load_files(model: nn.Module, path: Path) -> None:
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageReader
    except ImportError as exc:  # a torch below ndparallel's floor (2.11)
        raise CheckpointError(f"reading only each rank's slices of safetensors files needs torch's "
                              f"HuggingFaceStorageReader ({exc}); ndparallel needs torch >= 2.11, or "
                              "load the real weights on rank 0 instead (from_pretrained)") from None
    expected = model_tensors(model)  # collective under pipeline stages
    unwrapped = interface(model).unwrapped()
    model = state_module(model)  # under pipeline stages: this rank's stages, which read only their own tensors
    checked = on_main(lambda: _check_files(model, path, expected, unwrapped))
    sources: per_expert.Sources = checked["sources"]
    state = {n: t for n, t in get_model_state_dict(model).items() if n not in checked["tied"]}
    # Every tensor but the stacked experts under the files' names (the same tensors: DCP fills them in place).
    named = {sources.renamed.get(n, n): t for n, t in state.items() if n not in sources.experts}
    dcp.load(named, storage_reader=HuggingFaceStorageReader(str(path)))
    error = None
    try:
        per_expert.read_local_experts(state, sources, checked["files"], path)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it before the collectives below
        error = exc
    agree(error)
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


def parallelize_loading_weights(model: nn.Module, plugin: Any, device: torch.device,
                                parallelize: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """Apply `parallelize` to `model`; if its parameters are on the meta device, load them afterwards."""
    plan = _plan(model, plugin)
    if plan is None:
        return parallelize(model)
    _to_meta(model)
    prepared = parallelize(model)  # meta tensors stay on the meta device through it
    _materialize(prepared, device)
    if plan.mode == "broadcast":
        # Under pipeline stages rank 0's full weights hold other stages' tensors too: each rank keeps its own.
        split = not interface(prepared).holds_every_parameter
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not split)
        set_model_state_dict(state_module(prepared), plan.source, options=options)
        plan.source.clear()
    else:
        _load_files(prepared, plan.path)
    return prepared
