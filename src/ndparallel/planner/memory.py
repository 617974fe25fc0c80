"""Memory per GPU: model states, activations and the transient buffers, term by term.

Everything is counted for the library's FSDP2 path (the script passes ``FullyShardedDataParallelPlugin``, as the
README's does), tensor by tensor:

- **parameters, gradients, optimizer states**: fp32 (master weights under bf16 too), each weight split over tp
  as the plan splits it, then sharded by FSDP2 over dp_shard x cp x sp, dim 0 padded to a multiple of that;
  AdamW keeps two fp32 moments per parameter.
- **gradient accumulation** (accumulation > 1, sharded, without ``sync_each_batch``): FSDP2 keeps the *unsharded*
  gradients in fp32 between micro-steps (``set_requires_gradient_sync(False)``) and reduce-scatters once.
- **activations saved for backward**, per decoder layer and token, c = bytes of the compute dtype, t = tp:
  two RMSNorms 2 h (4 + 2c) (an fp32 copy of the input, the normalised value and the output);
  attention q_width / t x (2c: query and output; 3c with sp, whose attention returns the output head-major and
  o_proj takes a copy; 2c + 4 with cp, whose all-gather kernel keeps its output in fp32) + 2 kv_width c / t, plus
  the log-sum-exp (heads / t x 4); MLP 4 I c / t (gate, up, their activation and product).
  Outside the layers: the final norm, and the log-softmax of the (gathered) logits, V x 4.
  With activation checkpointing only each layer's input is kept (h x c per token), and one layer's activations
  are rebuilt at a time in backward.
- **transient**: FSDP2's unsharded copies of two layers (current and prefetched; their gradients too in backward),
  the root unit (embedding, head) unsharded through forward and backward, and the loss's logits (compute dtype,
  an fp32 copy, their gradient: 8 bytes per logit beyond the saved log-softmax).
- **peak** = states + accumulation + saved activations + root unit + max(loss working set, layer buffers + one
  rebuilt layer); the profile's memory_reserve_gib (CUDA context, NCCL, fragmentation) is kept aside.
- **pipeline stages** (pp > 1), for the busiest stage: ceil(L / pp) decoder layers, and of the root unit the larger
  end -- the embedding (first stage) or the final norm and the head (last stage). The library's default schedule is
  1F1B with one micro-batch per stage, so the first stage keeps all pp micro-batches' activations alive at once (the
  micro-step's n tokens) for its layers; the loss works on one micro-batch (n / pp tokens) at a time.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from .layouts import Layout
from .model import ModelSpec
from .setting import FP32, OPTIMIZER_STATES, Setting, kv_width_local, local_shape, shard_numel


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    how: str  # the formula with its numbers, for --explain


@dataclass
class Memory:
    terms: dict[str, Term] = field(default_factory=dict)
    activations_without_checkpointing: float = 0.0
    activations_with_checkpointing: float = 0.0

    def add(self, name: str, value: float, how: str) -> None:
        self.terms[name] = Term(name, value, how)

    def __getitem__(self, name: str) -> float:
        return self.terms[name].bytes if name in self.terms else 0.0

    @property
    def states(self) -> float:
        return self["params"] + self["grads"] + self["optimizer"]

    @property
    def peak(self) -> float:
        return self["peak"]


def stage_layers(model: ModelSpec, layout: Layout) -> int:
    """Decoder layers the busiest pipeline stage runs (all of them without stages)."""
    return math.ceil(model.layers / layout.pp)


def stage_root(model: ModelSpec, layout: Layout) -> list[tuple[str, tuple[int, ...], int | None]]:
    """The root unit's weights on the busiest stage: all of them without stages; else the larger end, the embedding
    (first stage) or the final norm and the head (last stage)."""
    root = model.root_parameters()
    if layout.pp == 1:
        return root
    first = [p for p in root if p[0].startswith("embed_tokens")]
    last = [p for p in root if not p[0].startswith("embed_tokens")]
    return max(first, last, key=lambda params: sum(math.prod(shape) for _, shape, _ in params))


@functools.lru_cache(maxsize=4096)
def state_elements(model: ModelSpec, layout: Layout) -> tuple[int, int, int]:
    """(elements one rank holds after tp and FSDP2 sharding, elements per tp rank unsharded, one decoder layer's
    elements per tp rank unsharded), on the busiest pipeline stage."""
    held = per_tp = layer = 0
    layers = stage_layers(model, layout)
    for _, shape, dim in model.layer_parameters():
        local = local_shape(shape, dim, layout.tp)
        held += layers * shard_numel(local, layout.fsdp)
        layer += math.prod(local)
    per_tp = layers * layer
    for _, shape, dim in stage_root(model, layout):
        local = local_shape(shape, dim, layout.tp)
        held += shard_numel(local, layout.fsdp)
        per_tp += math.prod(local)
    return held, per_tp, layer


def root_elements(model: ModelSpec, layout: Layout) -> int:
    return sum(math.prod(local_shape(shape, dim, layout.tp)) for _, shape, dim in stage_root(model, layout))


def layer_activations(model: ModelSpec, layout: Layout, setting: Setting) -> tuple[float, str]:
    """Bytes one decoder layer saves for backward on one rank, without checkpointing."""
    n, c, t, h = setting.tokens(layout), setting.compute_bytes, layout.tp, model.hidden
    # Bytes per element of the query-sized tensors: query and output (the model's SDPA); a copy of the output for
    # o_proj once cp/sp attention returns it head-major; the all-gather CP kernel keeps its output in fp32.
    q_bytes = (c + FP32 + c) if layout.cp > 1 else (3 * c if layout.sp > 1 else 2 * c)
    qw, kw = model.q_width // t, kv_width_local(model, layout)
    mlp = (4 if model.gated else 2) * model.intermediate // t
    per_token = 2 * h * (FP32 + 2 * c) + 2 * FP32 + qw * q_bytes + 2 * kw * c + model.heads // t * FP32 + mlp * c
    return n * per_token, (f"{n} tokens x [norms 2x{h}x(4+2x{c}) + attention {qw}x{q_bytes} + 2x{kw}x{c} + lse "
                           f"{model.heads // t}x4 + MLP {mlp}x{c}] B")


def outside_activations(model: ModelSpec, layout: Layout, setting: Setting) -> tuple[float, str]:
    """Saved outside the decoder layers: final norm, log-softmax of the logits, token ids, rotary tables (under
    pipeline stages, for the one micro-batch the last stage holds at a time)."""
    n, c, h, v = setting.tokens(layout) // layout.pp, setting.compute_bytes, model.hidden, model.vocab
    rows = setting.micro_batch if layout.seq_split > 1 else 1  # rotary cos/sin: per sample once positions are given
    rope = 2 * rows * (setting.seq_len // layout.seq_split) * model.head_dim * c
    value = n * (h * (FP32 + 2 * c) + FP32) + n * v * FP32 + 2 * n * 8 + rope
    return value, f"{n} tokens x (final norm {h}x(4+2x{c}) + log-softmax {v}x4 + ids 16) + rotary {rope} B"


def estimate(model: ModelSpec, layout: Layout, setting: Setting) -> Memory:
    """Every memory term of one GPU for `layout` running `setting` (module docstring)."""
    mem = Memory()
    s, t, c, L = layout.fsdp, layout.tp, setting.compute_bytes, stage_layers(model, layout)
    held, per_tp, layer_elems = state_elements(model, layout)
    mem.add("params", held * FP32, f"{held:,} parameters (after tp={t}, fsdp={s}, padding) x 4 B (fp32)")
    mem.add("grads", held * FP32, f"{held:,} x 4 B (fp32)")
    states = OPTIMIZER_STATES[setting.optimizer]
    mem.add("optimizer", held * FP32 * states, f"{held:,} x {states} states x 4 B ({setting.optimizer})")
    if setting.accumulation > 1 and s > 1 and not setting.sync_each_batch:
        mem.add("grad_accumulation", per_tp * FP32, f"{per_tp:,} unsharded gradients x 4 B kept between "
                f"{setting.accumulation} micro-steps (FSDP2 without sync_each_batch)")
    if s == 1 and c != FP32:
        mem.add("unsharded_params", per_tp * c, f"{per_tp:,} x {c} B: bf16 copies kept through the step (one-rank "
                "shard group: no resharding)")

    layer, layer_how = layer_activations(model, layout, setting)
    outside, outside_how = outside_activations(model, layout, setting)
    n = setting.tokens(layout)
    mem.activations_without_checkpointing = L * layer + outside
    mem.activations_with_checkpointing = L * n * model.hidden * c + outside
    if setting.checkpointing:
        mem.add("activations", mem.activations_with_checkpointing,
                f"{L} layers x {n} tokens x {model.hidden} x {c} B (layer inputs) + outside the layers: {outside_how}")
        mem.add("recompute", layer, f"one layer rebuilt in backward: {layer_how}")
    else:
        mem.add("activations", mem.activations_without_checkpointing,
                f"{L} layers x {layer_how} + outside the layers: {outside_how}")

    if s > 1:
        root = root_elements(model, layout)
        mem.add("root_unsharded", root * c, f"embedding, norm and head unsharded: {root:,} x {c} B")
        rs_copy = layer_elems * FP32 if c != FP32 else 0
        mem.add("layer_buffers", 4 * layer_elems * c + rs_copy,
                f"2 layers' unsharded parameters and gradients: 4 x {layer_elems:,} x {c} B"
                + (f" + one layer's fp32 gradients for the reduce-scatter ({layer_elems:,} x 4 B)" if rs_copy else ""))
    n = n // layout.pp  # the loss works on one pipeline micro-batch at a time
    gathered = n * model.vocab // t * c if t > 1 else 0
    mem.add("loss_buffers", n * model.vocab * 8 + gathered,
            f"{n} tokens x {model.vocab} logits x 8 B (compute-dtype logits + fp32 copy, or their gradients)"
            + (f" + the local logits before the tp gather ({gathered:,} B)" if gathered else ""))

    base = (mem.states + mem["grad_accumulation"] + mem["unsharded_params"] + mem["activations"]
            + mem["root_unsharded"])
    working = max(mem["loss_buffers"], mem["layer_buffers"] + mem["recompute"])
    mem.add("peak", base + working, "states + accumulation + unsharded copies + activations + root unit + "
            "max(loss buffers, layer buffers + rebuilt layer)")
    return mem
