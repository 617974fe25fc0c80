"""The tensor-parallel styles a plan names, and the torch ``ParallelStyle`` each becomes.

Most map to torch's own (`ColwiseParallel`, `RowwiseParallel`, `SequenceParallel`), with different layouts when
Megatron-style sequence parallelism is on; the rest are small ``ParallelStyle`` classes here. `param_placements` says
where each style puts a module's parameters over ``tp``, which is what tied weights must agree on
(`ndparallel.parallel.tensor`). Transformers' ``Conv1D`` (GPT-2: a Linear whose weight is stored transposed, ``(in,
out)``) is split like a Linear along the matching dimension.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

STYLES: dict[str, str] = {
    "colwise": "Linear/Conv1D/Embedding split along its output features; output stays split (feeds a rowwise layer)",
    "rowwise": "Linear/Conv1D split along its input features; input arrives split, partial outputs summed "
               "(all-reduce, or reduce-scatter along the sequence with sequence parallelism)",
    "colwise_gather_output": "colwise, then the output is all-gathered (replicated), e.g. an LM head, or a fused "
                             "layer (qkv_proj, gate_up_proj) whose output the model slices by global sizes",
    "packed_colwise": "a layer packing several projections along its output features (qkv_proj, gate_up_proj, "
                      "c_attn): each rank's output holds its slice of every projection (feeds a rowwise layer); "
                      "the weight is split as one matrix, the output re-laid by one all-to-all",
    "rowwise_split_input": "rowwise whose input arrives whole (after a colwise_gather_output layer): each rank "
                           "takes its slice of the input, partial outputs summed",
    "embedding_rowwise": "Embedding split along the vocabulary; each rank looks up its rows, results summed",
    "replicate": "parameters replicated over tp (as DTensors); inputs and outputs replicated",
    "replicate_dtensor_output": "replicate, with DTensor inputs and outputs kept as DTensors (a LoRA B after a "
                                "rowwise A under Megatron SP, whose outputs stay sequence-split DTensors)",
    "replicated_with_grad_allreduce": "parameters replicated over tp; the module runs on activations a colwise "
                                      "layer split (e.g. per-head q/k norms), so their gradients are summed over tp",
    "sharded_norm": "a norm over the features a colwise layer split (OLMo 2's q/k norms over the whole "
                    "projection): weight split with the features, statistics all-reduced over tp",
    "unsplit": "left whole and identical on every tp rank (ordinary parameters); for a module whose input is "
               "replicated, e.g. an MoE's experts (FSDP2 shards them along the expert dimension instead)",
    "sequence_parallel": "norm/dropout run on sequence-split activations (only with sequence_parallel=True)",
    "gather_sequence": "the module's first input (or `hidden_states`) arrives sequence-split and is all-gathered "
                       "before it runs (only with sequence_parallel=True; e.g. an attention or MLP block)",
}

# Hugging Face style names (transformers' own plans) that mean one of ours. "moe_tp_experts" splits each expert's
# intermediate features over tp in transformers, with "packed_colwise"/"rowwise" entries for the experts' weights;
# ndparallel keeps experts whole over tp (see `unsplit`) and absorbs those weight entries (`tensor.resolve_plan`).
ALIASES = {"colwise_rep": "colwise_gather_output", "rowwise_rep": "embedding_rowwise",
           "embedding_colwise": "colwise_gather_output", "moe_tp_experts": "unsplit"}

_SEQ = 1  # the sequence dimension of (batch, seq, hidden) activations


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D``: ``y = x @ weight + bias`` with ``weight`` of shape ``(nx, nf)`` = (in, out)."""
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and \
        tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None))


def is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def split_dims(module: nn.Module, style: str) -> list[tuple[str, int]] | None:
    """The (attribute, size) pairs `style` splits over tp; None where the style does not apply to `module`."""
    if style in ("replicate", "replicate_dtensor_output", "replicated_with_grad_allreduce", "unsplit",
                 "sequence_parallel", "gather_sequence"):
        return []
    colwise = style in ("colwise", "colwise_gather_output", "packed_colwise")
    rowwise = style in ("rowwise", "rowwise_split_input")
    if style == "packed_colwise" and isinstance(module, nn.Embedding):
        return None
    if isinstance(module, nn.Linear):
        if colwise:
            return [("out_features", module.out_features)]
        if rowwise:
            return [("in_features", module.in_features)]
    if is_conv1d(module):
        if colwise:
            return [("nf", module.nf)]
        if rowwise:
            return [("nx", module.nx)]
    if isinstance(module, nn.Embedding):
        if colwise:
            return [("embedding_dim", module.embedding_dim)]
        if style in ("rowwise", "embedding_rowwise"):
            return [("num_embeddings", module.num_embeddings)]
    if style == "sharded_norm" and is_norm(module):
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 1:
            return [("weight.shape[0]", weight.shape[0])]
    return None


