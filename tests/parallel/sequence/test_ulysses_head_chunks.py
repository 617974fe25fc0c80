"""Head-chunked Ulysses (and context-parallel) attention (issue 50, item 2): the all-to-alls, the attention and its
backward over groups of heads, against the unchunked path.

- exactness: sp 2, cp 2 x sp 2 and cp 2 alone (all-gather and ring), MHA and GQA (including chunks that need the key/value heads repeated further),
  chunks 2 and one query head per chunk, causal and full: output and q/k/v gradients against the unchunked path's
  in fp32 (the same operations on the same heads: 1e-6), and the prepared tiny Llama and Qwen2 (GQA) trained 6 steps
  under ``NDPARALLEL_ULYSSES_HEAD_CHUNKS`` against the same script unchunked (sp 2; Llama also under sp 2 with
  activation checkpointing, cp 2, tp 2 x sp 2, pp 2 x sp 2, dp_shard 2 x sp 2; Qwen2 under pp 2 x sp 2 and
  dp_shard 2 x sp 2), the chunks and the chunked block counted where they run;
- memory: the bytes alive at the peak of one attention layer's forward + backward on one sp rank, and on one cp rank
  with the all-gather (`ndparallel.test_utils.memory.LiveBytes`), chunked against unchunked: fails without the feature;
- host syncs: none, as unchunked (`step_costs.StepCosts`);
- the option: parsing, the environment, "auto", and the refusal of chunks that do not divide the heads.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import accelerate_style
from harness import run_ranks
from ndparallel import MemoryKwargs
from ndparallel.parallel.sequence import SequenceShards, sequence_parallel_attention
from ndparallel.parallel.sequence import ulysses
from ndparallel.parallel.sequence.ulysses import auto_head_chunks, check_head_chunks, chunk_counts
from ndparallel.test_utils.memory import LiveBytes, least_of
from step_costs import StepCosts
from test_parity import GLOBAL_BATCH, max_param_diff

TOLERANCE = 1e-6  # fp32; the chunks run the same kernels on the same heads
HEADS = [(8, 8), (8, 4), (8, 2)]  # (query, key/value heads): per sp-2 rank 4 query heads, 4, 2 or 1 key/value heads


def _groups(cp: int) -> tuple[int, int, int, dist.ProcessGroup, dist.ProcessGroup | None]:
    world, rank = dist.get_world_size(), dist.get_rank()
    sp = world // cp
    cp_rank, sp_rank = divmod(rank, sp)
    sp_groups = [dist.new_group(list(range(c * sp, (c + 1) * sp))) for c in range(cp)]
    cp_groups = [dist.new_group(list(range(s, world, sp))) for s in range(sp)]
    return sp, cp_rank, sp_rank, sp_groups[cp_rank], cp_groups[sp_rank] if cp > 1 else None


def _run(shards, local, dout, sp_group, cp_group, causal, chunks, strategy):
    leaves = [t.detach().clone().requires_grad_() for t in local]
    out = sequence_parallel_attention(*leaves, shards, cp_group=cp_group, sp_group=sp_group, is_causal=causal,
                                      head_chunks=chunks, strategy=strategy)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def _compare(cp: int, strategy: str) -> dict[str, float]:
    dist.init_process_group("gloo")
    sp, cp_rank, sp_rank, sp_group, cp_group = _groups(cp)
    errors: dict[str, float] = {}
    seq = 16 * cp
    for (hq, hkv), causal in itertools.product(HEADS, (True, False)):
        g = torch.Generator().manual_seed(hq * 10 + hkv)
        q, dout = (torch.randn(2, hq, seq, 8, generator=g) for _ in range(2))
        k, v = (torch.randn(2, hkv, seq, 8, generator=g) for _ in range(2))
        shards = SequenceShards.of(seq, cp, cp_rank, True, sp, sp_rank)
        local = [shards.shard(t, 2) for t in (q, k, v)]
        plain = _run(shards, local, shards.shard(dout, 2), sp_group, cp_group, causal, None, strategy)
        for chunks in (2, hq // sp):  # two groups; one query head per group
            got = _run(shards, local, shards.shard(dout, 2), sp_group, cp_group, causal, chunks, strategy)
            errors[f"heads={hq}/{hkv} causal={causal} chunks={chunks}"] = max(
                (a - b).abs().max().item() for a, b in zip(got, plain))
    dist.destroy_process_group()
    return errors


# sp 2, cp 2 x sp 2, cp 2 alone (all-gather and ring): the layouts head chunks run in (test_chunked_block.py too)
LAYOUTS = pytest.mark.parametrize("cp,world,strategy", [(1, 2, "allgather"), (2, 4, "allgather"),
                                                        (2, 2, "allgather"), (2, 2, "ring")],
                                  ids=["sp2", "cp2_sp2", "cp2_allgather", "cp2_ring"])


@LAYOUTS
def test_head_chunks_match_the_unchunked_path(cp, world, strategy):
    results = run_ranks(_compare, world, cp, strategy, timeout=120)
    assert len(results[0]) == len(HEADS) * 2 * 2
    worst = {case: max(r[case] for r in results) for case in results[0]}
    bad = {case: err for case, err in worst.items() if not err <= TOLERANCE}
    assert not bad, f"cp={cp} {strategy}: {bad}"


# ---- memory and host syncs on one sp rank ----------------------------------------------------------------------------
SEQ, MEM_HEADS, HEAD_DIM = 2048, 8, 32  # per sp-2 rank: 4 query heads of 2048 tokens, fp32


def _costs(axis: str, strategy: str = "allgather") -> dict[str, dict]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cp = 2 if axis == "cp" else 1
    shards = SequenceShards.of(SEQ, cp, rank if cp > 1 else 0, True, 3 - cp, 0 if cp > 1 else rank)
    groups = {"cp_group": dist.group.WORLD} if cp > 1 else {"sp_group": dist.group.WORLD}
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, MEM_HEADS, SEQ, HEAD_DIM, generator=g) for _ in range(4)]
    local = [shards.shard(t, 2).contiguous() for t in full]
    report = {}
    # "auto" with a budget of 1 MiB: 4 chunks' q/k/v/o of one rank (4 x 2048 x 32 x 4 B) fit, 2 chunks' do not
    ulysses.HEAD_CHUNK_BYTES = 2**20
    for chunks in (None, 2, 4, "auto") if axis == "sp" else (None, 2, 4):
        counted = []  # each run's host syncs and collectives: the same in every run

        def measure() -> dict[str, int]:
            leaves = [t.clone().requires_grad_() for t in local[:3]]
            with LiveBytes() as memory, StepCosts() as costs:
                out = sequence_parallel_attention(*leaves, shards, strategy=strategy, head_chunks=chunks, **groups)
                out.backward(local[3])
                del out
            counted.append((costs.syncs, dict(costs.collectives)))
            return {"peak": memory.peak}

        peak = least_of(measure)["peak"]  # the least of 3 runs: under gloo a peak can read a buffer high
        assert all(c == counted[0] for c in counted), counted
        report[str(chunks)] = {"peak": peak, "syncs": counted[0][0], "collectives": counted[0][1]}
    dist.destroy_process_group()
    return report


@pytest.fixture(scope="module")
def costs() -> list[dict]:
    return run_ranks(_costs, 2, "sp", timeout=120)


def test_head_chunks_hold_fewer_bytes_at_the_peak(costs):
    """Per rank, u = one sequence-sharded q/k/v/o tensor (8 heads x 1024 tokens x 32 x 4 B = 1 MiB); under sp 2 a
    rank's full-sequence heads (4 heads x 2048 tokens) are u too. Unchunked, attention's backward holds the layer's
    output (u) and 8u of full-sequence heads: q, k, v, o, the output's gradient, and the q/k/v gradients. Chunked,
    the shard's output and q/k/v gradients (4u, which the layer has anyway) and 8u / chunks of full-sequence heads:
    6u with 4 chunks, 0.66x the unchunked peak. "auto" under a 1 MiB budget picks those 4 chunks."""
    u = MEM_HEADS * (SEQ // 2) * HEAD_DIM * 4
    for report in costs:
        plain, two, four = (report[k]["peak"] for k in ("None", "2", "4"))
        assert plain >= 9 * u
        for chunks, peak in ((2, two), (4, four)):
            # the log-sum-exp (fp32, a head's tokens) aside: 4u + 8u / chunks
            assert peak <= 4 * u + 8 * u / chunks + 0.02 * u, f"{chunks} chunks: {peak / u:.2f}u at the peak"
        assert four <= 0.70 * plain, f"4 chunks: {four / plain:.2f}x the unchunked peak ({four} vs {plain} bytes)"
        assert report["auto"]["peak"] == four and report["auto"]["collectives"] == report["4"]["collectives"]


def test_head_chunks_add_no_host_sync(costs):
    for report in costs:
        assert report["None"]["syncs"] == report["2"]["syncs"] == report["4"]["syncs"] == 0
        # unchunked: four all-to-alls forward (q, k, v, o), their four adjoints backward; chunked, per chunk: four
        # forward, and in backward q, k, v's again and the four adjoints
        assert sum(report["None"]["collectives"].values()) == 8
        assert sum(report["4"]["collectives"].values()) == 4 * 11


def test_head_chunks_under_allgather_context_parallelism_hold_fewer_bytes_without_syncs():
    """Context parallelism alone (cp 2, all-gather): the gathered whole-sequence key/value and the attention's buffers
    exist for one group of heads at a time. Measured: 12.5-13.5 MiB at the peak unchunked, 12.3-12.8 with 2 chunks,
    8.1-9.0 with 4 (20.0, 16.0 and 10.0 before the kernel's backward let the gathered key/value go before its
    reduce-scatter and built the reduce-scatter's parts without a whole-sequence copy first; the kernel's bytes are
    checked to the byte in tests/planner/test_planner_context_parallel.py). The ring's, 8.0 unchunked, is already
    one circulating block of key/value: chunks do not help it. Each peak is the least of 3 runs (`least_of`: once, in
    CI, a single run read 14.2 unchunked and 15.5 with 2 chunks); 2 chunks are asked only not to hold more."""
    for report in run_ranks(_costs, 2, "cp", "allgather", timeout=120):
        plain, two, four = (report[k]["peak"] for k in ("None", "2", "4"))
        assert two <= plain + 2**19 and four <= 0.75 * plain, (plain, two, four)
        assert report["None"]["syncs"] == report["2"]["syncs"] == report["4"]["syncs"] == 0


# ---- the prepared models ---------------------------------------------------------------------------------------------
SP = ("--sp-size", "2")
STEPS, LAYERS = 6, 2  # accelerate_style's steps, the tiny models' decoder layers


def _main_counting_head_chunks(argv: list[str]) -> dict:
    """`accelerate_style.main` in a forked rank, with the calls of the attention's head chunks (`_HeadChunked`, which
    the chunked block's forward runs too) counted: whether chunks ran at all."""
    calls = []
    apply = ulysses._HeadChunked.apply

    def counted(*args):
        calls.append(1)
        return apply(*args)

    ulysses._HeadChunked.apply = counted  # this forked rank's copy only
    return {**accelerate_style.main(argv), "head_chunked_calls": len(calls)}


