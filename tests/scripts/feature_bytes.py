"""Print the CPU-countable bytes behind each issue-50 memory feature, with and without it, through the helpers of the
test that asserts it (docs/long_context.md, "Bytes held at the peak, with and without each feature"):

    PYTHONPATH=src python tests/scripts/feature_bytes.py

The tests assert bounds and ratios; this prints the figures they bound. Nothing here is asserted.
"""

from __future__ import annotations

import copy
import importlib
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1]
for folder in [TESTS, TESTS / "scripts", *sorted({p.parent for p in TESTS.rglob("test_*.py")} - {TESTS})]:
    sys.path.insert(0, str(folder))  # as tests/conftest.py puts them
torch.set_num_threads(1)

from harness import run_ranks  # noqa: E402


def fused_norm() -> None:
    """test_rms_norm.py::test_what_a_fused_norm_keeps: a bf16 norm of 256 tokens x 64, and the tiny bf16 Llama."""
    from test_rms_norm import apply_fused_rms_norm, build_model, kept_bytes, one_norm, training_step_kept_bytes

    from ndparallel.test_utils.memory import LiveBytes

    tokens, hidden = 256, 64
    norm, fused, x = one_norm(tokens, hidden)
    print(f"fused norm, one norm kept: {kept_bytes(lambda: norm(x), norm.parameters()):,} B without, "
          f"{kept_bytes(lambda: fused(x), fused.parameters()):,} B with")
    model = build_model("llama", hidden_size=hidden).to(torch.bfloat16)
    own = copy.deepcopy(model)
    apply_fused_rms_norm(model)
    ids = torch.randint(0, 96, (1, tokens))
    saved = {name: training_step_kept_bytes(m, ids) for name, m in (("without", own), ("with", model))}
    peaks = {}
    for name, m in (("without", own), ("with", model)):
        m.zero_grad(set_to_none=True)
        with LiveBytes() as live:
            m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        peaks[name] = live.peak
    print(f"fused norm, tiny Llama: saved {saved['without']:,} -> {saved['with']:,} B, "
          f"live at the peak {peaks['without']:,} -> {peaks['with']:,} B")


def norm_chunks() -> None:
    """test_rms_norm.py::test_over_chunks_...: one fused norm's backward of 2 x 2,048 tokens x 64, in one chunk and in
    chunks of 64 tokens' working set."""
    import test_rms_norm

    rms_norm = importlib.import_module("ndparallel.parallel.memory.rms_norm")
    for dtype in (torch.float32, torch.bfloat16):
        whole = test_rms_norm._norm_backward(2048, dtype, "scaled_after_cast", 64, rows=2)[2]
        before = rms_norm.CHUNK_BYTES
        rms_norm.CHUNK_BYTES = 64 * rms_norm.token_bytes(64)
        try:
            chunks = test_rms_norm._norm_backward(2048, dtype, "scaled_after_cast", 64, rows=2)[2]
        finally:
            rms_norm.CHUNK_BYTES = before
        print(f"norm backward over chunks, {dtype}: {whole:,} -> {chunks:,} B at its peak ({chunks / whole:.2f}x)")


def head_chunks() -> None:
    """test_ulysses_head_chunks.py::test_head_chunks_hold_fewer_bytes_at_the_peak: one attention call's forward +
    backward on each sp-2 rank, 8 heads of 32, 2,048 tokens, fp32."""
    import test_ulysses_head_chunks as t

    for rank, report in enumerate(run_ranks(t._costs, 2, "sp", timeout=300)):
        print(f"head chunks, sp rank {rank}: " + ", ".join(f"{k} chunks {report[k]['peak']:,} B"
                                                           for k in ("None", "2", "4")))


def chunked_block() -> None:
    """test_chunked_block.py::test_chunked_block_holds_fewer_bytes_at_the_peak: one Llama attention module on each
    sp-2 rank, 2,048 tokens, hidden 256, 8 / 2 heads of 32, 4 chunks, fp32."""
    import test_chunked_block as t

    for rank, report in enumerate(run_ranks(t._memory, 2, timeout=300)):
        module, block = report["module"], report["block"]
        print(f"chunked block, sp rank {rank}: " + ", ".join(
            f"{k} {module[k]:,} -> {block[k]:,} B" for k in ("forward_live", "forward_peak", "backward_peak")))


def _gathered_between(sizes: dict[str, int], offload: bool) -> dict:
    """test_cpu_offload.py's `_states_after_forward`, counting the bytes of the blocks' unsharded parameters that
    exist between forward and backward."""
    from torch.distributed.fsdp import FSDPModule

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
    from tiny_models import build_model

    acc = Accelerator(parallelism_config=ParallelismConfig(**sizes), cpu=True,
                      fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=offload))
    model = acc.prepare(build_model("llama"))
    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules()
              if isinstance(m, FSDPModule) and m is not model]

    def gathered() -> int:
        return sum(p._unsharded_param.untyped_storage().nbytes() for g in groups for p in g.fsdp_params
                   if p.sharded_state.name == "UNSHARDED")

    ids = torch.arange(32).remainder(96).unsqueeze(0)
    loss = model(input_ids=ids, labels=ids).loss
    between = gathered()
    loss.backward()
    return {"between": between, "sharded": sum(p.sharded_param.numel() * p.sharded_param.element_size()
                                               for g in groups for p in g.fsdp_params)}


def offload_reshard() -> None:
    """test_cpu_offload.py: tp 2 (a one-rank shard group), the blocks' parameters between forward and backward."""
    for offload in (False, True):
        rank = run_ranks(_gathered_between, 2, {"tp_size": 2}, offload, timeout=300)[0]
        print(f"offload reshard, cpu_offload={offload}: {rank['between']:,} B of unsharded block parameters between "
              f"forward and backward (the blocks' shards: {rank['sharded']:,} B)")


def host_pool() -> None:
    """test_host_pool.py: 4 layer inputs of 3 x 48 x 32 fp32 through the pool (copy=True), 3 steps."""
    import test_host_pool as t

    from ndparallel.planner.offload import pinned

    model, _, offload = t._models()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        ids = torch.randint(0, 96, (3, 48), generator=torch.Generator().manual_seed(step))
        t._step(model, optimizer, ids)
    stats, nbytes = offload.pool.stats, 3 * 48 * 32 * 4
    print(f"host pool: held {stats.peak_held:,} B for {t.LAYERS} layer inputs of {nbytes:,} B "
          f"({stats.allocations} allocations in 3 steps); one pinned block each: {t.LAYERS * pinned(nbytes):,} B")


if __name__ == "__main__":
    for part in (fused_norm, norm_chunks, head_chunks, chunked_block, offload_reshard, host_pool):
        part()
