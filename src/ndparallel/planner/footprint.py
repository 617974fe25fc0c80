"""Memory per GPU: model states, activations and the transient buffers, term by term.

Everything is counted for the library's FSDP2 path (the script passes ``FullyShardedDataParallelPlugin``, as the
README's does), tensor by tensor:

- **parameters, gradients, optimizer states**: fp32 (master weights under bf16 too), each weight split over tp
  as the plan splits it, then sharded by FSDP2 over dp_shard x cp x sp, dim 0 padded to a multiple of that;
  AdamW keeps two fp32 moments per parameter.
- **gradient accumulation** (accumulation > 1, sharded, without ``sync_each_batch``): FSDP2 keeps the *unsharded*
  gradients in fp32 between micro-steps (``set_requires_gradient_sync(False)``) and reduce-scatters once.
- **activations saved for backward**, per decoder layer and token, c = bytes of the compute dtype, t = tp:
  two RMSNorms 2 h (4 + 2c) (an fp32 copy of the input, the normalised value and the output; 2 h 2c fused:
  the input instead of its fp32 copy, ``MemoryKwargs(fused_rms_norm=True)``, so every norm term loses its 4);
  attention q_width / t x (2c: query and output; 3c with sp, whose attention returns the output head-major and
  o_proj takes a copy; so does cp's, whose kernels keep their output in the inputs' dtype) + 2 kv_width c / t, plus
  the log-sum-exp (heads / t x 4); MLP 4 I c / t (gate, up, their activation and product).
  Outside the layers: the final norm, and (not with the chunked loss) the log-softmax of the (gathered) logits, V x 4.
  With activation checkpointing only each layer's input is kept (h x c per token), and one layer's activations
  are rebuilt at a time in backward.
- **transient**: FSDP2's unsharded copies of two layers (current and prefetched; their gradients too in backward),
  the root unit (embedding, head) unsharded through forward and backward, the head's unsharded gradient held through
  backward, and the loss's working set (`loss_buffers`): Hugging Face's loss keeps the logits (compute dtype), their
  fp32 copy and gradient (8 bytes per logit beyond the saved log-softmax); the chunked loss
  (``MemoryKwargs(chunked_loss=...)``, on by default) one chunk's logits, the head's fp32 gradient and the hidden
  states' gradient, and saves no log-softmax.
- **a layer's backward buffers** (`backward_transient`): the largest of what one op of the layer allocates in its
  backward beyond the saved activations -- a tiled MLP's rebuilt tile, the attention's gradients (over head chunks,
  one chunk's rebuilt q/k/v/o and gradients with the shard's gradient buffers: `attention_backward`; under cp the
  all-gather kernel's whole-sequence key/value, their fp32 gradients and the reduce-scatter's parts, or under
  ``cp_comm_strategy="ring"`` (`Recipe.cp_strategy`) the ring's K/V blocks in flight (1/cp of the sequence), its
  fp32 query gradient and key/value accumulators, for all the rank's heads or one chunk's: `cp_kv`, the kernels' own
  counts), an RMSNorm's
  working set (`norm_backward`; a fused norm's over chunks of tokens, beside its input gradient) -- added to the
  rebuilt layer (AC) or alone (no AC), in the ``recompute`` term.
- **head-chunked attention** (``MemoryKwargs(ulysses_head_chunks="auto")``, cp or sp > 1): the attention keeps the
  sequence-sharded q/k/v and o_proj's copy of the output instead of the full-sequence heads, chunks as the library's
  "auto" picks them (`head_chunks`; under cp alone the all-gather runs over the chunks, no all-to-all). For Llama without tp the library runs the projections' backward inside each
  chunk too (`chunked_block`, `parallel.sequence.block`): the attention keeps nothing beyond the norm's output, and
  its buffers are the larger of the block's forward (the shard's q/k/v and output while it runs) and its backward
  (the hidden states' gradient and one chunk's buffers), the library's `block.forward_bytes` / `backward_bytes`.
- **tiled MLPs** keep no MLP intermediate for backward and rebuild one tile's in it; **activation offloading** keeps
  two layers' inputs on the GPU (the others in the offload's host pool, pinned: the ``host_offload`` term, not GPU
  memory; each layer's input a block of its bytes aligned, `parallel.memory.host_pool.aligned`).
- **FSDP2's CPU offload** (``cpu_offload=True``, `offload`): the parameters, gradients and optimizer state in host
  memory (the ``host_*`` terms), none on the GPU, which keeps the staging of the copies and the units it computes:
  every group reshards after forward then (`parallel.gathered.reshards_after_forward`), a one-rank group too, whose
  units FSDP2 gathers in their own pre-hooks -- one layer's parameters at a time, no prefetched second.
- **allocated** = states + accumulation + unsharded copies + saved activations + root unit + max(loss working set,
  head gradient + layer buffers + one rebuilt layer + offload staging), the sum of `peak_parts`; **peak** =
  allocated + the profile's ``fragmentation`` x (allocated - model states): the caching allocator's blocks reserved
  and not in use at the peak, so the peak is the predicted ``torch.cuda.max_memory_reserved`` (tuned without
  ``expandable_segments``; under it the reserve is unmeasured and the same fraction is kept). The profile's
  memory_reserve_gib (CUDA context, NCCL: memory outside torch's allocator) is kept aside from the budget.
- **pipeline stages** (pp > 1), for the busiest stage: ceil(L / pp) decoder layers, and of the root unit the larger
  end -- the embedding (first stage) or the final norm and the head (last stage). The library's default schedule is
  1F1B with one micro-batch per stage, so the first stage keeps all pp micro-batches' activations alive at once (the
  micro-step's n tokens) for its layers; the loss works on one micro-batch (n / pp tokens) at a time.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from ..distributed.layout import Layout
from ..parallel.gathered import reshards_after_forward  # the library's own rule, not a copy
from ..parallel.memory.host_pool import aligned
from ..parallel.memory.rms_norm import OWN_BACKWARD_BYTES  # the library's own counts, not copies
from ..parallel.memory.rms_norm import backward_bytes as norm_backward_bytes, chunk_tokens as norm_chunk_tokens
from ..parallel.memory.rms_norm import token_bytes as norm_token_bytes
from ..parallel.sequence import allgather, block, ring
from ..parallel.sequence.ulysses import chunk_bytes, kv_repeats, resolve_chunks
from .expert_costs import block_activations, expert_elements, gathered_expert_elements
from .model import LayerGroup, ModelSpec
from .offload import host_states, staging
from .recipe import (FP32, OPTIMIZER_STATES, Recipe, local_shape, loss_chunk_rows, mlp_tile_tokens,
                      shard_numel)


def kv_width_local(model: ModelSpec, layout: Layout) -> int:
    """Key/value width one tensor-parallel rank attends with, after Ulysses repeats K/V heads so that sp splits them
    (`parallel.sequence.ulysses.kv_repeats`)."""
    kv_heads = model.kv_heads // layout.tp
    if layout.sp > 1:
        kv_heads *= layout.sp // math.gcd(kv_heads, layout.sp)
    return kv_heads * model.head_dim


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


# The peak by what holds it, each part the sum of its terms (`estimate`'s names). The two transient parts are the
# phases where the peak can fall -- the loss's working set, or backward's FSDP2 buffers with the rebuilt layer -- and
# only the larger counts: `peak_parts`.
PEAK_PARTS = {
    "parameters": ("params", "unsharded_params", "root_unsharded"),
    "gradients": ("grads", "grad_accumulation"),
    "optimizer": ("optimizer",),
    "activations": ("activations",),
    "loss": ("loss_buffers",),
    "backward buffers": ("head_grad", "layer_buffers", "recompute", "offload_staging"),
    "allocator reserve": ("fragmentation",),
}
TRANSIENT = ("loss", "backward buffers")


def peak_parts(memory: Memory) -> dict[str, float]:
    """`memory`'s peak as `PEAK_PARTS`, bytes each; they add up to the peak (`estimate` computes it so): of the two
    transient parts the smaller is 0, the peak being where the larger is."""
    parts = {part: sum(memory[term] for term in terms) for part, terms in PEAK_PARTS.items()}
    loss, buffers = TRANSIENT
    parts[buffers if parts[loss] >= parts[buffers] else loss] = 0.0
    return parts


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


def stage_groups(model: ModelSpec, layout: Layout) -> list[LayerGroup]:
    """The decoder layers of the busiest pipeline stage by kind: every layer without stages; else ceil(L / pp) of
    them, the larger kinds first."""
    groups = model.layer_groups()
    if layout.pp == 1:
        return groups
    left, out = stage_layers(model, layout), []
    for group in sorted(groups, key=lambda g: -sum(math.prod(shape) for _, shape, _ in g.params)):
        take = min(left, group.count)
        if take:
            out.append(group._replace(count=take))
        left -= take
    return out


@functools.lru_cache(maxsize=4096)
def state_elements(model: ModelSpec, layout: Layout) -> tuple[int, int, int]:
    """(elements one rank holds after tp and FSDP2 sharding, elements per tp rank unsharded, the largest decoder
    layer's elements per tp rank as FSDP2 gathers it -- a sparse layer's with the experts it gathers,
    `moe.gathered_expert_elements`), on the busiest pipeline stage. The routed experts' states are
    `moe.expert_elements`'s, not counted here."""
    held = per_tp = layer = 0
    for count, params, sparse in stage_groups(model, layout):
        size = 0
        for _, shape, dim in params:
            local = local_shape(shape, dim, layout.tp)
            held += count * shard_numel(local, layout.fsdp)
            size += math.prod(local)
        per_tp += count * size
        layer = max(layer, size + (gathered_expert_elements(model, layout) if sparse else 0))
    for _, shape, dim in stage_root(model, layout):
        local = local_shape(shape, dim, layout.tp)
        held += shard_numel(local, layout.fsdp)
        per_tp += math.prod(local)
    return held, per_tp, layer