def _train(model: str, chunks: str | None, *flags: str, world: int = 2) -> list[dict]:
    argv = ["--model", model, "--micro-batch", str(GLOBAL_BATCH), "--accum", "1", "--optimizer", "sgd", "--lr", "0.5",
            "--return-params", *(flags or SP)]
    return run_ranks(_main_counting_head_chunks, world, argv,
                     env={"NDPARALLEL_ULYSSES_HEAD_CHUNKS": chunks} if chunks else {})


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "qwen2"])  # 8 query heads, 4 key/value heads (GQA)
def test_prepared_models_train_as_unchunked(model):
    """Llama's attention through the chunked block (once per layer and step), Qwen2's with attention-only chunks."""
    plain = _train(model, None)
    assert plain[0]["head_chunked_calls"] == plain[0]["chunked_block_calls"] == 0
    for chunks in ("2", "4"):  # 4: one query head per chunk, the key/value heads repeated to 8
        got = _train(model, chunks)
        diff = max(abs(a - b) for a, b in zip(got[0]["losses"], plain[0]["losses"]))
        assert diff <= TOLERANCE, f"{model} chunks={chunks}: per-step losses differ by {diff:.2e}"
        assert max_param_diff(got[0]["params"], plain[0]["params"]) <= TOLERANCE
        assert all(r["head_chunked_calls"] > 0 for r in got)
        assert [r["chunked_block_calls"] for r in got] == [LAYERS * STEPS if model == "llama" else 0] * 2


