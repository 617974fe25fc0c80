"""Tensor parallelism over the ``tp`` view, from plans that are data.

A plan is a dict from module-name pattern to style name. ``*`` in a pattern matches one dotted segment
(``"layers.*.mlp.up_proj"``); a pattern matches a module whose full name it matches, or whose name ends with
it after a whole segment (``"layers.*.mlp.up_proj"`` matches ``model.layers.0.mlp.up_proj``). Where a module
matches several patterns, the first one wins.

Styles (see `STYLES`): each maps to one of torch's ``ParallelStyle`` objects, with different layouts when
Megatron-style sequence parallelism is on. With it, the activations between tensor-parallel regions (the
residual stream, norms, dropout) are split along the sequence (dim 1) over ``tp``; column-wise layers
all-gather them, row-wise layers reduce-scatter back into them:

    embedding ─Shard(1)─> norm ─> [gather] q,k,v (colwise) ─> attention ─> o (rowwise) ─reduce-scatter─> + ...

Where a plan comes from, first match wins: the one the user passed (``prepare(model, tp_plan=...)``, then
``TorchTensorParallelConfig(plan=...)``), the Hugging Face model's own (``config.base_model_tp_plan`` under
the base model's prefix plus the class ``_tp_plan``), a built-in plan for a known architecture
(`BUILTIN_PLANS`, by ``config.model_type``).
"""

from __future__ import annotations

import contextlib
import difflib
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from ..config import TorchTensorParallelConfig
from ..mesh import ParallelMesh
from .options import PrepareOptions

STYLES: dict[str, str] = {
    "colwise": "Linear/Embedding split along its output features; output stays split (feeds a rowwise layer)",
    "rowwise": "Linear split along its input features; partial outputs summed (all-reduce, or reduce-scatter "
               "along the sequence with sequence parallelism)",
    "colwise_gather_output": "colwise, then the output is all-gathered (replicated), e.g. an LM head",
    "embedding_rowwise": "Embedding split along the vocabulary; each rank looks up its rows, results summed",
    "replicate": "parameters replicated over tp (as DTensors); inputs and outputs replicated",
    "sequence_parallel": "norm/dropout run on sequence-split activations (only with sequence_parallel=True)",
    "gather_sequence": "the module's first input (or `hidden_states`) arrives sequence-split and is all-gathered "
                       "before it runs (only with sequence_parallel=True; e.g. an attention or MLP block)",
}

# Hugging Face style names that mean one of ours.
ALIASES = {"colwise_rep": "colwise_gather_output", "rowwise_rep": "embedding_rowwise"}

_DECODER_PLAN = {
    "embed_tokens": "embedding_rowwise",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather_output",
}
# Built-in plans for decoder architectures whose HF config may not carry one; patterns are matched by suffix.
BUILTIN_PLANS: dict[str, dict[str, str]] = {name: dict(_DECODER_PLAN) for name in ("llama", "qwen2", "mistral")}

_SEQ = 1  # the sequence dimension of (batch, seq, hidden) activations


# ---- where the plan comes from -------------------------------------------------------------------------
def hf_plan(model: nn.Module) -> dict[str, str] | None:
    """The plan a Hugging Face model declares (its config's ``base_model_tp_plan`` + its class ``_tp_plan``)."""
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if not base:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    owns_base = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    plan = {(f"{prefix}.{k}" if owns_base else k): v for k, v in base.items()}
    plan.update(getattr(type(model), "_tp_plan", None) or {})
    return plan


def choose_plan(model: nn.Module, *user_plans: Mapping[str, str] | None) -> tuple[dict[str, str], str]:
    """The plan for `model` and where it came from: the first user plan given, the model's, or a built-in one."""
    for plan, source in zip(user_plans, ("prepare(tp_plan=...)", "TorchTensorParallelConfig(plan=...)")):
        if plan is not None:
            if not isinstance(plan, Mapping):
                raise TypeError(f"{source}: a tensor-parallel plan is a dict of pattern -> style, got "
                                f"{type(plan).__name__}")
            return dict(plan), source
    plan = hf_plan(model)
    if plan:
        return plan, f"{type(model).__name__}'s own plan (config.base_model_tp_plan)"
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in BUILTIN_PLANS:
        return dict(BUILTIN_PLANS[model_type]), f"ndparallel's built-in plan for {model_type!r}"
    raise ValueError(
        f"tp_size > 1 but {type(model).__name__} has no tensor-parallel plan: it is not a Hugging Face model with "
        f"config.base_model_tp_plan and its model_type is not one of {sorted(BUILTIN_PLANS)}; pass one, e.g. "
        "ParallelismConfig(tp_size=2, tp_handler=TorchTensorParallelConfig(plan={'layers.*.up': 'colwise', "
        f"'layers.*.down': 'rowwise'}})); styles: {sorted(STYLES)}"
    )