def root_elements(model: ModelSpec, layout: Layout) -> int:
    return sum(math.prod(local_shape(shape, dim, layout.tp)) for _, shape, dim in stage_root(model, layout))


def layer_activations(model: ModelSpec, layout: Layout, recipe: Recipe, sparse: bool = False) -> tuple[float, str]:
    """Bytes one decoder layer saves for backward on one rank, without checkpointing (a tiled MLP keeps only its
    input, which the norm before it keeps anyway); `sparse`: a layer whose MLP is a mixture of experts
    (`moe.block_activations`)."""
    n, c, t, h = recipe.tokens(layout), recipe.compute_bytes, layout.tp, model.hidden
    qw, ow, kw, vw = attention_widths(model, layout)
    if chunked_block(model, layout, recipe):
        # The projections' backward inside each head chunk too: the block keeps only its input, the norm's output
        # (counted with the norm), and the rotary tables (counted outside the layers)
        attention, how = 0, "attention (chunked block: its input only)"
    elif head_chunks(model, layout, recipe) > 1:
        # Head chunks: the chunked function keeps the sequence-sharded q/k/v (key/value heads not repeated), o_proj
        # its copy of the output; the full-sequence heads are rebuilt a chunk at a time in backward
        # (`attention_backward`)
        kw, vw = attention_widths(model, layout, repeated=False)[2:]
        attention = (qw + ow + kw + vw) * c
        how = f"attention (head chunks: sequence-sharded q/k/v, o_proj's output) ({qw}+{ow}+{kw}+{vw})x{c}"
    else:
        # Bytes per element of the query and the attention output: one each (the model's SDPA); a copy of the
        # output for o_proj once cp/sp attention returns it head-major (the cp kernels keep their output in the
        # inputs' dtype, `allgather` / `ring`).
        o_bytes = 2 * c if layout.seq_split > 1 else c
        attention = qw * c + ow * o_bytes + (kw + vw) * c + model.heads // t * FP32
        how = f"attention {qw}x{c} + {ow}x{o_bytes} + ({kw}+{vw})x{c} + lse {model.heads // t}x4"
    f = recipe.norm_copy_bytes  # a norm's fp32 copy of its input (none when fused)
    if model.qk_norm:  # per-head norms of q and k: an fp32 copy of each and its normalised value, one rsqrt per head
        heads = (model.heads + model.kv_heads) // t
        attention += (qw + kw) * (f + c) + heads * FP32
        how += f" + q/k norms ({qw}+{kw})x({f}+{c}) + {heads}x4"
    if model.mla is not None:  # the two low-rank latents' norms, as the layer norms
        ranks = (model.mla.q_lora_rank or 0) + model.mla.kv_lora_rank
        attention += ranks * (f + 2 * c) + 2 * FP32
        how += f" + latent norms {ranks}x({f}+2x{c})"
    if sparse:
        mlp, mlp_how = block_activations(model, layout, recipe)
        mlp_how = f"experts {mlp_how}"
    else:
        elements = 0 if recipe.tiled_mlp else mlp_elements(model, layout)
        mlp, mlp_how = elements * c, f"MLP {elements}x{c}{' (tiled: its input only)' if recipe.tiled_mlp else ''}"
    per_token = 2 * h * (f + 2 * c) + 2 * FP32 + attention + mlp
    return n * per_token, f"{n} tokens x [norms 2x{h}x({f}+2x{c}) + {how} + {mlp_how}] B"


