"""Step time: compute from FLOPs and an achievable fraction of peak, communication from bytes and bandwidth, and
how much of the communication hides behind the compute.

- compute = global tokens x FLOPs per token / world / (peak x compute_efficiency). FLOPs per token as the GPU
  performs them (`ndparallel.training.flops`): 6 N_matmul + 6 L (q_width + v_width) K, with K the keys a query attends
  to on average -- S/2 under the causal mask (the MFU convention counts the whole score matrix, K = S), w - w^2/2S under
  a sliding window w < S -- plus one forward of the layers again (2 N_layers + 2 L (q_width + v_width) K) with
  activation checkpointing, and one forward of the MLPs again with tiled MLPs (each tile's own checkpoint), and with
  head chunks (`footprint.head_chunks` > 1) one forward of the attention again (each chunk's, in its backward), with
  the q/k/v projections' in Llama's chunked block (`footprint.chunked_block`); the chunks' collectives run again
  too (Ulysses' q/k/v all-to-alls, cp's K/V gather or ring hops), which the communication terms do not count.
- mixtures of experts (`moe`): N_matmul counts the k routed experts a token goes to (not all E), the shared
  experts and the router; weights tensor parallelism leaves whole (the experts, the router) are multiplied on every
  tp rank, so a GPU performs 6 (N_split + t N_whole) per token of its tp group's. MLA attends with queries and keys
  of head_dim and values of v_head_dim: 2 L heads (head_dim + v_head_dim) K per token forward; layers alternating
  sliding and full attention (gpt-oss) average K over the layers.
- activation offloading: each layer's input goes to host memory and back (2 x L x n x h x c bytes per micro-step)
  at the profile's host_bandwidth, on the copy engines: exposed only beyond overlap x compute.
- FSDP2's CPU offload (`offload`): every unit's fp32 shard to the GPU at each all-gather and the gradient shards
  back, on the same copy engines and link as activation offloading (their time added, hidden up to overlap x
  compute); the optimizer steps on the host, 28 B per parameter at host_optimizer_bandwidth.
- each collective: bytes / bandwidth of its link class + calls x latency.
- data-parallel traffic (FSDP2 all-gathers and reduce-scatters, HSDP all-reduces) runs while other layers compute:
  exposed = max(0, its time - overlap x compute). Tensor-, context- and sequence-parallel collectives sit on the
  critical path (each layer waits for them) and count in full.
- optimizer = bytes AdamW reads and writes per parameter it holds (28) / HBM bandwidth.
- pipeline stages (pp > 1): every stage computes its share, then waits in the schedule's bubble: with the default
  1F1B and m = pp micro-batches per micro-step, compute x (m + pp - 1) / m (the bubble (pp-1)/(m+pp-1) of the step).
- step = compute + exposed communication + optimizer; tokens/s per GPU = global tokens / step / world;
  MFU = tokens/s per GPU x FLOPs per token (metrics convention) / peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..training.flops import forward_flops, training_flops
from .comm import Transfer
from .hardware import Hardware
from ..distributed.layout import Layout
from .expert_costs import expert_elements
from .footprint import chunked_block, head_chunks, stage_root, state_elements
from .model import ModelSpec
from .offload import host_traffic
from .recipe import FP32, OPTIMIZER_STATES, Recipe, local_shape, shard_numel


@dataclass(frozen=True)
class Timing:
    compute_s: float
    comm_s: dict[str, float]  # by purpose, before overlap
    overlappable_s: float
    critical_s: float
    exposed_s: float  # communication not hidden by compute
    optimizer_s: float
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    hardware_flops: float  # per GPU per step
    how: dict[str, str]


def attended_keys(model: ModelSpec, seq_len: int) -> float:
    """Keys a query sees on average: S/2 under a causal mask; w - w^2/2S under a sliding window w < S; the mean over
    the layers when only some use the window."""
    w = model.sliding_window
    if w is None or w >= seq_len:
        return seq_len / 2
    windowed = w - w * w / (2 * seq_len)
    if model.window_layers is None:
        return windowed
    return (model.window_layers * windowed + (model.layers - model.window_layers) * seq_len / 2) / model.layers


def hardware_flops_per_token(model: ModelSpec, recipe: Recipe, layout: Layout) -> float:
    """FLOPs the GPUs perform per token of training (module docstring; `ndparallel.training.flops`), per GPU of a tp
    group of ``layout.tp`` for weights tensor parallelism leaves whole (a mixture's experts and routers)."""
    split, whole = model.matmul_parameters()
    head = model.hidden * model.vocab
    layer_matmul = split - head + layout.tp * whole
    width, keys = model.q_width + model.o_width, attended_keys(model, recipe.seq_len)
    flops = training_flops(layer_matmul + head, model.layers, width, keys)
    if recipe.checkpointing:  # each layer's forward once more in backward
        flops += forward_flops(layer_matmul, model.layers, width, keys)
    if recipe.tiled_mlp:  # each tile's checkpoint runs the (dense) MLP's forward once more in backward
        flops += forward_flops(model.dense_layers * (3 if model.gated else 2) * model.hidden * model.intermediate)
    if head_chunks(model, layout, recipe) > 1:  # each chunk's attention forward again in its backward
        qkv = model.hidden * (model.q_width + 2 * model.kv_heads * model.head_dim) * model.layers
        flops += forward_flops(qkv if chunked_block(model, layout, recipe) else 0, model.layers, width, keys)
    return flops


def transfer_seconds(item: Transfer, hw: Hardware) -> float:
    if item.link == "inter":
        return item.bytes / hw.inter_node_bandwidth + item.calls * hw.inter_node_latency_s
    return item.bytes / hw.intra_node_bandwidth + item.calls * hw.intra_node_latency_s


def step_time(model: ModelSpec, layout: Layout, recipe: Recipe, items: list[Transfer], hw: Hardware,
              global_tokens: int) -> Timing:
    world = layout.world
    peak = hw.peak_flops(recipe.mixed_precision)
    hw_fpt = hardware_flops_per_token(model, recipe, layout)
    flops = global_tokens * hw_fpt / world
    busy = flops / (peak * hw.compute_efficiency)
    micro = layout.pp  # the default schedule: one micro-batch per stage
    compute = busy * (micro + layout.pp - 1) / micro
    comm: dict[str, float] = {}
    overlappable = critical = 0.0
    for item in items:
        seconds = transfer_seconds(item, hw)
        comm[item.purpose] = comm.get(item.purpose, 0.0) + seconds
        if item.overlappable:
            overlappable += seconds
        else:
            critical += seconds
    hidden = min(overlappable, hw.overlap * compute)
    exposed = critical + overlappable - hidden
    held, _, _ = state_elements(model, layout)
    held += expert_elements(model, layout)[0]
    host = 0.0  # bytes over the host link per step, on the copy engines
    if recipe.offload:  # every layer's input to host memory and back, per micro-step
        host += recipe.accumulation * 2 * model.layers // layout.pp * recipe.tokens(layout) * model.hidden \
            * recipe.compute_bytes
    if recipe.offload_params:  # FSDP2's cpu_offload: shards in for every all-gather, gradients out (`offload`)
        root = sum(shard_numel(local_shape(shape, dim, layout.tp), layout.fsdp)
                   for _, shape, dim in stage_root(model, layout))
        host += sum(host_traffic(held - root, root, layout, recipe)[:2])
    offload = host / hw.host_bandwidth
    exposed += max(0.0, offload - hw.overlap * compute)
    moved = (2 * (1 + OPTIMIZER_STATES[recipe.optimizer]) + 1) * FP32
    optimizer = held * moved / (hw.host_optimizer_bandwidth if recipe.offload_params else hw.hbm_bandwidth)
    step = compute + exposed + optimizer
    tps = global_tokens / step / world
    mfu = tps * model.flops_per_token(recipe.seq_len) / peak
    how = {
        "compute": f"{global_tokens:,} tokens x {hw_fpt / 1e9:.2f} GFLOP/token / {world} GPUs / ({peak / 1e12:.0f} "
                   f"TFLOP/s x {hw.compute_efficiency})"
                   + (f" x ({micro} + {layout.pp} - 1) / {micro} (pipeline bubble)" if layout.pp > 1 else ""),
        "exposed": f"critical {critical * 1e3:.2f} ms + data-parallel {overlappable * 1e3:.2f} ms - hidden "
                   f"min(that, {hw.overlap} x compute) = {hidden * 1e3:.2f} ms"
                   + (f"; offload {offload * 1e3:.2f} ms to and from host memory at {hw.host_bandwidth / 1e9:.0f} GB/s, "
                      f"exposed beyond {hw.overlap} x compute" if host else ""),
        "optimizer": f"{held:,} parameters x {moved} B / " + (
            f"{hw.host_optimizer_bandwidth / 1e9:.0f} GB/s (on the host: cpu_offload)" if recipe.offload_params
            else f"{hw.hbm_bandwidth / 1e12:.2f} TB/s"),
    }
    return Timing(compute, comm, overlappable, critical, exposed, optimizer, step, tps, mfu, flops, how)