# ---- matching patterns to modules ----------------------------------------------------------------------
def _pattern_regex(pattern: str) -> re.Pattern:
    body = r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split("."))
    return re.compile(rf"(?:.+\.)?{body}")


def resolve_plan(model: nn.Module, plan: Mapping[str, str], source: str = "plan") -> dict[str, str]:
    """Map each module name to its style. Raises for unknown styles and for patterns that match nothing."""
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        style = ALIASES.get(style, style)
        if style not in STYLES:
            raise ValueError(f"{source}: unknown tensor-parallel style {plan[pattern]!r} for {pattern!r}; "
                             f"known styles: {sorted(STYLES)}")
        regex = _pattern_regex(pattern)
        matched = [name for name in names if regex.fullmatch(name)]
        if not matched:
            generic = sorted({re.sub(r"\.\d+(?=\.|$)", ".*", n) for n in names})
            near = difflib.get_close_matches(pattern, generic, n=5, cutoff=0.4) or generic[:8]
            raise ValueError(f"{source}: pattern {pattern!r} matches no module of {type(model).__name__}; "
                             f"nearest module names: {near}")
        for name in matched:
            resolved.setdefault(name, style)
    return resolved


# ---- checks that need no collective --------------------------------------------------------------------
def _divisors_of(*numbers: int) -> list[int]:
    return [d for d in range(1, min(numbers) + 1) if all(n % d == 0 for n in numbers)]


def check_plan(model: nn.Module, resolved: Mapping[str, str], tp: int) -> None:
    """Raise, naming the module and a tp size that would work, where a style cannot split a module evenly."""
    config = getattr(model, "config", None)
    heads = {field: getattr(config, field) for field in ("num_attention_heads", "num_key_value_heads")
             if isinstance(getattr(config, field, None), int)}
    for field, count in heads.items():
        if count % tp:
            raise ValueError(
                f"tp_size={tp} does not divide {field}={count} of {type(model).__name__}: each tensor-parallel "
                f"rank must hold whole heads; tp sizes that work: {_divisors_of(*heads.values())}"
            )
    modules = dict(model.named_modules())
    for name, style in resolved.items():
        module = modules[name]
        dims = _split_dims(module, style)
        if dims is None:
            kinds = "nn.Embedding" if style == "embedding_rowwise" else "nn.Linear or nn.Embedding"
            raise ValueError(f"tensor-parallel style {style!r} applies to {kinds}, but {name!r} is a "
                             f"{type(module).__name__}")
        for what, size in dims:
            if size % tp:
                raise ValueError(f"tensor-parallel style {style!r} splits {name}.{what}={size} over tp_size={tp}, "
                                 f"which does not divide it; tp sizes that work: {_divisors_of(size)}")


def _split_dims(module: nn.Module, style: str) -> list[tuple[str, int]] | None:
    """The (attribute, size) pairs `style` splits over tp; None where the style does not apply to `module`."""
    if style in ("replicate", "sequence_parallel", "gather_sequence"):
        return []
    if isinstance(module, nn.Linear):
        if style in ("colwise", "colwise_gather_output"):
            return [("out_features", module.out_features)]
        if style == "rowwise":
            return [("in_features", module.in_features)]
    if isinstance(module, nn.Embedding):
        if style in ("colwise", "colwise_gather_output"):
            return [("embedding_dim", module.embedding_dim)]
        if style in ("rowwise", "embedding_rowwise"):
            return [("num_embeddings", module.num_embeddings)]
    return None


# ---- sequence parallelism: the plan's Megatron-SP form -------------------------------------------------
def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _with_block_inputs(model: nn.Module, resolved: dict[str, str], style_name: str) -> dict[str, str]:
    """Give the parent block of each Hugging Face attention/MLP column-wise layer `style_name`, so the block
    prepares its input once for all of its column-wise layers."""
    out = dict(resolved)
    if hasattr(model, "config") and hasattr(model, "base_model_prefix"):  # HF blocks: attention and MLP
        for name, style in resolved.items():
            parent = name.rpartition(".")[0]
            if style == "colwise" and parent and parent not in out:
                out[parent] = style_name
    return out