def param_placements(module: nn.Module, style: str | None, sequence_parallel: bool) -> dict[str, Placement]:
    """Where `style` puts each direct parameter of `module` over tp; a parameter left out stays an ordinary tensor."""
    names = [n for n, _ in module.named_parameters(recurse=False)]
    if style is None or style in ("unsplit", "gather_sequence"):
        return {}
    if style in ("replicate", "replicate_dtensor_output", "replicated_with_grad_allreduce"):
        return dict.fromkeys(names, Replicate())
    if style == "sequence_parallel":
        return dict.fromkeys(names, Replicate()) if sequence_parallel else {}
    if style == "sharded_norm":
        return dict.fromkeys(names, Shard(0))
    colwise = style in ("colwise", "colwise_gather_output", "packed_colwise")
    if isinstance(module, nn.Embedding):
        return {"weight": Shard(1) if colwise else Shard(0)}
    out_dim = 1 if is_conv1d(module) else 0  # the dimension of the weight that holds the output features
    if colwise:
        return {n: Shard(out_dim if n == "weight" else 0) for n in names}
    return {n: Shard(1 - out_dim) if n == "weight" else Replicate() for n in names}


def build_style(style: str, module: nn.Module, sequence_parallel: bool, gathered: bool,
                loss_parallel: bool = False, packed: tuple[int, ...] = ()) -> ParallelStyle | None:
    """The torch ParallelStyle for one module (None: nothing to apply). `gathered`: an ancestor already all-gathers
    the sequence. `packed`: for "packed_colwise", the sizes of the projections packed along the output, in order."""
    if style == "packed_colwise":
        return PackedColwise(build_style("colwise", module, sequence_parallel, gathered), packed)
    seq_in = Shard(_SEQ) if sequence_parallel and not gathered else Replicate()
    seq_out = Shard(_SEQ) if sequence_parallel else Replicate()
    conv = is_conv1d(module)
    if type(module).__name__ == "Float8Linear" and style in ("colwise", "rowwise"):
        # mixed_precision="fp8" swapped it for torchao's float8 linear (`fp8`): torchao's styles cast its DTensor
        # inputs and weights to float8 the same way it does unsplit.
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        if style == "colwise":
            return Float8ColwiseParallel(input_layouts=seq_in)
        return Float8RowwiseParallel(input_layouts=Shard(-1), output_layouts=seq_out,
                                     use_local_output=not sequence_parallel)
    if style == "colwise":
        return (_Conv1DColwise if conv else ColwiseParallel)(input_layouts=seq_in)
    if style == "colwise_gather_output" and loss_parallel:  # logits stay split over the vocabulary
        return ColwiseParallel(input_layouts=seq_in, output_layouts=Shard(-1), use_local_output=False)
    if style == "colwise_gather_output":
        return (_Conv1DColwise if conv else ColwiseParallel)(input_layouts=seq_in, output_layouts=Replicate())
    if style in ("rowwise", "rowwise_split_input", "embedding_rowwise"):
        inp = Replicate() if isinstance(module, nn.Embedding) or style == "rowwise_split_input" else Shard(-1)
        return (_Conv1DRowwise if conv else RowwiseParallel)(input_layouts=inp, output_layouts=seq_out,
                                                             use_local_output=not sequence_parallel)
    if style == "replicate":
        return _Replicate()
    if style == "replicate_dtensor_output":
        return _Replicate(use_local_output=False)
    if style == "replicated_with_grad_allreduce":
        return _ReplicatedSummedGrad()
    if style == "sharded_norm":
        return _ShardedNorm()
    if style == "unsplit":
        return None
    if style == "sequence_parallel":
        return SequenceParallel(sequence_dim=_SEQ) if sequence_parallel else None
    if style == "gather_sequence":
        return _GatherSequence() if sequence_parallel else None
    if style == "share_input":
        return _GatherSequence(sequence_parallel=False)
    raise AssertionError(style)


# ---- styles of our own -----------------------------------------------------------------------------------------
def _distribute_params(module: nn.Module, mesh, placements: dict[str, Placement], src_data_rank: int | None) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, nn.Parameter(
            distribute_tensor(param, mesh, [placements[name]], src_data_rank=src_data_rank),
            requires_grad=param.requires_grad))


