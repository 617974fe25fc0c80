"""Bytes each GPU sends per optimizer step, collective by collective, and over which links.

Bytes are those one rank sends under a bandwidth-optimal ring on a group of n ranks -- all-gather (n-1) x input,
reduce-scatter (n-1) x output, all-reduce 2 (n-1)/n x size, all-to-all (n-1)/n x input -- the formulas
`ndparallel.test_utils.collectives` counts with, so prediction and measurement compare like for like. Per step, with m
micro-steps (gradient accumulation), P_s a rank's FSDP2 shard (elements, padded), c the compute dtype's bytes,
n tokens per rank per micro-step, L layers:

- FSDP2 over dp_shard x cp x sp (s ranks): all-gather m (s-1) (2 P_s - R_s) c (every layer forward and again in
  backward, the root unit's shard R_s once: it stays gathered into backward); reduce-scatter (s-1) P_s 4 once per
  step (every micro-step with sync_each_batch, and under pipeline stages).
- HSDP over dp_replicate (r ranks): all-reduce 2 (r-1)/r x P_s x 4 once per step (every micro-step under pipeline
  stages).
- TP (t ranks, Megatron): all-reduce 2 (t-1)/t x n h c x (4 L + 1) per micro-step (attention and MLP outputs
  forward, their input gradients backward, the head's input gradient), + 1 for a vocabulary-split tied embedding;
  all-gather (t-1) x n V/t c of the logits -- or, with the chunked loss, all-reduces 2 (t-1)/t x 12 B per counted
  token (the maximum, the sum of exponentials and the label's logit, two calls per chunk).
- Ulysses (sp ranks): all-to-all 2 L (sp-1)/sp x n (2 q_width/t + 2 kv_width) c per micro-step.
- CP, all-gather strategy (cp ranks): K and V gathered forward and gathered again in backward (the library keeps
  only its own share), all-gather 2 L (cp-1) x 2 n kv_width c; their gradients, accumulated in fp32,
  reduce-scattered: L (cp-1) x 2 n kv_width x 4.
- CP, ring strategy (``cp_comm_strategy="ring"``, `parallel.sequence.ring`): point to point to the next rank, each
  hop one rank's K/V block (n tokens): forward cp-1 hops, 2 L (cp-1) x 2 n kv_width c with the backward's; the
  gradient accumulators travel cp hops in backward (back to the block's owner), L cp x 2 n kv_width x 4. Calls are
  messages, as `ndparallel.test_utils.collectives` counts them (one per tensor sent): K and V, or their two
  accumulators, are two per hop (one ``batch_isend_irecv``, which NCCL launches at once: the latency term counts
  a hop twice there). The sends overlap the block's attention in the library, but are counted on the critical path
  as the all-gather's are. Measured (benchmarks/planner_check.py's RING_CASES, tests/planner/test_planner_ring.py):
  bytes and calls exact on cp 2, cp 4 and cp 2 x sp 2, with and without checkpointing.
- Activation checkpointing reruns each layer's forward in backward, with its collectives, up to the last tensor
  backward needs (torch's non-reentrant checkpoint stops there): TP 5 L + 1 all-reduces instead of 4 L + 1 (the
  MLP output's is not repeated), Ulysses 3 L instead of 2 L all-to-all rounds, CP 3 L K/V gathers (or ring
  passes) instead of 2 L.
  FSDP2's traffic does not change (the layer is gathered for backward anyway).
- The loss normalisation's token count: all-reduce of 8 bytes over the ``batch`` view once per step.
- Mixtures of experts (`moe`): without ep the routed experts are part of each sparse layer's FSDP2 unit (P_s
  includes their shard). With ep, per sparse layer and micro-step: the tokens' all-to-alls over ep, (ep-1)/ep of
  `experts.expert_figures`' payload (the share that leaves the rank under uniform routing), 2 calls forward and 2
  backward, 2 more forward with checkpointing; the routing counts' all-to-all, one per forward; the experts' own
  FSDP2 unit over expert_shard = s / ep (e ranks): all-gather m (e-1) 2 E_e c, reduce-scatter (e-1) E_e 4, E_e the
  rank's expert shard -- nothing when e = 1; over dp_replicate an all-reduce 2 (r-1)/r E_e 4. Tensor parallelism's
  all-reduces count the layers whose MLP it splits (`ModelSpec.split_mlp_layers`: 2 each) and attention (2 per
  layer); per-head q/k norms (Qwen3) all-reduce their weights' gradients over tp, 2 calls per layer.
- Pipeline stages (pp > 1; the busiest stage: its ceil(L / pp) layers in every L above): between stages each
  micro-step's activations go forward and their gradients come back, n h c each way, in pp micro-batches (the
  default schedule's), one message per micro-batch and direction; the busiest stage is a middle one, which sends both
  (2 m n h c in 2 m pp messages), where pp > 2 -- with pp 2 each stage is an end and sends one way (the first the
  activations, the last their gradients: m n h c in m pp). After each micro-step's schedule the last stage
  broadcasts the fp32 loss to every stage (4 B, one call per micro-step; counted as the counter counts a broadcast,
  its bytes on every rank). Measured (benchmarks/planner_check.py's PP_CASES,
  tests/planner/test_planner_pipeline_traffic.py): bytes and calls exact on every rank of pp 2 (in fp32, and in
  bf16 with two micro-steps) and on pp 3's middle stage (bf16, two micro-steps, checkpointing), its end stages half
  of it; torch's shape inference sends its metadata in a schedule's first step only, outside the counted step.
  FSDP2 inside a stage gathers each layer unit for every micro-batch's forward (pp times) and once for the backward
  passes (torch's stage reshards after its last backward only): pp + 1 all-gathers per micro-step instead of 2, the
  stage's root unit once, m (s-1) ((pp+1) (P_s - R_s) + R_s) c in m ((pp+1) L + 1) calls; torch's schedule reduces
  the stage's gradients at the end of each of its steps (`perform_reduce_grad`), so the reduce-scatter and HSDP's
  all-reduce run every micro-step (m (L+1) calls each). Measured with the sends above (pp 2 x dp_shard 2 in bf16
  with two micro-steps and in fp32 with checkpointing, pp 2 x dp_replicate 2 in bf16 with two micro-steps): bytes
  exact on the busiest stage (the head's end), calls exact on every stage. These were (pp+1) (L+1) gathers of the
  whole shard and one reduction per step before, 6 / 2 calls where the library makes 4 / 2 per micro-step.

A group whose ranks all sit in one node uses the node's links (NVLink); one that spans nodes is limited by the
network (`layouts.cross_node`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from ..distributed.layout import Layout, view_axes
from .layouts import cross_node
from .footprint import kv_width_local, local_shape, shard_numel, stage_layers, stage_root, state_elements
from .model import ModelSpec
from .expert_costs import expert_elements, figures
from .recipe import FP32, Recipe, loss_chunk_rows

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv", "broadcast")
KV_TENSORS = 2  # the ring passes K and V (or their gradient accumulators) as two tensors: two messages a hop


@dataclass(frozen=True)
class Transfer:
    purpose: str
    kind: str
    axes: tuple[str, ...]
    group_size: int
    link: str  # "intra" (inside a node) or "inter" (across nodes)
    bytes: float  # sent by one rank per optimizer step
    calls: int  # collective calls per optimizer step
    overlappable: bool  # data-parallel traffic FSDP2 issues while other layers compute
    how: str


class Product:
    """A product of factors kept with how it reads, so that a transfer's bytes and their explanation come from one
    expression: ``Product(m, f"{m} micro-steps") * ring(t) * n * 4`` is worth m (t-1)/t n 4 and reads
    ``2 micro-steps x (4-1)/4 x 4096 x 4``. Plain numbers multiply in as themselves."""

    def __init__(self, value: float, text: str | None = None) -> None:
        self.value, self.text = value, str(value) if text is None else text

    def __mul__(self, other: "Product | float") -> "Product":
        other = other if isinstance(other, Product) else Product(other)
        return Product(self.value * other.value, f"{self.text} x {other.text}")

    __rmul__ = __mul__


def ring(n: int) -> Product:
    """(n-1)/n: the share of a buffer a rank sends in a ring all-reduce step (and an all-to-all)."""
    return Product((n - 1) / n, f"({n}-1)/{n}")


def transfers(model: ModelSpec, layout: Layout, recipe: Recipe, gpus_per_node: int) -> list[Transfer]:
    """Every collective of one optimizer step on one rank (module docstring)."""
    out: list[Transfer] = []
    m, c, L, t = recipe.accumulation, recipe.compute_bytes, stage_layers(model, layout), layout.tp
    n = recipe.tokens(layout)
    steps, tokens, dtype = Product(m, f"{m} micro-steps"), Product(n, f"{n} tokens"), Product(c, f"{c} B")

    def add(purpose: str, kind: str, view: str, sent: Product, calls: int, overlap: bool, note: str = ""):
        size = layout.size(view)
        if size > 1:
            link = "inter" if cross_node(layout, view, gpus_per_node) else "intra"
            out.append(Transfer(purpose, kind, view_axes(view), size, link, sent.value, calls, overlap,
                                sent.text + note))

    held, per_tp, _ = state_elements(model, layout)
    e_held, _ = expert_elements(model, layout)
    if layout.ep == 1:  # the routed experts belong to their layer's FSDP2 unit
        held += e_held
    s, r = layout.fsdp, layout.dp_replicate
    shard = Product(held, f"{held:,}")
    units = L + 1  # one FSDP2 unit per decoder layer, and the root
    # The root unit (embedding, final norm, head; a stage's own under pp) is gathered once per micro-step: it stays
    # gathered from forward into backward, which starts with it (torch's default for the root).
    root = sum(shard_numel(local_shape(shape, dim, t), s) for _, shape, dim in stage_root(model, layout))
    if layout.pp == 1:
        add("FSDP2 parameter all-gather", "all_gather", "fsdp",
            steps * Product(s - 1, f"({s}-1)") * Product(2 * held - root, f"(2 x {held:,} - root {root:,})") * dtype,
            m * (2 * units - 1), True)
    else:
        # A layer unit: for every pipeline micro-batch's forward, and once for the backward passes (torch's stage
        # reshards after its last backward only).
        g = layout.pp + 1
        add("FSDP2 parameter all-gather", "all_gather", "fsdp",
            steps * Product(s - 1, f"({s}-1)") * Product(g * held - (g - 1) * root,
                                                         f"({g} x {held - root:,} + root {root:,})") * dtype,
            m * (g * L + 1), True)
    # torch's pipeline schedule reduces a stage's gradients at the end of each step it runs (`perform_reduce_grad`):
    # every micro-step under stages.
    syncs = m if recipe.sync_each_batch or layout.pp > 1 else 1
    add("FSDP2 gradient reduce-scatter", "reduce_scatter", "fsdp",
        Product(syncs) * Product(s - 1, f"({s}-1)") * shard * Product(FP32, "4 B"), syncs * units, True)
    replicas = m if layout.pp > 1 else 1  # as the reduce-scatter: every micro-step under stages
    add("HSDP gradient all-reduce", "all_reduce", "dp_replicate",
        Product(replicas) * 2 * ring(r) * shard * Product(FP32, "4 B"), replicas * units, True)
    # With activation checkpointing each layer's forward runs again in backward, collectives included.
    forwards = 2 if recipe.checkpointing else 1
    if t > 1:
        # The rerun stops once the tensors backward needs exist (torch's non-reentrant checkpoint): the attention
        # output's all-reduce is repeated, the MLP output's is not. Layers whose MLP tp leaves whole (experts)
        # reduce nothing there.
        attention = L if model.attention_split else 0
        reduces = (2 * attention + 2 * min(L, model.split_mlp_layers) + 1 + (attention if recipe.checkpointing else 0)
                   + (1 if model.tied else 0))
        add("TP activation all-reduce", "all_reduce", "tp",
            steps * 2 * ring(t) * tokens * model.hidden * dtype * Product(reduces, f"{reduces} all-reduces"),
            m * reduces, False)
        if model.qk_norm:
            add("TP q/k norm gradient all-reduce", "all_reduce", "tp",
                steps * Product(2, "2 norms") * Product(L, f"{L} layers") * 2 * ring(t) * model.head_dim * dtype,
                m * 2 * L, False)
        if recipe.chunked_loss:
            # The vocabulary-parallel chunked loss: per chunk, the maximum (4 B per token) and the sum of
            # exponentials with the label's logit (8 B) all-reduced over tp, for every position (those that predict
            # nothing are masked, not left out: the unchunked logits' rows, and no host sync to select them).
            chunks = math.ceil(n / loss_chunk_rows(n, model.vocab // t))
            add("TP chunked-loss log-sum-exp all-reduce", "all_reduce", "tp",
                steps * 2 * ring(t) * tokens * Product(12, "12 B"), m * 2 * chunks, False,
                f", 2 calls x {chunks} chunks")
        else:
            add("TP logits all-gather", "all_gather", "tp",
                steps * Product(t - 1, f"({t}-1)") * tokens * (model.vocab // t) * dtype, m, False)
    kw = kv_width_local(model, layout)
    vw = kw // model.head_dim * (model.v_head_dim or model.head_dim)
    if layout.sp > 1:
        width = (model.q_width + model.o_width) // t + kw + vw
        passes = 1 + forwards  # forward (and its rerun), backward: q, k, v and the output each time
        add("Ulysses all-to-all", "all_to_all", "sp",
            steps * Product(passes, f"{passes} passes") * Product(L, f"{L} layers") * ring(layout.sp) * tokens
            * Product(width, f"{width} wide") * dtype, m * 4 * passes * L, False)
    if layout.cp > 1 and recipe.cp_strategy == "ring":
        cp = layout.cp
        kv = Product(kw + vw, f"({kw}+{vw})")
        passes = 1 + forwards  # forward (and its rerun), and backward: the blocks travel cp - 1 hops each time
        # K and V (their gradient accumulators in backward) are sent as two tensors: two messages a hop.
        add("CP ring K/V blocks (forward + backward)", "send_recv", "cp",
            steps * Product(passes, f"{passes} passes") * Product(L, f"{L} layers") * Product(cp - 1, f"({cp}-1) hops")
            * tokens * kv * dtype, m * passes * L * (cp - 1) * KV_TENSORS, False, ", K and V: 2 messages a hop")
        add("CP ring K/V gradient accumulators", "send_recv", "cp",
            steps * Product(L, f"{L} layers") * Product(cp, f"{cp} hops") * tokens * kv * Product(FP32, "4 B"),
            m * L * cp * KV_TENSORS, False, " (fp32, back to their owner; 2 messages a hop)")
    elif layout.cp > 1:
        cp = layout.cp
        kv = Product(kw + vw, f"({kw}+{vw})")
        gathers = 1 + forwards  # forward (and its rerun), and again in backward
        add("CP K/V all-gather (forward + backward)", "all_gather", "cp",
            steps * Product(gathers, f"{gathers} gathers") * Product(L, f"{L} layers") * Product(cp - 1, f"({cp}-1)")
            * tokens * kv * dtype, m * gathers * L, False)
        add("CP K/V gradient reduce-scatter", "reduce_scatter", "cp",
            steps * Product(L, f"{L} layers") * Product(cp - 1, f"({cp}-1)") * tokens * kv * Product(FP32, "4 B"),
            m * L, False, " (accumulated in fp32)")
    if model.moe is not None and layout.ep > 1:
        out += expert_transfers(model, layout, recipe, gpus_per_node)
    if layout.pp > 1:
        # The busiest stage's sends: a middle stage (pp > 2) sends activations forward and their gradients back, an
        # end stage one of them (the first the activations, the last the gradients) -- pp 2 has no middle stage.
        directions = 2 if layout.pp > 2 else 1
        add("pipeline activations and their gradients", "send_recv", "pp",
            steps * Product(directions, f"{directions} direction{'s' if directions > 1 else ''}") * tokens
            * model.hidden * dtype, m * directions * layout.pp, False, f", in {layout.pp} micro-batches")
        add("pipeline loss broadcast", "broadcast", "pp", steps * Product(FP32, "4 B"), m, False,
            " (the last stage's fp32 loss, to every stage)")
    add("loss token count", "all_reduce", "batch", 2 * ring(layout.batch) * Product(8, "8 B"), 1, False)
    return out


def expert_transfers(model: ModelSpec, layout: Layout, recipe: Recipe, gpus_per_node: int) -> list[Transfer]:
    """Expert parallelism's collectives (module docstring): the all-to-alls over ep and the experts' FSDP2 unit over
    expert_shard (groups of the fsdp ranks, `ndparallel.distributed.layout.EXPERT_VIEWS`), HSDP over dp_replicate."""
    assert model.moe is not None
    out: list[Transfer] = []
    fig, sparse, ep, es = figures(model, layout, recipe), model.moe.sparse_layers, layout.ep, layout.expert_shard
    m, c = recipe.accumulation, recipe.compute_bytes
    held, _ = expert_elements(model, layout)
    steps, shard = Product(m, f"{m} micro-steps"), Product(held, f"{held:,}")
    forwards = 2 if recipe.checkpointing else 1

    def add(purpose: str, kind: str, view: str, sent: Product, calls: int, overlap: bool, note: str = ""):
        ranks = layout.group(view)
        if len(ranks) > 1:
            link = "inter" if ranks[0] // gpus_per_node != ranks[-1] // gpus_per_node else "intra"
            out.append(Transfer(purpose, kind, (view,), len(ranks), link, sent.value, calls, overlap,
                                sent.text + note))

    routed = model.moe.routed
    # The payloads are experts.py's (`expert_figures`); the notes say what they hold.
    add("expert all-to-all: tokens", "all_to_all", "ep", ring(ep) * Product(fig.payload_bytes,
        f"{fig.payload_bytes:,} B"), m * sparse * (2 * forwards + 2), False,
        f" ({m} x {sparse} layers x {forwards + 1} passes x 2 directions x {recipe.tokens(layout)} tokens x "
        f"{routed.top_k} x {routed.hidden} x {c} B)")
    add("expert all-to-all: routing counts", "all_to_all", "ep", ring(ep) * Product(fig.count_bytes,
        f"{fig.count_bytes:,} B"), m * sparse * forwards, False,
        f" ({m} x {sparse} layers x {forwards} forwards x {routed.experts} experts x 8 B)")
    add("FSDP2 expert all-gather", "all_gather", "expert_shard",
        steps * Product(es - 1, f"({es}-1)") * 2 * shard * Product(c, f"{c} B"), m * 2 * sparse, True)
    syncs = m if recipe.sync_each_batch else 1
    add("FSDP2 expert gradient reduce-scatter", "reduce_scatter", "expert_shard",
        Product(syncs) * Product(es - 1, f"({es}-1)") * shard * Product(FP32, "4 B"), syncs * sparse, True)
    r = layout.dp_replicate
    if r > 1:
        add("HSDP expert gradient all-reduce", "all_reduce", "dp_replicate",
            2 * ring(r) * shard * Product(FP32, "4 B"), sparse, True)
    return out


def by_kind(items: list[Transfer]) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for item in items:
        totals[item.kind] += item.bytes
    return dict(totals)


def by_link(items: list[Transfer]) -> dict[str, float]:
    totals: dict[str, float] = {"intra": 0.0, "inter": 0.0}
    for item in items:
        totals[item.link] += item.bytes
    return totals
