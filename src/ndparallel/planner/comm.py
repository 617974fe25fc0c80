"""Bytes each GPU sends per optimizer step, collective by collective, and over which links.

Bytes are those one rank sends under a bandwidth-optimal ring on a group of n ranks -- all-gather (n-1) x input,
reduce-scatter (n-1) x output, all-reduce 2 (n-1)/n x size, all-to-all (n-1)/n x input -- the formulas
`benchmarks/comm_count.py` counts with, so prediction and measurement compare like for like. Per step, with m
micro-steps (gradient accumulation), P_s a rank's FSDP2 shard (elements, padded), c the compute dtype's bytes,
n tokens per rank per micro-step, L layers:

- FSDP2 over dp_shard x cp x sp (s ranks): all-gather m (s-1) (2 P_s - R_s) c (every layer forward and again in
  backward, the root unit's shard R_s once: it stays gathered into backward); reduce-scatter (s-1) P_s 4 once per
  step (every micro-step with sync_each_batch).
- HSDP over dp_replicate (r ranks): all-reduce 2 (r-1)/r x P_s x 4 once per step.
- TP (t ranks, Megatron): all-reduce 2 (t-1)/t x n h c x (4 L + 1) per micro-step (attention and MLP outputs
  forward, their input gradients backward, the head's input gradient), + 1 for a vocabulary-split tied embedding;
  all-gather (t-1) x n V/t c of the logits -- or, with the chunked loss, all-reduces 2 (t-1)/t x 12 B per counted
  token (the maximum, the sum of exponentials and the label's logit, two calls per chunk).
- Ulysses (sp ranks): all-to-all 2 L (sp-1)/sp x n (2 q_width/t + 2 kv_width) c per micro-step.
- CP, all-gather strategy (cp ranks): K and V gathered forward and gathered again in backward (the library keeps
  only its own share), all-gather 2 L (cp-1) x 2 n kv_width c; their gradients, accumulated in fp32,
  reduce-scattered: L (cp-1) x 2 n kv_width x 4.
- Activation checkpointing reruns each layer's forward in backward, with its collectives, up to the last tensor
  backward needs (torch's non-reentrant checkpoint stops there): TP 5 L + 1 all-reduces instead of 4 L + 1 (the
  MLP output's is not repeated), Ulysses 3 L instead of 2 L all-to-all rounds, CP 3 L K/V gathers instead of 2 L.
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
  micro-step's activations go forward and their gradients come back, n h c each way (a middle stage sends both), in
  pp micro-batches (the default schedule's); FSDP2 inside a stage gathers its parameters for every micro-batch's
  forward (pp times) and once for the backward passes (torch's stage keeps them gathered between them): pp + 1
  all-gathers per micro-step instead of 2.

A group whose ranks all sit in one node uses the node's links (NVLink); one that spans nodes is limited by the
network (`layouts.cross_node`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from ..distributed.layout import Layout, view_axes
from .layouts import cross_node
from .memory import kv_width_local, local_shape, shard_numel, stage_layers, stage_root, state_elements
from .model import ModelSpec
from .expert_costs import expert_elements, figures
from .recipe import FP32, Recipe, loss_chunk_rows

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")


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


def transfers(model: ModelSpec, layout: Layout, recipe: Recipe, gpus_per_node: int) -> list[Transfer]:
    """Every collective of one optimizer step on one rank (module docstring)."""
    out: list[Transfer] = []
    m, c, L, t = recipe.accumulation, recipe.compute_bytes, stage_layers(model, layout), layout.tp
    n = recipe.tokens(layout)

    def add(purpose: str, kind: str, view: str, value: float, calls: int, overlap: bool, how: str):
        size = layout.size(view)
        if size > 1:
            link = "inter" if cross_node(layout, view, gpus_per_node) else "intra"
            out.append(Transfer(purpose, kind, view_axes(view), size, link, value, calls, overlap, how))

    held, per_tp, _ = state_elements(model, layout)
    e_held, _ = expert_elements(model, layout)
    if layout.ep == 1:  # the routed experts belong to their layer's FSDP2 unit
        held += e_held
    s, r = layout.fsdp, layout.dp_replicate
    units = L + 1  # one FSDP2 unit per decoder layer, and the root
    if layout.pp == 1:
        # Forward and backward, but the root unit (embedding, final norm, head) once: it stays gathered from forward
        # into backward, which starts with it (torch's default for the root).
        root = sum(shard_numel(local_shape(shape, dim, t), s) for _, shape, dim in stage_root(model, layout))
        add("FSDP2 parameter all-gather", "all_gather", "fsdp", m * (s - 1) * (2 * held - root) * c,
            m * (2 * units - 1), True, f"{m} micro-steps x ({s}-1) x (2 x {held:,} - root {root:,}) x {c} B")
    else:
        gathers = layout.pp + 1  # per pipeline micro-batch forward, and once for the backward passes
        add("FSDP2 parameter all-gather", "all_gather", "fsdp", gathers * m * (s - 1) * held * c,
            gathers * m * units, True, f"{gathers} x {m} micro-steps x ({s}-1) x {held:,} x {c} B")
    syncs = m if recipe.sync_each_batch else 1
    add("FSDP2 gradient reduce-scatter", "reduce_scatter", "fsdp", syncs * (s - 1) * held * FP32, syncs * units,
        True, f"{syncs} x ({s}-1) x {held:,} x 4 B")
    add("HSDP gradient all-reduce", "all_reduce", "dp_replicate", 2 * (r - 1) / r * held * FP32, units, True,
        f"2 x ({r}-1)/{r} x {held:,} x 4 B")
    # With activation checkpointing each layer's forward runs again in backward, collectives included.
    forwards = 2 if recipe.checkpointing else 1
    if t > 1:
        act = n * model.hidden * c
        # The rerun stops once the tensors backward needs exist (torch's non-reentrant checkpoint): the attention
        # output's all-reduce is repeated, the MLP output's is not. Layers whose MLP tp leaves whole (experts)
        # reduce nothing there.
        attention = L if model.attention_split else 0
        reduces = (2 * attention + 2 * min(L, model.split_mlp_layers) + 1 + (attention if recipe.checkpointing else 0)
                   + (1 if model.tied else 0))
        add("TP activation all-reduce", "all_reduce", "tp", m * 2 * (t - 1) / t * act * reduces, m * reduces,
            False, f"{m} x 2 x ({t}-1)/{t} x {n} tokens x {model.hidden} x {c} B x {reduces}")
        if model.qk_norm:
            norms = m * 2 * L * 2 * (t - 1) / t * model.head_dim * c
            add("TP q/k norm gradient all-reduce", "all_reduce", "tp", norms, m * 2 * L, False,
                f"{m} x 2 norms x {L} layers x 2 x ({t}-1)/{t} x {model.head_dim} x {c} B")
        if recipe.chunked_loss:
            # The vocabulary-parallel chunked loss: per chunk, the maximum (4 B per token) and the sum of
            # exponentials with the label's logit (8 B) all-reduced over tp, for every position (those that predict
            # nothing are masked, not left out: the unchunked logits' rows, and no host sync to select them).
            chunks = math.ceil(n / loss_chunk_rows(n, model.vocab // t))
            add("TP chunked-loss log-sum-exp all-reduce", "all_reduce", "tp", m * 2 * (t - 1) / t * n * 12,
                m * 2 * chunks, False, f"{m} x 2 x ({t}-1)/{t} x {n} tokens x 12 B, 2 calls x {chunks} chunks")
        else:
            add("TP logits all-gather", "all_gather", "tp", m * (t - 1) * n * model.vocab // t * c, m, False,
                f"{m} x ({t}-1) x {n} x {model.vocab // t} x {c} B")
    kw = kv_width_local(model, layout)
    vw = kw // model.head_dim * (model.v_head_dim or model.head_dim)
    if layout.sp > 1:
        sp = layout.sp
        width = (model.q_width + model.o_width) // t + kw + vw
        passes = 1 + forwards  # forward (and its rerun), backward: q, k, v and the output each time
        add("Ulysses all-to-all", "all_to_all", "sp", m * passes * L * (sp - 1) / sp * n * width * c,
            m * 4 * passes * L, False, f"{m} x {passes} x {L} x ({sp}-1)/{sp} x {n} x {width} x {c} B")
    if layout.cp > 1:
        cp = layout.cp
        kv = n * (kw + vw)
        gathers = 1 + forwards  # forward (and its rerun), and again in backward
        add("CP K/V all-gather (forward + backward)", "all_gather", "cp", m * gathers * L * (cp - 1) * kv * c,
            m * gathers * L, False, f"{m} x {gathers} x {L} x ({cp}-1) x {n} x ({kw}+{vw}) x {c} B")
        add("CP K/V gradient reduce-scatter", "reduce_scatter", "cp", m * L * (cp - 1) * kv * FP32, m * L, False,
            f"{m} x {L} x ({cp}-1) x {n} x ({kw}+{vw}) x 4 B (accumulated in fp32)")
    if model.moe is not None and layout.ep > 1:
        out += expert_transfers(model, layout, recipe, gpus_per_node)
    if layout.pp > 1:
        act = n * model.hidden * c
        add("pipeline activations and their gradients", "send_recv", "pp", m * 2 * act, m * 2 * layout.pp, False,
            f"{m} x 2 directions x {n} tokens x {model.hidden} x {c} B, in {layout.pp} micro-batches")
    b = layout.batch
    add("loss token count", "all_reduce", "batch", 2 * (b - 1) / b * 8, 1, False,
        f"2 x ({b}-1)/{b} x 8 B")
    return out


def expert_transfers(model: ModelSpec, layout: Layout, recipe: Recipe, gpus_per_node: int) -> list[Transfer]:
    """Expert parallelism's collectives (module docstring): the all-to-alls over ep and the experts' FSDP2 unit over
    expert_shard (groups of the fsdp ranks, `ndparallel.distributed.layout.EXPERT_VIEWS`), HSDP over dp_replicate."""
    assert model.moe is not None
    out: list[Transfer] = []
    fig, sparse, ep, es = figures(model, layout, recipe), model.moe.sparse_layers, layout.ep, layout.expert_shard
    m, c = recipe.accumulation, recipe.compute_bytes
    held, _ = expert_elements(model, layout)
    ep_ranks, shard_ranks = layout.group("ep"), layout.group("expert_shard")
    forwards = 2 if recipe.checkpointing else 1

    def add(purpose: str, kind: str, axis: str, ranks: list[int], value: float, calls: int, overlap: bool, how: str):
        if len(ranks) > 1:
            link = "inter" if ranks[0] // gpus_per_node != ranks[-1] // gpus_per_node else "intra"
            out.append(Transfer(purpose, kind, (axis,), len(ranks), link, value, calls, overlap, how))

    add("expert all-to-all: tokens", "all_to_all", "ep", ep_ranks, (ep - 1) / ep * fig.payload_bytes,
        m * sparse * (2 * forwards + 2), False, f"({ep}-1)/{ep} x {fig.payload_bytes:,} B (experts.py: {m} x {sparse} "
        f"layers x {forwards + 1} passes x 2 directions x {recipe.tokens(layout)} tokens x {model.moe.routed.top_k} x "
        f"{model.moe.routed.hidden} x {c} B)")
    add("expert all-to-all: routing counts", "all_to_all", "ep", ep_ranks, (ep - 1) / ep * fig.count_bytes,
        m * sparse * forwards, False, f"({ep}-1)/{ep} x {m} x {sparse} x {forwards} x {model.moe.routed.experts} x 8 B")
    add("FSDP2 expert all-gather", "all_gather", "expert_shard", shard_ranks, m * (es - 1) * 2 * held * c,
        m * 2 * sparse, True, f"{m} micro-steps x ({es}-1) x 2 x {held:,} x {c} B")
    syncs = m if recipe.sync_each_batch else 1
    add("FSDP2 expert gradient reduce-scatter", "reduce_scatter", "expert_shard", shard_ranks,
        syncs * (es - 1) * held * FP32, syncs * sparse, True, f"{syncs} x ({es}-1) x {held:,} x 4 B")
    r = layout.dp_replicate
    if r > 1:
        replicas = layout.group("dp_replicate")
        add("HSDP expert gradient all-reduce", "all_reduce", "dp_replicate", replicas, 2 * (r - 1) / r * held * FP32,
            sparse, True, f"2 x ({r}-1)/{r} x {held:,} x 4 B")
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