def _distribute_conv1d(style: ColwiseParallel | RowwiseParallel, kind: str, module: nn.Module, device_mesh):
    """`style` (colwise or rowwise) applied to transformers' Conv1D, whose weight is stored ``(in, out)``: the
    parameters placed by `param_placements` for `kind`, inputs and outputs converted as `style` does."""

    def partition(_name, mod, mesh):
        _distribute_params(mod, mesh, param_placements(mod, kind, False), style.src_data_rank)

    return distribute_module(module, device_mesh, partition,
                             lambda mod, inputs, mesh: style._prepare_input_fn(
                                 style.input_layouts, style.desired_input_layouts, mod, inputs, mesh),
                             lambda mod, outputs, mesh: style._prepare_output_fn(
                                 style.output_layouts, style.use_local_output, mod, outputs, mesh))


class _Conv1DColwise(ColwiseParallel):
    """`ColwiseParallel` for transformers' Conv1D: weight ``(in, out)`` split on dim 1, bias on dim 0."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return _distribute_conv1d(self, "colwise", module, device_mesh)


class _Conv1DRowwise(RowwiseParallel):
    """`RowwiseParallel` for transformers' Conv1D: weight ``(in, out)`` split on dim 0, bias replicated."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return _distribute_conv1d(self, "rowwise", module, device_mesh)


class _PerProjection(torch.autograd.Function):
    """Re-lay the output of a layer split as one matrix (rank r: columns [r*c, (r+1)*c) of the packed output) so that
    rank r holds its slice of every projection, in projection order -- one all-to-all over tp along the features.
    Backward sends the gradient back the same way."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, plan: tuple, group) -> torch.Tensor:
        order, inverse, send, receive = plan
        ctx.plan, ctx.group = plan, group
        return _exchange(y, order, send, receive, group, None)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        order, inverse, send, receive = ctx.plan
        return _exchange(grad, None, receive, send, ctx.group, inverse), None, None


def _exchange(x: torch.Tensor, order, send: list[int], receive: list[int], group, reorder_after) -> torch.Tensor:
    """All-to-all of `x`'s last dimension: columns `order` (or all, in place) go out in `send` counts per rank, and
    `receive` counts come in; `reorder_after` permutes the received columns."""
    if order is not None:
        x = x.index_select(-1, order)
    flat = x.movedim(-1, 0).contiguous()
    out = flat.new_empty((sum(receive), *flat.shape[1:]))
    dist.all_to_all_single(out, flat, output_split_sizes=receive, input_split_sizes=send, group=group)
    out = out.movedim(0, -1)
    if reorder_after is not None:
        out = out.index_select(-1, reorder_after)
    return out.contiguous()


def per_projection_plan(sizes: tuple[int, ...], tp: int, rank: int, device) -> tuple:
    """(the local columns in the order they are sent, its inverse, columns sent to each rank, columns received
    from each rank) for rank `rank` of `tp`, whose packed output has projections of `sizes` features."""
    total = sum(sizes)
    width = total // tp

    def wanted(d: int) -> list[int]:  # the global columns rank d ends up with, in order
        cols, offset = [], 0
        for size in sizes:
            part = size // tp
            cols += range(offset + d * part, offset + (d + 1) * part)
            offset += size
        return cols

    mine = range(rank * width, (rank + 1) * width)
    order, send = [], []
    for d in range(tp):
        cols = [c - rank * width for c in wanted(d) if c in mine]
        order += cols
        send.append(len(cols))
    target = wanted(rank)
    receive = [sum(1 for c in target if src * width <= c < (src + 1) * width) for src in range(tp)]
    order_t = torch.tensor(order, dtype=torch.long, device=device)
    return order_t, torch.argsort(order_t), send, receive


class PackedColwise(ParallelStyle):
    """"packed_colwise": the layer split as `base` (colwise) splits it, then its output re-laid per projection
    (`_PerProjection`), so each rank holds its slice of every one of the `sizes` projections."""

    def __init__(self, base: ParallelStyle, sizes: tuple[int, ...]) -> None:
        super().__init__()
        self.base, self.sizes = base, tuple(sizes)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self.base.src_data_rank = self.src_data_rank
        module = self.base._apply(module, device_mesh)
        group, plans = device_mesh.get_group(), {}

        def relayout(_module, _args, output):
            if output.device not in plans:  # index tensors on the output's device, built once
                plans[output.device] = per_projection_plan(self.sizes, device_mesh.size(),
                                                           device_mesh.get_local_rank(), output.device)
            return _PerProjection.apply(output, plans[output.device], group)

        module.register_forward_hook(relayout)
        return module


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


class ShardSequenceOutput(ParallelStyle):
    """A replicated module (say, an embedding left out of the plan) hands over its output split along the
    sequence, as a DTensor, so the sequence-parallel region after it starts on shards."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        style = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(_SEQ),
                                    use_local_output=False)
        return style._apply(module, device_mesh)