@pytest.mark.slow
@pytest.mark.parametrize("flags", [(*SP, "--activation-checkpointing"), ("--cp-size", "2")],
                         ids=["sp2_activation_checkpointing", "cp2"])
def test_head_chunks_train_as_unchunked_under_checkpointing_and_cp(flags):
    """The decoder layers checkpointed too (their recomputation runs the chunked forward again, whose backward then
    recomputes each chunk); context parallelism alone (all-gather). The chunked block runs in both: under checkpointing
    twice per layer and step (forward, and its recomputation)."""
    plain, got = _train("llama", None, *flags), _train("llama", "2", *flags)
    assert max(abs(a - b) for a, b in zip(got[0]["losses"], plain[0]["losses"])) <= TOLERANCE
    assert max_param_diff(got[0]["params"], plain[0]["params"]) <= TOLERANCE
    per_step = 2 * LAYERS if "--activation-checkpointing" in flags else LAYERS
    assert [r["chunked_block_calls"] for r in got] == [per_step * STEPS] * 2


# 4 ranks each: (world, flags, chunks). The tiny models' 8 query / 4 key/value heads split over tp x sp: under tp 2 x
# sp 2, 2 query heads per rank, 2 chunks; otherwise 4 per rank, 4 chunks (one query head each, key/value repeated)
MORE_LAYOUTS = {
    "tp2_sp2": (4, ("--tp-size", "2", *SP), "2"),
    "pp2_sp2": (4, ("--pp-size", "2", *SP), "4"),
    "fsdp2_sp2": (4, ("--dp-shard-size", "2", *SP), "4"),
}