def with_sequence_parallel(model: nn.Module, resolved: dict[str, str]) -> dict[str, str]:
    """Add what Megatron-style SP needs to a resolved plan: norms run on sequence shards; embeddings left out of
    the plan hand over sequence shards; the parent block of a Hugging Face attention/MLP's column-wise layers
    gathers the sequence once for all of them (others gather per layer)."""
    out = dict(resolved)
    for name, module in model.named_modules():
        if name and name not in out and _is_norm(module):
            out[name] = "sequence_parallel"
    return {**out, **_with_block_inputs(model, resolved, "gather_sequence")}


def with_shared_inputs(model: nn.Module, resolved: dict[str, str]) -> dict[str, str]:
    """Without SP: the parent block of a Hugging Face attention/MLP's column-wise layers hands them its input as
    one replicated DTensor, so their input gradients are all-reduced once per block (see `_GatherSequence`)."""
    return _with_block_inputs(model, resolved, "share_input")


class _GatherSequence(ParallelStyle):
    """Hand a module's first input (positional, or the ``hidden_states`` keyword) to its children as one replicated
    DTensor: all-gathered along the sequence first when it arrives sequence-split (`sequence_parallel`).

    The column-wise layers inside (q, k, v; gate, up) then share that one DTensor, so backward adds their partial
    input gradients first and reduces them once -- one all-reduce (reduce-scatter with SP) per block instead of
    one per layer, which is what torch's `ColwiseParallel` does when each layer wraps a plain tensor itself.
    """

    def __init__(self, sequence_parallel: bool = True) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        split = [Shard(_SEQ)] if self.sequence_parallel else [Replicate()]

        def gather(_module, args, kwargs):
            if args:
                return (_to_replicated(args[0], device_mesh, split), *args[1:]), kwargs
            if "hidden_states" in kwargs:
                kwargs = dict(kwargs, hidden_states=_to_replicated(kwargs["hidden_states"], device_mesh, split))
            return args, kwargs

        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module


class _ShardSequenceOutput(ParallelStyle):
    """A replicated module (say, an embedding left out of the plan) hands over its output split along the
    sequence, as a DTensor, so the sequence-parallel region after it starts on shards."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        style = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(_SEQ),
                                    use_local_output=False)
        return style._apply(module, device_mesh)


class _Replicate(ParallelStyle):
    """Parameters become replicated DTensors; tensor inputs are wrapped as replicated, outputs made local."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def inputs(_mod, args, mesh):
            return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                         if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)

        def outputs(_mod, out, _mesh):
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, input_fn=inputs, output_fn=outputs)


def _to_replicated(x: Any, mesh, placements) -> Any:
    """`x` as a replicated DTensor; a plain tensor is first taken as laid out by `placements` on `mesh`."""
    if not isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, placements, run_check=False)
    return x.redistribute(mesh, [Replicate()])


def build_style(style: str, module: nn.Module, sequence_parallel: bool, gathered: bool,
                loss_parallel: bool = False) -> ParallelStyle | None:
    """The torch ParallelStyle for one module. `gathered`: an ancestor already all-gathers the sequence."""
    seq_in = Shard(_SEQ) if sequence_parallel and not gathered else Replicate()
    if style == "colwise":
        return ColwiseParallel(input_layouts=seq_in)
    if style == "colwise_gather_output" and loss_parallel:  # logits stay split over the vocabulary
        return ColwiseParallel(input_layouts=seq_in, output_layouts=Shard(-1), use_local_output=False)
    if style == "colwise_gather_output":
        return ColwiseParallel(input_layouts=seq_in, output_layouts=Replicate())
    if style in ("rowwise", "embedding_rowwise"):
        out = Shard(_SEQ) if sequence_parallel else Replicate()
        inp = Replicate() if isinstance(module, nn.Embedding) else Shard(-1)
        return RowwiseParallel(input_layouts=inp, output_layouts=out, use_local_output=not sequence_parallel)
    if style == "replicate":
        return _Replicate()
    if style == "sequence_parallel":
        return SequenceParallel(sequence_dim=_SEQ) if sequence_parallel else None
    if style == "gather_sequence":
        return _GatherSequence() if sequence_parallel else None
    if style == "share_input":
        return _GatherSequence(sequence_parallel=False)
    raise AssertionError(style)