def attention_widths(model: ModelSpec, layout: Layout, repeated: bool = True) -> tuple[int, int, int, int]:
    """Per token on one rank, the elements of the query, the output, the key and the value attention works on
    (key/value heads as Ulysses repeats them for sp, `kv_width_local`; `repeated=False`: as the projections make
    them)."""
    t = layout.tp
    kw = kv_width_local(model, layout) if repeated else model.kv_heads // t * model.head_dim
    return model.q_width // t, model.o_width // t, kw, kw // model.head_dim * (model.v_head_dim or model.head_dim)


def head_chunks(model: ModelSpec, layout: Layout, recipe: Recipe) -> int:
    """The groups of heads sharded attention runs over for `recipe` (1: all at once): with ``recipe.head_chunks``
    under sp > 1 or cp > 1, the count the library's "auto" picks for these shapes (`ulysses.resolve_chunks`, the fewest
    whose q/k/v/o fit in 128 MiB): Ulysses' at the cp rank's length (`ulysses_attention`), context parallelism
    alone's at the whole sequence's (`head_chunked_attention`). Not modelled for latent attention."""
    heads, kv_heads = model.heads // layout.tp, model.kv_heads // layout.tp
    if (not recipe.head_chunks or layout.seq_split == 1 or model.mla is not None or not kv_heads
            or heads % layout.sp):
        return 1  # (head counts Ulysses cannot split are refused by the layout checks; nothing to chunk then)
    full = recipe.seq_len // layout.cp if layout.sp > 1 else recipe.seq_len
    return resolve_chunks("auto", heads, kv_heads, layout.sp, full, recipe.micro_batch, model.head_dim,
                          recipe.compute_bytes)