@pytest.mark.slow
@pytest.mark.parametrize("model,layout", [("llama", "tp2_sp2"), ("llama", "pp2_sp2"), ("llama", "fsdp2_sp2"),
                                          ("qwen2", "pp2_sp2"), ("qwen2", "fsdp2_sp2")])
def test_head_chunks_train_as_unchunked_under_tp_pp_and_fsdp(model, layout):
    """Head chunks with tensor parallelism, pipeline stages and FSDP2 sharding over dp_shard (each with sp 2): every
    rank's losses and parameters (its stage's, under pp) as the unchunked run's. Llama's attention runs through the
    chunked block (`parallel/sequence/block.py`) under pp and fsdp: once per layer and micro-batch on every rank (plus,
    under pp, the schedule's first call, which runs each stage once more to learn its shapes); under tp, whose
    projections are DTensors, never -- the module's own forward with the attention-only chunks. Qwen2's attention is
    not one the block reproduces: attention-only chunks under pp and fsdp (under tp Llama's run takes that path)."""
    world, flags, chunks = MORE_LAYOUTS[layout]
    plain, got = _train(model, None, *flags, world=world), _train(model, chunks, *flags, world=world)
    for rank, (mine, theirs) in enumerate(zip(got, plain)):
        diff = max(abs(a - b) for a, b in zip(mine["losses"], theirs["losses"]))
        assert len(mine["losses"]) == STEPS and diff <= TOLERANCE, f"{layout} rank {rank}: losses differ by {diff:.2e}"
        assert max_param_diff(mine["params"], theirs["params"]) <= TOLERANCE, (layout, rank)
        assert theirs["head_chunked_calls"] == theirs["chunked_block_calls"] == 0
        assert mine["head_chunked_calls"] > 0, (layout, rank)
        layers, runs = (LAYERS // 2, 2 * STEPS + 1) if layout == "pp2_sp2" else (LAYERS, STEPS)  # pp: 2 micro-batches
        block = model == "llama" and layout != "tp2_sp2"
        assert mine["chunked_block_calls"] == (layers * runs if block else 0), (layout, rank, mine["chunked_block_calls"])


# ---- the option ------------------------------------------------------------------------------------------------------
def test_option_and_environment():
    assert MemoryKwargs().ulysses_head_chunks is None
    assert MemoryKwargs(ulysses_head_chunks="4").ulysses_head_chunks == 4
    assert MemoryKwargs(ulysses_head_chunks=1).ulysses_head_chunks is None
    assert MemoryKwargs(ulysses_head_chunks="Auto").ulysses_head_chunks == "auto"
    env = {"NDPARALLEL_ULYSSES_HEAD_CHUNKS": "2"}
    assert MemoryKwargs.from_env(None, env).ulysses_head_chunks == 2
    assert MemoryKwargs.from_env(MemoryKwargs(ulysses_head_chunks=4), env).ulysses_head_chunks == 4
    with pytest.raises(ValueError, match=r"ulysses_head_chunks must be None, 'auto' or an int >= 1, got 'two'"):
        MemoryKwargs(ulysses_head_chunks="two")


def test_auto_picks_the_fewest_chunks_that_fit_and_refusals():
    assert chunk_counts(32, 8) == [1, 2, 4]
    # Llama-3.1-8B shaped, sp 8, bf16: 4 query heads and 1 key/value head (repeated as chunks need) per rank
    per_head = 128 * 2  # bytes of one head's token
    assert auto_head_chunks(32, 8, 8, 1 << 20, 1, 128, 2) == 4  # even one head each is over 128 MiB: the most
    assert auto_head_chunks(32, 8, 8, 4096, 1, 128, 2) == 1  # 10 heads x 4096 x 256 B = 10 MiB: unchunked
    fits_two = 128 * 2**20 // ((2 + 2 + 1 + 1) * per_head)  # 2 chunks: q, o of 2 heads, k, v of 1 (repeated) each
    assert auto_head_chunks(32, 8, 8, fits_two, 1, 128, 2) == 2
    assert auto_head_chunks(32, 8, 8, fits_two + 1, 1, 128, 2) == 4
    check_head_chunks(2, 8, sp_size=2, tp_size=2)
    check_head_chunks("auto", 8, sp_size=2)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM: ulysses_head_chunks=3 does not divide the 4 query heads "
                                         r"each sp rank holds .* chunk counts that work: \[1, 2, 4\]"):
        check_head_chunks(3, 8, sp_size=2, where="LlamaForCausalLM")
    # under tp the heads each sp rank holds are those of its tp rank: tp 2 x sp 2 leaves 2 of 8
    with pytest.raises(ValueError, match=r"ulysses_head_chunks=4 does not divide the 2 query heads each sp rank holds "
                                         r"\(num_attention_heads=8 / tp_size=2 / sp_size=2\); chunk counts that work: "
                                         r"\[1, 2\]"):
        check_head_chunks(4, 8, sp_size=2, tp_size=2)


def _prepared_setting() -> dict:
    from ndparallel import Accelerator, ParallelismConfig
    from tiny_models import build_model

    acc = Accelerator(parallelism_config=ParallelismConfig(sp_size=2))
    chunks = acc.sequence_sharding.head_chunks
    try:
        acc.prepare(build_model("llama"))
        refused = ""
    except ValueError as err:
        refused = str(err)
    return {"chunks": chunks, "refused": refused}


def test_the_environment_reaches_attention_and_prepare_refuses_chunks_that_do_not_divide():
    on = run_ranks(_prepared_setting, 2, env={"NDPARALLEL_ULYSSES_HEAD_CHUNKS": "2"}, timeout=60)
    assert [r["chunks"] for r in on] == [2, 2] and not on[0]["refused"]
    bad = run_ranks(_prepared_setting, 2, env={"NDPARALLEL_ULYSSES_HEAD_CHUNKS": "3"}, timeout=60)
    assert "ulysses_head_chunks=3 does not divide the 4 query heads each sp rank holds" in bad[0]["refused"]