# ---- applying it ---------------------------------------------------------------------------------------
def check_not_sharded(model: nn.Module, tp_mesh) -> None:
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            raise ValueError(
                f"prepare(): parameter {name!r} is already a DTensor on {param.device_mesh} (placements "
                f"{param.placements}); ndparallel applies tensor parallelism itself over {tp_mesh} -- pass the model "
                "with ordinary full weights (not one loaded with tp_plan= or already parallelised)"
            )


def tensor_parallel_styles(model: nn.Module, tp: int, config: TorchTensorParallelConfig,
                           plan: Mapping[str, str] | None = None) -> dict[str, ParallelStyle]:
    """Module name -> torch ParallelStyle for `model` split `tp` ways. Checks everything, communicates nothing,
    so bad plans and sizes fail on every rank before any collective."""
    chosen, source = choose_plan(model, plan, config.plan)
    resolved = resolve_plan(model, chosen, source)
    check_plan(model, resolved, tp)
    if config.sequence_parallel:
        resolved = with_sequence_parallel(model, resolved)
    else:
        resolved = with_shared_inputs(model, resolved)
    if config.loss_parallel and "colwise_gather_output" not in resolved.values():
        raise ValueError(f"loss_parallel=True needs the LM head in the plan as 'colwise_gather_output' ({source} "
                         "has none): that is the layer whose output stays split over the vocabulary")
    modules = dict(model.named_modules())
    gathering = [name for name, style in resolved.items() if style == "gather_sequence"]
    styles: dict[str, ParallelStyle] = {}
    for name, style in resolved.items():
        gathered = any(name.startswith(g + ".") for g in gathering)
        built = build_style(style, modules[name], config.sequence_parallel, gathered, config.loss_parallel)
        if built is not None:
            built.src_data_rank = None  # every rank holds the same full weights: each slices its own shard
            styles[name] = built
    if config.sequence_parallel:  # embeddings outside the plan hand the SP region sequence shards
        for name, module in modules.items():
            if isinstance(module, nn.Embedding) and name not in resolved:
                styles[name] = _ShardSequenceOutput()
    return styles


def check_tensor_parallel(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> None:
    """Raise, before any collective, if `model` cannot be split over ``tp`` with its plan (nothing to check at
    tp 1)."""
    if mesh.size("tp") > 1:
        check_not_sharded(model, mesh["tp"])
        tensor_parallel_styles(model, mesh.size("tp"), mesh.config.tp_handler, options.tp_plan)


def apply_tensor_parallel(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> nn.Module:
    """Shard `model` over ``tp`` with the styles of its plan (`tensor_parallel_styles`); nothing at tp 1."""
    if mesh.size("tp") == 1:
        return model
    handler = mesh.config.tp_handler
    styles = tensor_parallel_styles(model, mesh.size("tp"), handler, options.tp_plan)
    model = parallelize_module(model, mesh["tp"], styles)
    if handler.loss_parallel:
        _run_forward_in_loss_parallel(model)
    return model


# ---- vocabulary-parallel loss ----------------------------------------------------------------------------
def _run_forward_in_loss_parallel(model: nn.Module) -> None:
    """The model's forward (where Hugging Face models compute their loss) runs inside torch's `loss_parallel`,
    so cross-entropy works on vocabulary shards; the loss it returns is made an ordinary tensor again. Its
    backward must run in the context too: `Accelerator.backward` does that."""
    stack = contextlib.ExitStack()

    def enter(_module, _args):
        stack.enter_context(loss_parallel())

    def leave(_module, _args, output):
        stack.close()
        return _local_loss(output)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)


def _local_loss(output: Any) -> Any:
    """`output` with a DTensor ``loss`` (attribute, key or the output itself) replaced by its local value."""
    def local(x):
        return x.to_local() if isinstance(x, DTensor) else x

    if isinstance(output, DTensor):
        return local(output)
    if isinstance(output, dict) and "loss" in output:  # Hugging Face ModelOutput is a dict
        output["loss"] = local(output["loss"])
    elif isinstance(output, tuple) and hasattr(output, "_replace") and "loss" in output._fields:
        output = output._replace(loss=local(output.loss))
    return output
