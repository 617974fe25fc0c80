"""Tensor parallelism over the ``tp`` view, from plans that are data.

A plan is a dict from module-name pattern to style name. ``*`` in a pattern matches one dotted segment
(``"layers.*.mlp.up_proj"``); a pattern matches a module whose full name it matches, or whose name ends with
it after a whole segment (``"layers.*.mlp.up_proj"`` matches ``model.layers.0.mlp.up_proj``). Where a module
matches several patterns, the first one wins.

Styles (`styles.STYLES`, with transformers' names in `styles.ALIASES`): each maps to a torch
``ParallelStyle``, with different layouts when Megatron-style sequence parallelism is on. With it, the activations
between tensor-parallel regions (the residual stream, norms, dropout) are split along the sequence (dim 1) over
``tp``; column-wise layers all-gather them, row-wise layers reduce-scatter back into them:

    embedding ─Shard(1)─> norm ─> [gather] q,k,v (colwise) ─> attention ─> o (rowwise) ─reduce-scatter─> + ...

Where a plan comes from, first match wins: the one the user passed (``prepare(model, tp_plan=...)``, then
``TorchTensorParallelConfig(plan=...)``), ndparallel's plan for the model's family where it replaces the model's own
(`ndparallel.models.families.FAMILIES`), the Hugging Face model's own (``config.base_model_tp_plan`` under the base
model's prefix plus the class ``_tp_plan``), a built-in plan for the family (`BUILTIN_PLANS`, by ``config.model_type``).

Tied weights (an LM head sharing the input embedding's matrix) are split once: every module using a tied parameter
must place it alike, so a head split along the vocabulary makes the embedding vocabulary-parallel too
(`tie_styles`), and after splitting, the modules share one DTensor parameter again (`_retie`), whose gradient sums
both uses -- as in the unsplit model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import re
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module

from ...configuration.handlers import TorchTensorParallelConfig
from ...distributed.mesh import ParallelMesh
from ...models.families import BUILTIN_PLANS, FAMILIES, Fused
from ..options import PrepareOptions
from ..adapted import adapter_free
from ..target import Target, target_of
from .adapters import expand_adapters, layer_of
from .styles import (ALIASES, STYLES, PackedColwise, ShardSequenceOutput, build_style, is_conv1d, is_norm,
                     param_placements, split_dims)

__all__ = ["ALIASES", "BUILTIN_PLANS", "STYLES", "apply_tensor_parallel", "check_plan", "check_tensor_parallel",
           "choose_plan", "hf_plan", "plan_styles", "resolve_plan", "tensor_parallel_styles", "tie_styles",
           "with_sequence_parallel"]

USER_SOURCES = ("prepare(tp_plan=...)", "TorchTensorParallelConfig(plan=...)")


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


def _model_type(inner: nn.Module) -> str | None:
    return getattr(getattr(inner, "config", None), "model_type", None)


def choose_plan(model: nn.Module, *user_plans: Mapping[str, str] | None,
                inner: nn.Module | None = None) -> tuple[dict[str, str], str]:
    """The plan for `model` and where it came from: the first user plan given, ndparallel's plan for the family where
    it replaces the model's own, the model's own, or a built-in one. `inner`: `model` under its adapter wrapper, as
    `parallelize` peeled it (`target.Target`); peeled here when not given."""
    for plan, source in zip(user_plans, USER_SOURCES):
        if plan is not None:
            if not isinstance(plan, Mapping):
                raise TypeError(f"{source}: a tensor-parallel plan is a dict of pattern -> style, got "
                                f"{type(plan).__name__}")
            return dict(plan), source
    inner = adapter_free(model) if inner is None else inner
    model_type = _model_type(inner)
    family = FAMILIES.get(model_type)
    if family is not None and family.plan and family.replaces_own_plan:
        return dict(family.plan), f"ndparallel's plan for {model_type!r} (used because {family.replaces_own_plan})"
    plan = hf_plan(inner)  # under PEFT, the adapted model's plan (its patterns match the wrappers)
    if plan:
        return plan, f"{type(model).__name__}'s own plan (config.base_model_tp_plan)"
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


def resolve_plan(model: nn.Module, plan: Mapping[str, str], source: str = "plan",
                 strict: bool = True) -> dict[str, str]:
    """Map each module name to its style (transformers' style names translated to ours).

    Raises for unknown styles, and -- with `strict`, for plans a user wrote -- for patterns that match nothing (a
    model's own plan may name modules a given configuration does not have, e.g. dense MLPs of an MoE). transformers'
    entries for the weights of an MoE's experts (``experts.gate_up_proj``: ``packed_colwise``...) are absorbed by the
    experts' own entry (``moe_tp_experts``: kept whole over tp); other entries naming a parameter are refused.
    """
    names = [name for name, _ in model.named_modules() if name]
    owners = {name: name.rpartition(".")[0] for name, _ in model.named_parameters(remove_duplicate=False)}
    resolved: dict[str, str] = {}
    param_entries: list[tuple[str, list[str]]] = []
    for pattern, style in plan.items():
        regex = _pattern_regex(pattern)
        matched = [name for name in names if regex.fullmatch(name)]
        if not matched and (params := [p for p in owners if regex.fullmatch(p)]):
            param_entries.append((pattern, params))
            continue
        style = ALIASES.get(style, style)
        if style not in STYLES:
            raise ValueError(f"{source}: unknown tensor-parallel style {plan[pattern]!r} for {pattern!r}; "
                             f"known styles: {sorted(STYLES)} (and transformers' names {sorted(ALIASES)})")
        if not matched:
            if not strict:
                continue
            generic = sorted({re.sub(r"\.\d+(?=\.|$)", ".*", n) for n in names})
            near = difflib.get_close_matches(pattern, generic, n=5, cutoff=0.4) or generic[:8]
            raise ValueError(f"{source}: pattern {pattern!r} matches no module of {type(model).__name__}; "
                             f"nearest module names: {near}")
        for name in matched:
            resolved.setdefault(name, style)
    for pattern, params in param_entries:
        stray = sorted({owners[p] for p in params if resolved.get(owners[p]) != "unsplit"})
        if stray:
            raise ValueError(f"{source}: {pattern!r} names parameters ({params[0]}...), not modules; ndparallel "
                             f"splits whole modules -- give {stray[0]!r} a style instead")
    return resolved


# ---- tied weights ---------------------------------------------------------------------------------------
def tied_groups(model: nn.Module) -> list[list[tuple[str, str]]]:
    """(module name, parameter name) of every use of each parameter that several modules share, in model order."""
    uses: dict[int, list[tuple[str, str]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owner, _, attr = name.rpartition(".")
        uses.setdefault(id(param), []).append((owner, attr))
    return [group for group in uses.values() if len(group) > 1]


def _style_placing(module: nn.Module, attr: str, placement) -> str | None:
    """A style that puts `module`'s `attr` at `placement`: what completes a tie (an embedding tied to a vocabulary-split
    head becomes vocabulary-parallel; a head tied to such an embedding gathers its output)."""
    for style in ("embedding_rowwise", "colwise_gather_output"):
        if split_dims(module, style) is not None and param_placements(module, style, False).get(attr) == placement:
            return style
    return None


def tie_styles(model: nn.Module, resolved: Mapping[str, str], sequence_parallel: bool = False) -> dict[str, str]:
    """`resolved`, with every module that uses a tied parameter placing it like the others.

    Where the plan splits a tied parameter through one module and leaves another user of it out (transformers' plans
    split the LM head over the vocabulary but leave the input embedding out), the other gets the style that splits
    the parameter the same way; where two styles would split it differently, this raises.
    """
    out = dict(resolved)
    modules = dict(model.named_modules())
    for group in tied_groups(model):
        placed = {(m, a): param_placements(modules[m], out.get(m), sequence_parallel).get(a) for m, a in group}
        splits = {p for p in placed.values() if p is not None}
        if not splits:
            continue
        described = ", ".join(f"{m or type(model).__name__}.{a} ({out.get(m, 'not in the plan')}: {p or 'whole'})"
                              for (m, a), p in placed.items())
        if len(splits) > 1:
            raise ValueError(f"tied parameter used as {described}: the plan splits it differently in each place, "
                             "but it is one matrix; give both modules styles that split it alike (for an LM head "
                             "tied to the input embedding: 'colwise_gather_output' and 'embedding_rowwise')")
        (target,) = splits
        for (m, a), p in placed.items():
            if p is None:
                style = _style_placing(modules[m], a, target)
                if style is None or m in out:
                    raise ValueError(f"tied parameter used as {described}: {m!r} cannot take the same split; "
                                     "give it a style that splits the parameter alike, or leave both out of the plan")
                out[m] = style
    return out


def _retie(model: nn.Module, groups: list[list[tuple[str, str]]]) -> None:
    """After splitting, point every use of a tied parameter at the first use's (one DTensor, one gradient)."""
    modules = dict(model.named_modules())
    for (first_module, first_attr), *others in groups:
        shared = getattr(modules[first_module], first_attr)
        for module, attr in others:
            setattr(modules[module], attr, shared)


# ---- checks that need no collective --------------------------------------------------------------------
def _divisors_of(*numbers: int) -> list[int]:
    return [d for d in range(1, min(numbers) + 1) if all(n % d == 0 for n in numbers)]


def check_plan(model: nn.Module, resolved: Mapping[str, str], tp: int, inner: nn.Module | None = None) -> None:
    """Raise, naming the module and a tp size that would work, where a style cannot split a module evenly, and where
    a fused layer's output would stay split. `inner`: as for `choose_plan`."""
    inner = adapter_free(model) if inner is None else inner
    config = getattr(inner, "config", None)
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
        dims = split_dims(module, style)
        if dims is None:
            raise ValueError(f"tensor-parallel style {style!r} applies to {_applies_to(style)}, but {name!r} is a "
                             f"{type(module).__name__}")
        for what, size in dims:
            if size % tp:
                raise ValueError(f"tensor-parallel style {style!r} splits {name}.{what}={size} over tp_size={tp}, "
                                 f"which does not divide it; tp sizes that work: {_divisors_of(size)}")
    for name, style in resolved.items():
        fused = _fused_entry(_model_type(inner), name)
        if style == "colwise" and fused is not None:
            raise ValueError(
                f"{name!r} packs {fused.what} in one weight; 'colwise' would leave each tp rank whole projections "
                "and the model would slice them by their global sizes, pairing the wrong parts -- give it "
                "'packed_colwise' (each rank its slice of every projection) and the layer after it 'rowwise', or "
                "'colwise_gather_output' and the layer after it 'rowwise_split_input'")
        if style == "packed_colwise":
            packed_sizes(model, name, tp, inner)  # raises where the projections are unknown or not divisible


def _fused_entry(model_type: str | None, name: str) -> Fused | None:
    """The family's description of the fused layer `name` (or of the layer an adapter's part `name` belongs to), if it
    is one."""
    family = FAMILIES.get(model_type)
    for pattern, fused in (family.fused if family else {}).items():
        if _pattern_regex(pattern).fullmatch(layer_of(name)):
            return fused
    return None


def packed_sizes(model: nn.Module, name: str, tp: int, inner: nn.Module | None = None) -> tuple[int, ...]:
    """The features of each projection packed in layer `name` (a "packed_colwise" layer), checked to split over tp.
    `inner`: as for `choose_plan`."""
    inner = adapter_free(model) if inner is None else inner
    fused = _fused_entry(_model_type(inner), name)
    if fused is None:
        known = {t: list(f.fused) for t, f in FAMILIES.items() if f.fused}
        raise ValueError(f"tensor-parallel style 'packed_colwise' for {name!r}: ndparallel does not know which "
                         f"projections {type(model).__name__} packs there (it knows {known}); use "
                         "'colwise_gather_output' and 'rowwise_split_input' after it")
    module = dict(model.named_modules())[name]
    features = module.nf if is_conv1d(module) else module.out_features
    parts = fused.parts(inner.config)
    if features % sum(parts):
        raise ValueError(f"{name!r} has {features} output features, not {fused.what} in the proportions {parts}")
    sizes = tuple(features // sum(parts) * part for part in parts)
    if any(size % tp for size in sizes):
        raise ValueError(f"tensor-parallel style 'packed_colwise' splits each of {fused.what} in {name!r} (features "
                         f"{sizes}) over tp_size={tp}, which does not divide them; tp sizes that work: "
                         f"{_divisors_of(*sizes)}")
    return sizes


def _applies_to(style: str) -> str:
    if style == "embedding_rowwise":
        return "nn.Embedding"
    if style == "sharded_norm":
        return "norms with a 1-D weight"
    return "nn.Linear, transformers' Conv1D or nn.Embedding"


def _check_sequence_parallel_coverage(model: nn.Module, resolved: Mapping[str, str]) -> None:
    """With Megatron-style SP, a module with parameters that no style covers runs on sequence shards, so each tp rank's
    gradient would cover its own tokens only; refuse instead of training it silently wrong."""
    replicated = [name for name, style in resolved.items() if style == "replicate"]
    uncovered = [name for name, module in model.named_modules()
                 if name and any(True for _ in module.parameters(recurse=False))
                 and resolved.get(name) in (None, "unsplit") and not isinstance(module, nn.Embedding)
                 and not any(name.startswith(r + ".") for r in replicated)]
    if uncovered:
        raise ValueError(
            f"TorchTensorParallelConfig(sequence_parallel=True): {uncovered[:4]} hold parameters the plan does not "
            "cover; they would run on sequence shards with gradients over this rank's tokens only (e.g. the router "
            "and experts of a mixture-of-experts model); use sequence_parallel=False")


# ---- sequence parallelism: the plan's Megatron-SP form -------------------------------------------------
def _with_block_inputs(model: nn.Module, resolved: dict[str, str], style_name: str) -> dict[str, str]:
    """Give the parent block of each Hugging Face attention/MLP column-wise layer `style_name`, so the block
    prepares its input once for all of its column-wise layers."""
    out = dict(resolved)
    if hasattr(model, "config") and hasattr(model, "base_model_prefix"):  # HF blocks: attention and MLP
        for name, style in resolved.items():
            parent = layer_of(name).rpartition(".")[0]  # an adapter's parts: the block around the wrapped layer
            if style == "colwise" and parent and parent not in out:
                out[parent] = style_name
    return out


def with_sequence_parallel(model: nn.Module, resolved: dict[str, str]) -> dict[str, str]:
    """Add what Megatron-style SP needs to a resolved plan: norms run on sequence shards; embeddings left out of
    the plan hand over sequence shards; the parent block of a Hugging Face attention/MLP's column-wise layers
    gathers the sequence once for all of them (others gather per layer)."""
    out = dict(resolved)
    for name, module in model.named_modules():
        if name and name not in out and is_norm(module):
            out[name] = "sequence_parallel"
    return {**out, **_with_block_inputs(model, resolved, "gather_sequence")}


def with_shared_inputs(model: nn.Module, resolved: dict[str, str]) -> dict[str, str]:
    """Without SP: the parent block of a Hugging Face attention/MLP's column-wise layers hands them its input as
    one replicated DTensor, so their input gradients are all-reduced once per block
    (`styles._GatherSequence`)."""
    return _with_block_inputs(model, resolved, "share_input")


# ---- applying it ---------------------------------------------------------------------------------------
def check_not_sharded(model: nn.Module, tp_mesh) -> None:
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            raise ValueError(
                f"prepare(): parameter {name!r} is already a DTensor on {param.device_mesh} (placements "
                f"{param.placements}); ndparallel applies tensor parallelism itself over {tp_mesh} -- pass the model "
                "with ordinary full weights (not one loaded with tp_plan= or already parallelised)"
            )


def plan_styles(model: nn.Module, tp: int, config: TorchTensorParallelConfig,
                plan: Mapping[str, str] | None = None, strict: bool = True,
                inner: nn.Module | None = None) -> tuple[dict[str, str], str]:
    """Module name -> style name for `model` split `tp` ways (the chosen plan resolved, ties completed, checked),
    and where the plan came from. `strict` False: a plan a user wrote may name modules `model` lacks (a model cut to
    its pipeline stages; the whole model was checked first). `inner`: as for `choose_plan`."""
    inner = adapter_free(model) if inner is None else inner
    chosen, source = choose_plan(model, plan, config.plan, inner=inner)
    resolved = resolve_plan(model, chosen, source, strict=strict and source in USER_SOURCES)
    resolved = tie_styles(model, resolved, config.sequence_parallel)
    resolved = expand_adapters(model, resolved, config.sequence_parallel)  # PEFT's LoRA layers: their parts
    check_plan(model, resolved, tp, inner)
    return resolved, source


def resolve_tensor_parallel(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions, target: Target,
                            strict: bool = True) -> Target:
    """`target` with the plan of `model` (the whole model, before any cut) resolved over ``tp``, once: `parallelize`
    does this at its entry, and every tensor-parallel step reads it (`Target.tp_plan`). Raises, before any collective,
    where the model is already sharded or the plan cannot split it. Unchanged at tp 1. `strict`: as for
    `plan_styles`."""
    if mesh.size("tp") == 1:
        return target
    check_not_sharded(model, mesh["tp"])
    plan, source = plan_styles(model, mesh.size("tp"), options.tp_handler, options.tp_plan,
                               strict=strict, inner=target.inner)
    return dataclasses.replace(target, tp_plan=plan, tp_source=source)


def tensor_parallel_styles(model: nn.Module, tp: int, config: TorchTensorParallelConfig,
                           plan: Mapping[str, str] | None = None, strict: bool = True,
                           target: Target | None = None) -> dict[str, ParallelStyle]:
    """Module name -> torch ParallelStyle for `model` split `tp` ways. Checks everything, communicates nothing,
    so bad plans and sizes fail on every rank before any collective. With a `target` whose plan is resolved
    (`resolve_tensor_parallel`), its styles for the modules `model` holds (all of them; a pipeline stage's own),
    resolved nowhere again."""
    target = Target.of(model) if target is None else target
    if target.tp_plan is not None:
        modules = dict(model.named_modules())
        resolved, source = {n: s for n, s in target.tp_plan.items() if n in modules}, target.tp_source
    else:
        resolved, source = plan_styles(model, tp, config, plan, strict, inner=target.inner)
    if config.sequence_parallel:
        resolved = with_sequence_parallel(model, resolved)
        _check_sequence_parallel_coverage(model, resolved)
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
        packed = packed_sizes(model, name, tp, target.inner) if style == "packed_colwise" else ()
        built = build_style(style, modules[name], config.sequence_parallel, gathered, config.loss_parallel, packed)
        if built is not None:
            built.src_data_rank = None  # every rank holds the same full weights: each slices its own shard
            styles[name] = built
    if config.sequence_parallel:  # embeddings outside the plan hand the SP region sequence shards
        for name, module in modules.items():
            if isinstance(module, nn.Embedding) and name not in resolved:
                styles[name] = ShardSequenceOutput()
    return styles


def check_tensor_parallel(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> None:
    """Raise, before any collective, if `model` cannot be split over ``tp`` with its plan (nothing to check at
    tp 1)."""
    if mesh.size("tp") > 1:
        target = target_of(model, options)
        if target.tp_plan is None:  # called on its own: resolve here
            target = resolve_tensor_parallel(model, mesh, options, target)
        tensor_parallel_styles(model, mesh.size("tp"), options.tp_handler, target=target)


def apply_tensor_parallel(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> nn.Module:
    """Shard `model` over ``tp`` with the styles of its plan (`tensor_parallel_styles`); nothing at tp 1."""
    if mesh.size("tp") == 1:
        return model
    handler = options.tp_handler
    target = target_of(model, options)
    if target.tp_plan is None:  # called on its own: resolve here
        target = resolve_tensor_parallel(model, mesh, options, target, strict=mesh.size("pp") == 1)
    styles = tensor_parallel_styles(model, mesh.size("tp"), handler, target=target)
    groups = tied_groups(model)
    model = parallelize_module(model, mesh["tp"], styles)
    _retie(model, groups)
    _localize_packed(model, mesh.size("tp"), [n for n, s in styles.items() if isinstance(s, PackedColwise)],
                     target.model_type)
    if handler.loss_parallel:
        _run_forward_in_loss_parallel(model)
    return model


class _ConfigView:
    """A module's view of a shared config with some fields overridden (the attention of one tp rank counts its own
    heads); every other field reads through to the config itself."""

    def __init__(self, config: Any, **fields: Any) -> None:
        base = config._config if isinstance(config, _ConfigView) else config
        fields = {**(config._fields if isinstance(config, _ConfigView) else {}), **fields}
        object.__setattr__(self, "_config", base)
        object.__setattr__(self, "_fields", fields)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy/pickle protocols see this object, not the config (deepcopy keeps the view)
            raise AttributeError(name)
        fields = object.__getattribute__(self, "_fields")
        return fields[name] if name in fields else getattr(object.__getattribute__(self, "_config"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._config, name, value)


def _localize_packed(model: nn.Module, tp: int, names: list[str], model_type: str | None) -> None:
    """Tell the parent of each packed_colwise layer the sizes it now sees (`ndparallel.models.families.Fused.local`),
    divided by tp (once per layer: an adapter's B, split with its base layer, tells nobody)."""
    modules = dict(model.named_modules())
    for name in names:
        if layer_of(name) != name and not name.endswith(".base_layer"):
            continue
        fused = _fused_entry(model_type, name)
        parent = modules[layer_of(name).rpartition(".")[0]]
        for attr in fused.local if fused else ():
            if attr.startswith("config."):
                field = attr.removeprefix("config.")
                parent.config = _ConfigView(parent.config, **{field: getattr(parent.config, field) // tp})
            else:
                setattr(parent, attr, getattr(parent, attr) // tp)


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