def chunked_block(model: ModelSpec, layout: Layout, recipe: Recipe) -> bool:
    """Whether the library runs the attention's q/k/v/o projections' backward inside each head chunk too
    (`parallel.sequence.block`: head chunks at these shapes, a family whose attention it reproduces, no tp)."""
    return (head_chunks(model, layout, recipe) > 1 and layout.tp == 1 and model.model_type in block.MODEL_TYPES
            and not model.qk_norm and model.mla is None and model.sliding_window is None)


def gathered_kv(model: ModelSpec, layout: Layout, recipe: Recipe, chunks: int = 1) -> tuple[int, int, str]:
    """(forward, backward) bytes of the all-gather context-parallel attention's whole-sequence key/value buffers on
    one rank for one call -- all heads the rank attends with, or one head chunk's -- the library's counts
    (`allgather.forward_bytes` / `backward_bytes`): 0 without cp. The key/value heads of a call: as Ulysses repeats
    them for sp (`kv_width_local`), or for sp x chunks (`ulysses.chunk_plan`)."""
    if layout.cp == 1:
        return 0, 0, ""
    kw, vw = attention_widths(model, layout)[2:]
    d, heads, kv_heads = model.head_dim, model.heads // layout.tp, model.kv_heads // layout.tp
    calls = layout.sp * chunks  # the query heads of the rank's heads are split over sp, then over the chunks
    kv = kw // d // layout.sp if chunks == 1 else kv_heads * kv_repeats(heads, kv_heads, calls) // calls
    v_dim = vw * d // kw if kw else d
    seq, batch, c = recipe.seq_len, recipe.micro_batch, recipe.compute_bytes
    forward = allgather.forward_bytes(kv, seq, batch, d, c, layout.cp, value_head_dim=v_dim)
    backward = allgather.backward_bytes(heads // calls, kv, seq, batch, d, c, layout.cp, value_head_dim=v_dim)
    return forward, backward, (f"the cp all-gather's whole-sequence key/value ({kv} key/value heads x {seq} tokens"
                               f"{' of one chunk' if chunks > 1 else ''}: {forward:,} B at the gather, {backward:,} B "
                               "in its backward with their fp32 gradients and one block's, or the reduce-scatter's "
                               "parts)")


def ring_kv(model: ModelSpec, layout: Layout, recipe: Recipe, chunks: int = 1) -> tuple[int, int, str]:
    """(forward, backward) bytes of the ring context-parallel attention's buffers on one rank for one call -- all
    heads the rank attends with, or one head chunk's -- the library's counts (`ring.forward_bytes` /
    `backward_bytes`): the K/V blocks in flight (1/cp of the sequence each), the query chunks' fp32 merge buffers in
    forward, the query's fp32 gradient and the travelling fp32 key/value gradient accumulators in backward; 0 without
    cp. Heads per call as `gathered_kv`'s."""
    if layout.cp == 1:
        return 0, 0, ""
    kw, vw = attention_widths(model, layout)[2:]
    d, heads, kv_heads = model.head_dim, model.heads // layout.tp, model.kv_heads // layout.tp
    calls = layout.sp * chunks
    kv = kw // d // layout.sp if chunks == 1 else kv_heads * kv_repeats(heads, kv_heads, calls) // calls
    v_dim = vw * d // kw if kw else d
    seq, batch, c = recipe.seq_len, recipe.micro_batch, recipe.compute_bytes
    forward = ring.forward_bytes(heads // calls, kv, seq, batch, d, c, layout.cp, value_head_dim=v_dim)
    backward = ring.backward_bytes(heads // calls, kv, seq, batch, d, c, layout.cp, value_head_dim=v_dim)
    return forward, backward, (f"the cp ring's buffers ({kv} key/value heads x {seq // layout.cp} tokens per block"
                               f"{' of one chunk' if chunks > 1 else ''}: {forward:,} B in forward with the blocks in "
                               f"flight and the merge buffers, {backward:,} B in its backward with the fp32 query "
                               "gradient and key/value accumulators)")


def cp_kv(model: ModelSpec, layout: Layout, recipe: Recipe, chunks: int = 1) -> tuple[int, int, str]:
    """The context-parallel attention's own buffers for the recipe's strategy (``cp_comm_strategy``): the
    all-gather's (`gathered_kv`) or the ring's (`ring_kv`)."""
    return (ring_kv if recipe.cp_strategy == "ring" else gathered_kv)(model, layout, recipe, chunks)


def attention_backward(model: ModelSpec, layout: Layout, recipe: Recipe) -> tuple[float, str]:
    """What one layer's attention holds in its backward beyond what the layer saved (`layer_activations`).

    All heads at once: the gradients of the output, the query, the key and the value the kernel sees (the
    full-sequence heads under sp, key/value repeated), in the compute dtype. Over head chunks
    (`ulysses._HeadChunked.backward`): one chunk's full-sequence q/k/v/o rebuilt and their gradients (2 x
    `ulysses.chunk_bytes`), its log-sum-exp, the whole shard's q/k/v gradients filled chunk by chunk, and the output's
    sequence-sharded gradient, held until the last chunk. Under cp the strategy's own buffers come on top, for all the
    rank's heads or for one chunk's (`cp_kv`): the all-gather kernel's whole-sequence key/value and their gradients,
    or the ring's blocks in flight and fp32 accumulators. Not counted: a kernel's own workspace."""
    n, c = recipe.tokens(layout), recipe.compute_bytes
    qw, ow, kw, vw = attention_widths(model, layout)
    chunks = head_chunks(model, layout, recipe)
    gathered_fwd, gathered, gathered_how = cp_kv(model, layout, recipe, chunks)
    plus = f" + {gathered_how}" if gathered else ""
    if chunks == 1:
        return n * (qw + ow + kw + vw) * c + gathered, (f"{n} tokens x ({qw}+{ow}+{kw}+{vw}) x {c} B (the gradients "
                                                        "of o, q, k, v, all heads of all the rank's tokens at once)"
                                                        + plus)
    heads, kv, full = model.heads // layout.tp, model.kv_heads // layout.tp, recipe.seq_len // layout.cp
    chunk = chunk_bytes(heads, kv, layout.sp, chunks, full, recipe.micro_batch, model.head_dim, c)
    lse = recipe.micro_batch * full * heads // (layout.sp * chunks) * FP32
    if chunked_block(model, layout, recipe):
        shape = (heads, kv, layout.sp, chunks, full, full // layout.sp, recipe.micro_batch, model.head_dim)
        forward = block.forward_bytes(*shape, c) + gathered_fwd
        backward = block.backward_bytes(*shape, model.hidden, c) + lse + gathered
        if layout.sp > 1:
            chunk_fwd = f"one chunk's full-sequence q/k/v/o {chunk:,} B and its output's all-to-all buffers"
            chunk_bwd = (f"one chunk's q and k projected again, rotary's, its full-sequence q/k/v/o {chunk:,} B and "
                         "the larger of their gradients and the output's gradient arriving")
        else:  # cp alone: nothing exchanged (`block.forward_bytes` / `backward_bytes`)
            chunk_fwd = "one copy of a chunk's q/k/v for its attention"
            chunk_bwd = ("a chunk's q/k/v projected again, rotary's q and k, the attention's copies of q/k/v, its "
                         "output, the output's gradient and the query's gradient")
        return max(forward, backward), (
            f"{chunks} head chunks, the projections' backward in each (the chunked block): the larger of its "
            f"forward's {forward:,} B (the shard's q/k/v and attention output, {n} x ({qw}+{kw}+{vw}+{ow}) x {c} B, "
            f"and {chunk_fwd}"
            + (f", and the cp {'ring' if recipe.cp_strategy == 'ring' else 'all-gather'}'s {gathered_fwd:,} B"
               if gathered_fwd else "")
            + f") and its backward's {backward:,} B (the hidden states' gradient {n} x {model.hidden} x {c} B, "
            f"{chunk_bwd}, its lse {lse:,} B{plus})")
    kw, vw = attention_widths(model, layout, repeated=False)[2:]
    shard = n * (qw + kw + vw + ow) * c
    return 2 * chunk + lse + shard + gathered, (
        f"{chunks} head chunks: one chunk's full-sequence q/k/v/o and their gradients 2 x {chunk:,} B + its lse "
        f"{lse:,} B + the shard's q/k/v gradients and the output's {n} x ({qw}+{kw}+{vw}+{ow}) x {c} B (all heads of "
        f"the shard at once: the projections' backward takes them whole){plus}")


def norm_backward(model: ModelSpec, layout: Layout, recipe: Recipe) -> tuple[float, str]:
    """What an RMSNorm's backward allocates for the hidden states of one rank's tokens: a fused norm's
    (`rms_norm.backward_bytes`, the library's count: over chunks of tokens, the input gradient and one chunk's
    working set), or the model's own (`rms_norm.OWN_BACKWARD_BYTES` per element, measured on Llama's)."""
    n, h, c = recipe.tokens(layout), model.hidden, recipe.compute_bytes
    if recipe.fused_norms:
        step = norm_chunk_tokens(n, h)
        if step >= n:
            return norm_backward_bytes(n, h, c), f"{n} tokens x {norm_token_bytes(h)} B (a fused RMSNorm's backward)"
        return norm_backward_bytes(n, h, c), (f"{n} tokens x {h} x {c} B (the input gradient) + {step} tokens x "
                                              f"{norm_token_bytes(h)} B (one of {math.ceil(n / step)} chunks' working "
                                              "set; a fused RMSNorm's backward)")
    return n * h * OWN_BACKWARD_BYTES, f"{n} tokens x {h} x {OWN_BACKWARD_BYTES} B (an RMSNorm's backward)"


def backward_transient(model: ModelSpec, layout: Layout, recipe: Recipe) -> tuple[float, str]:
    """The largest of what one op of a layer allocates in its backward beyond the layer's saved activations: a
    tiled MLP's rebuilt tile (`mlp_tile`), the attention's gradients (`attention_backward`; a chunked block's forward,
    which keeps nothing for attention and so holds its q/k/v and output only while it runs, counts there too), a
    fused norm's working set (`norm_backward`). They run one after the other, so only the largest counts."""
    tile = mlp_tile(model, layout, recipe) if recipe.tiled_mlp and model.dense_layers else (0.0, "")
    return max(tile, attention_backward(model, layout, recipe), norm_backward(model, layout, recipe))


def layers_activations(model: ModelSpec, layout: Layout, recipe: Recipe) -> tuple[float, str, float, str]:
    """(all decoder layers of the busiest stage, how; the largest layer, how) saved for backward without
    checkpointing."""
    total, hows, largest = 0.0, [], (0.0, "")
    for group in stage_groups(model, layout):
        value, how = layer_activations(model, layout, recipe, group.sparse)
        total += group.count * value
        largest = max(largest, (value, how))
        hows.append(f"{group.count} {'sparse ' if group.sparse else ''}layers x {how}" if model.moe else
                    f"{group.count} layers x {how}")
    return total, " + ".join(hows), *largest


def mlp_elements(model: ModelSpec, layout: Layout) -> int:
    """Per token, the MLP's intermediate elements autograd keeps on one rank: gate, up, activation, product."""
    return (4 if model.gated else 2) * model.intermediate // layout.tp


def mlp_tile(model: ModelSpec, layout: Layout, recipe: Recipe) -> tuple[float, str]:
    """A tiled MLP's intermediate, rebuilt for one tile of each of the micro-batch's rows in backward."""
    local_seq = recipe.seq_len // layout.seq_split
    tile = mlp_tile_tokens(model.hidden, local_seq, recipe.mlp_tile)
    elems = mlp_elements(model, layout)
    return (recipe.micro_batch * tile * elems * recipe.compute_bytes,
            f"{recipe.micro_batch} rows x {tile} tokens x {elems} x {recipe.compute_bytes} B (one MLP tile)")


def outside_activations(model: ModelSpec, layout: Layout, recipe: Recipe) -> tuple[float, str]:
    """Saved outside the decoder layers: final norm, log-softmax of the logits (not with the chunked loss), token ids,
    rotary tables (under pipeline stages, for the one micro-batch the last stage holds at a time)."""
    n, c, h, v = recipe.tokens(layout) // layout.pp, recipe.compute_bytes, model.hidden, model.vocab
    rows = recipe.micro_batch if layout.seq_split > 1 else 1  # rotary cos/sin: per sample once positions are given
    rope = 2 * rows * (recipe.seq_len // layout.seq_split) * model.rope_dim * c
    softmax = 0 if recipe.chunked_loss else n * v * FP32
    f = recipe.norm_copy_bytes
    value = n * (h * (f + 2 * c) + FP32) + softmax + 2 * n * 8 + rope
    return value, (f"{n} tokens x (final norm {h}x({f}+2x{c}) + " + ("" if recipe.chunked_loss else f"log-softmax {v}x4 + ")
                   + f"ids 16) + rotary {rope} B")


def loss_buffers(model: ModelSpec, layout: Layout, recipe: Recipe) -> tuple[float, str]:
    """The loss's working set beyond what it saved (`outside_activations`), on one micro-batch (one pipeline
    micro-batch under stages).

    Hugging Face's loss: the logits in the compute dtype, their fp32 copy, the log-softmax (saved), then in backward
    its gradient and the logits' (8 B per logit beyond the saved 4), plus under tp the local logits before they are
    gathered. The chunked loss (`ndparallel.parallel.memory.cross_entropy`): one chunk's logits (fp32: built and turned
    into their gradient in place, 4 B; bf16: their fp32 copy and the gradient, c + 4 B -- the compute-dtype logits
    are let go once copied), the head's gradient in fp32 (4 x its rows x h, plus, in bf16, a chunk's product in the
    compute dtype before it is added or converted) and the hidden states' gradient (c x n x h), computed in forward
    and held until backward takes them. As few chunks as keep each chunk's fp32 logits within 128 MiB: one
    (the whole loss at once) when all of them fit."""
    n, c, t, h, v = recipe.tokens(layout) // layout.pp, recipe.compute_bytes, layout.tp, model.hidden, model.vocab
    if not recipe.chunked_loss:
        gathered = n * v // t * c if t > 1 else 0
        return n * v * 8 + gathered, (f"{n} tokens x {v} logits x 8 B (compute-dtype logits + fp32 copy, or their "
                                      "gradients)" + (f" + the local logits before the tp gather ({gathered:,} B)"
                                                      if gathered else ""))
    v_local = v // t
    rows = loss_chunk_rows(n, v_local)
    per_logit = FP32 if c == FP32 else c + FP32
    head = v_local * h * (FP32 + (c if c != FP32 else 0))  # fp32 result; in bf16 also a chunk's product
    value = rows * v_local * per_logit + head + n * h * c
    return value, (f"chunk {rows} tokens x {v_local} logits x {per_logit} B + head gradient {v_local}x{h}x"
                   f"({FP32}{f' + {c}' if c != FP32 else ''}) B + hidden-state gradient {n}x{h}x{c} B")


def estimate(model: ModelSpec, layout: Layout, recipe: Recipe, fragmentation: float = 0.0, pin: bool = True) -> Memory:
    """Every memory term of one GPU for `layout` running `setting` (module docstring), and the host memory terms
    (``host_*``) of its offloading. `fragmentation`: the allocator's reserve beyond what tensors hold, as a fraction
    of the step's activations and transients (the hardware profile's; 0 where nothing caches, as on the CPU);
    `pin`: whether FSDP2's offloaded states are pinned (on CUDA; blocks rounded up to powers of two, `offload.pinned`;
    the offloaded activations' host pool rounds nothing but to its alignment, pinned or not)."""
    mem = Memory()
    s, t, c, L = layout.fsdp, layout.tp, recipe.compute_bytes, stage_layers(model, layout)
    held, per_tp, layer_elems = state_elements(model, layout)
    # The routed experts (`moe`): E / ep per rank, FSDP2-sharded over expert_shard = fsdp / ep (fsdp without ep);
    # `local` is what the rank computes with unsharded, and their shard group `e_group` decides as s does below.
    e_held, e_local = expert_elements(model, layout)
    e_group = layout.expert_shard
    total = held + e_held
    experts = (f" ({held:,} + {e_held:,} of the routed experts: E/ep with ep={layout.ep}, sharded over "
               f"{e_group})" if model.moe else "")
    states = OPTIMIZER_STATES[recipe.optimizer]
    off = recipe.offload_params  # FSDP2's cpu_offload: the states live in host memory (`offload`)
    if off:
        groups = [(g.count, g.params) for g in stage_groups(model, layout)] + [(1, stage_root(model, layout))]
        for name, value, how in host_states(groups, layout, recipe, e_held, pin):
            mem.add(name, value, how)
    where = " in host memory (cpu_offload): none on the GPU" if off else ""
    mem.add("params", 0 if off else total * FP32,
            f"{total:,} parameters (after tp={t}, fsdp={s}, padding){experts} x 4 B (fp32){where}")
    mem.add("grads", 0 if off else total * FP32, f"{total:,} x 4 B (fp32){where}")
    mem.add("optimizer", 0 if off else total * FP32 * states,
            f"{total:,} x {states} states x 4 B ({recipe.optimizer}){where}")
    if recipe.accumulation > 1 and not recipe.sync_each_batch:
        kept = (per_tp if s > 1 or off else 0) + (e_local if e_group > 1 or off else 0)
        if kept:
            mem.add("grad_accumulation", kept * FP32, f"{kept:,} unsharded gradients x 4 B kept between "
                    f"{recipe.accumulation} micro-steps (FSDP2 without sync_each_batch)")
    # What the FSDP2 apply step reshards after forward: every group of more than one rank, and under cpu_offload
    # every group; a one-rank group without it keeps its compute-dtype copies (its shards, in fp32) through the step.
    reshard = reshards_after_forward(True, s, off)
    copies = (0 if reshard else per_tp) + (0 if reshards_after_forward(True, e_group, off) else e_local)
    if copies and c != FP32:
        mem.add("unsharded_params", copies * c, f"{copies:,} x {c} B: bf16 copies kept through the step (one-rank "
                "shard group without cpu_offload: no resharding)")

    layers, layers_how, layer, layer_how = layers_activations(model, layout, recipe)
    outside, outside_how = outside_activations(model, layout, recipe)
    n = recipe.tokens(layout)
    inputs = L * n * model.hidden * c
    kept_inputs = min(L, 2) * n * model.hidden * c if recipe.offload else inputs
    mem.activations_without_checkpointing = layers + outside
    mem.activations_with_checkpointing = kept_inputs + outside
    transient, transient_how = backward_transient(model, layout, recipe)
    if recipe.checkpointing:
        where = (f"{min(L, 2)} of {L} layers' inputs on the GPU (the others in host memory)" if recipe.offload
                 else f"{L} layers")
        mem.add("activations", mem.activations_with_checkpointing,
                f"{where} x {n} tokens x {model.hidden} x {c} B (layer inputs) + outside the layers: {outside_how}")
        mem.add("recompute", layer + transient, f"one layer rebuilt in backward (the largest): {layer_how} + the "
                f"largest buffer it allocates (in its backward, or its forward again): {transient_how}")
        if recipe.offload:
            block = aligned(n * model.hidden * c)
            mem.add("host_offload", L * block, f"{L} layers' inputs in the offload's host pool: {L} x {n} x "
                    f"{model.hidden} x {c} B" + (f" (blocks aligned to {block:,} B)" if block != n * model.hidden * c
                                                 else "") + " (not GPU memory)")
    else:
        mem.add("activations", mem.activations_without_checkpointing,
                f"{layers_how} + outside the layers: {outside_how}")
        mem.add("recompute", transient, f"the largest of one layer's backward's buffers: {transient_how}")

    if off:
        mem.add("offload_staging", *staging(layer_elems, layout))
    if reshard:
        root = root_elements(model, layout)
        mem.add("root_unsharded", root * c, f"embedding, norm and head unsharded: {root:,} x {c} B")
        rs_copy = layer_elems * FP32 if c != FP32 else 0
        gathered = gathered_expert_elements(model, layout) if model.moe else 0
        # A one-rank group (under cpu_offload) gathers a unit in its own pre-hook: one layer's parameters at a time.
        held_layers, reduce = (2, "reduce-scatter") if s > 1 else (1, "reduce")
        mem.add("layer_buffers", (held_layers + 2) * layer_elems * c + rs_copy,
                (f"2 layers' unsharded parameters and gradients: 4 x {layer_elems:,} x {c} B" if s > 1 else
                 f"one layer's parameters gathered from the host and 2 layers' unsharded gradients: 3 x "
                 f"{layer_elems:,} x {c} B")
                + (f" (a sparse layer with the {gathered:,} elements of its gathered experts: "
                   f"{model.moe.routed.experts // layout.ep} of them)" if gathered else "")
                + (f" + one layer's fp32 gradients for the {reduce} ({layer_elems:,} x 4 B)" if rs_copy else ""))
        head = model.vocab // t * model.hidden
        mem.add("head_grad", head * c, f"the head's unsharded gradient, held through backward until the root unit "
                f"{reduce}s: {head:,} x {c} B")
    loss, loss_how = loss_buffers(model, layout, recipe)
    mem.add("loss_buffers", loss, loss_how)

    allocated = sum(peak_parts(mem).values())  # before the allocator's reserve is added: what tensors hold
    mem.add("allocated", allocated, "states + accumulation + unsharded copies + activations + root unit + "
            "max(loss buffers, head gradient + layer buffers + rebuilt layer)")
    spare = fragmentation * (allocated - mem.states)
    mem.add("fragmentation", spare, f"{fragmentation:g} x what the step allocates beyond the model states (the "
            "caching allocator's blocks reserved but not in use at the peak)")
    mem.add("peak", allocated + spare, "allocated + fragmentation: torch.cuda.max_memory_reserved")
    return mem