# torch 2.11's DTensor cannot flatten a sequence-split (batch, seq, features) activation into the (batch * seq,
# features) rows a Linear multiplies ("Attempted to flatten multiple dimensions, with dimension 1 being sharded");
# torch 2.12 and later can.
_FLATTENS_SPLIT_SEQUENCE = torch.torch_version.TorchVersion(torch.__version__) >= (2, 12)


def _split_along_sequence_only(x: Any) -> bool:
    return isinstance(x, DTensor) and x.dim() >= 3 and any(p.is_shard(_SEQ) for p in x.placements) and \
        not any(p.is_shard(0) for p in x.placements)


class _Replicate(ParallelStyle):
    """Parameters become replicated DTensors; tensor inputs are wrapped as replicated, outputs made local (or kept as
    DTensors, `use_local_output=False`). Where torch's DTensor cannot flatten a sequence-split input (torch 2.11, see
    `_FLATTENS_SPLIT_SEQUENCE`), the module runs on it with batch and sequence swapped -- split along its first
    dimension, which flattens -- and its output is swapped back: the same rows, the same products."""

    def __init__(self, use_local_output: bool = True) -> None:
        super().__init__()
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        swapped: list[bool] = []  # whether the running call's input was swapped

        def inputs(_mod, args, mesh):
            args = tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                         if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)
            swap = not _FLATTENS_SPLIT_SEQUENCE and bool(args) and _split_along_sequence_only(args[0])
            swapped[:] = [swap]
            return (args[0].transpose(0, _SEQ), *args[1:]) if swap else args

        def outputs(_mod, out, _mesh):
            if swapped and swapped.pop() and isinstance(out, torch.Tensor):
                out = out.transpose(0, _SEQ)
            return out.to_local() if isinstance(out, DTensor) and self.use_local_output else out

        return distribute_module(module, device_mesh, input_fn=inputs, output_fn=outputs)


class _SumGradients(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group` (Megatron's "f" operator)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _forward_with(module: nn.Module, swap: Callable[[DTensor], torch.Tensor]) -> None:
    """Run `module`'s forward with each of its DTensor parameters replaced by ``swap(parameter)``, then put them back.
    The parameters are read at call time, so FSDP2's all-gathered parameters are the ones swapped."""
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        saved = dict(module._parameters)
        try:
            for name, param in saved.items():
                if isinstance(param, DTensor):
                    module._parameters[name] = swap(param)
            return original(*args, **kwargs)
        finally:
            module._parameters.update(saved)

    module.forward = forward


class _ReplicatedSummedGrad(ParallelStyle):
    """transformers' ``replicated_with_grad_allreduce``: parameters replicated over tp; the module runs on this rank's
    part of activations a colwise layer split (Qwen3's and Gemma 3's per-head q/k norms see this rank's heads), so
    each rank's parameter gradient covers its part only and the gradients are summed over tp in backward. Inputs
    and outputs stay this rank's local tensors."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _distribute_params(module, device_mesh, dict.fromkeys(dict(module.named_parameters(recurse=False)),
                                                               Replicate()), self.src_data_rank)
        group = device_mesh.get_group()
        _forward_with(module, lambda p: _SumGradients.apply(p.to_local(), group))
        return module


class _ShardedNorm(ParallelStyle):
    """A norm over the last dimension of activations a colwise layer split along that dimension (OLMo 2 normalises q
    and k over the whole projection, all heads): its parameters are split the same way and it runs on DTensors, so
    the mean over the features is all-reduced over tp and the result is exactly the unsplit norm's."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def partition(_name, mod, mesh):
            _distribute_params(mod, mesh, dict.fromkeys(dict(mod.named_parameters(recurse=False)), Shard(0)),
                               self.src_data_rank)

        def inputs(_mod, args, mesh):
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Shard(-1)], run_check=False)
            return (x, *args[1:])

        def outputs(_mod, out, _mesh):
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, partition, inputs, outputs)


def _to_replicated(x: Any, mesh, placements) -> Any:
    """`x` as a replicated DTensor; a plain tensor is first taken as laid out by `placements` on `mesh`."""
    if not isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, placements, run_check=False)
    return x.redistribute(mesh, [Replicate()])


