"""benchmarks/run.py keeps working: the collective counter on known tensors, and the whole command on a tiny
model with 2 ranks (the figures themselves are the benchmark's business, not a test's)."""

import builtins
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from harness import run_ranks  # noqa: E402


def _known_collectives():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import Partial

    from ndparallel.test_utils.collectives import CollectiveCounter

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    x = torch.ones(1000)  # 4000 bytes
    out = {}
    partial = DTensor.from_local(x, mesh, [Partial()])
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    y = torch.ones(250, dtype=torch.float64)  # 2000 bytes

    def exchange():  # as the ring attention passes K and V: two sends and two receives in one batch
        ops = [dist.P2POp(dist.isend, t, peer) for t in (x, y)]
        ops += [dist.P2POp(dist.irecv, torch.empty_like(t), peer) for t in (x, y)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    cases = {
        "c10d all_reduce": lambda: dist.all_reduce(x),
        "c10d all_gather": lambda: dist.all_gather_into_tensor(torch.empty(2000), x),
        "c10d reduce_scatter": lambda: dist.reduce_scatter_tensor(torch.empty(500), x),
        "DTensor Shard->Replicate": lambda: DTensor.from_local(x, mesh, [Shard(0)]).redistribute(mesh, [Replicate()]),
        "DTensor Partial->Replicate": lambda: partial.redistribute(mesh, [Replicate()]),
        "DTensor Partial->Shard": lambda: partial.redistribute(mesh, [Shard(0)]),
        "batch_isend_irecv": exchange,
        "send": lambda: dist.send(x, peer) if rank == 0 else dist.recv(torch.empty_like(x), peer),
    }
    for name, fn in cases.items():
        with CollectiveCounter() as counter:
            fn()
        out[name] = dict(counter.bytes)
        if name in ("batch_isend_irecv", "send"):
            out[name + " calls"] = dict(counter.calls)
    return out


def test_counter_gives_ring_bytes_for_known_collectives():
    counted = run_ranks(_known_collectives, 2)
    # Two ranks, 4000-byte tensors: an all-reduce sends 2 (n-1)/n x 4000; an all-gather sends its 4000-byte input
    # once; a reduce-scatter sends the half it does not keep (2000).
    expected = {"c10d all_reduce": {"all_reduce": 4000}, "c10d all_gather": {"all_gather": 4000},
                "c10d reduce_scatter": {"reduce_scatter": 2000},
                "DTensor Shard->Replicate": {"all_gather": 4000},
                "DTensor Partial->Replicate": {"all_reduce": 4000},
                "DTensor Partial->Shard": {"reduce_scatter": 2000}}
    # Point to point: what a rank sends, one call per tensor; receiving counts nothing.
    both = {"batch_isend_irecv": {"send_recv": 6000}, "batch_isend_irecv calls": {"send_recv": 2}}
    assert counted == [{**expected, **both, "send": {"send_recv": 4000}, "send calls": {"send_recv": 1}},
                       {**expected, **both, "send": {}, "send calls": {}}]


@pytest.mark.slow
def test_benchmark_command_on_a_tiny_model(tmp_path):
    import run

    results = run.main(["--layouts", "fsdp2", "tp", "--hidden", "64", "--layers", "2", "--vocab", "256",
                        "--seq", "32", "--warmup", "1", "--steps", "1", "--repeats", "2", "--no-plots",
                        "--no-accelerate", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["layout"]["name"] for r in saved["results"]] == ["fsdp2", "tp"]
    assert "| fsdp2 | 2 |" in (tmp_path / "results.md").read_text()
    fsdp2, tp = results
    assert len(fsdp2["ratio_per_repeat"]) == 2 and fsdp2["ratio"] > 0
    # Every dimension of this model divides by 2, so FSDP2 pads nothing: gathers and scatters are the minimum,
    # and each rank holds exactly half of the model states.
    for kind in ("all_gather", "reduce_scatter"):
        assert fsdp2["bytes"]["library"][kind] == fsdp2["bytes"]["plain"][kind] == fsdp2["bytes_minimum"][kind]
    assert all(sum(s.values()) == fsdp2["states_ideal"] for s in fsdp2["states"]["library"])
    # Library and plain PyTorch apply the same TP plan: each block's attention and MLP all-reduce their activations
    # once forward and once backward (Megatron's minimum). Plain PyTorch gathers the vocabulary-split logits once for
    # its loss; the library's chunked loss is vocabulary-parallel (parallel/memory/cross_entropy.py): no gather, and
    # per position two all-reduces of fp32 terms (the max; the sum of exponentials with the target's logit). Every
    # position goes through the head, as in the unchunked logits; the ones without a label (each row's last, after
    # the shift) are masked by `where`, not selected, which would read the labels on the host (issue 38).
    assert tp["bytes"]["plain"]["all_gather"] == pytest.approx(tp["bytes_minimum"]["all_gather"])
    assert "all_gather" not in tp["bytes"]["library"]
    positions = 2 * 32  # --batch 2 rows of --seq 32 tokens
    assert tp["bytes"]["plain"]["all_reduce"] == pytest.approx(tp["bytes_minimum"]["all_reduce"])
    assert tp["bytes"]["library"]["all_reduce"] == tp["bytes"]["plain"]["all_reduce"] + 3 * 4 * positions
    assert tp["calls"]["library"]["all_reduce"] == tp["calls"]["plain"]["all_reduce"] + 2 == 4 * 2 + 1 + 2  # + the loss's two


def test_benchmark_command_says_how_to_get_matplotlib(monkeypatch, tmp_path):
    import run

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(SystemExit, match=r"needs matplotlib.*\.\[bench\]"):
        run.main(["--layouts", "fsdp2", "--out", str(tmp_path)])


TINY = ["--hidden", "64", "--layers", "2", "--vocab", "256", "--seq", "32", "--batch", "2", "--warmup", "1",
        "--steps", "1", "--repeats", "1", "--no-plots", "--no-accelerate"]


def test_benchmark_sequence_layouts_against_hand_written_attention(tmp_path):
    import run

    cp, sp = run.main(["--layouts", "cp", "sp", "--out", str(tmp_path), *TINY])
    # The hand-written CP and Ulysses attention (benchmarks/plain_sequence.py) train exactly what the library does:
    # the last step's losses agree on every rank.
    assert max(cp["loss_gap"] + sp["loss_gap"]) < 1e-5
    # Ulysses: q, k, v and the output all-to-all'd forward and their gradients backward, 8 per layer, each of the
    # minimum size; library and plain send the same.
    assert sp["bytes"]["library"] == sp["bytes"]["plain"]
    assert sp["bytes"]["library"]["all_to_all"] == pytest.approx(sp["bytes_minimum"]["all_to_all"])
    assert sp["calls"]["library"]["all_to_all"] == 8 * 2
    # All-gather CP: the plain version keeps the gathered K/V for backward and sends the minimum; the library
    # gathers them again in backward (so only this rank's shard is saved): the minimum plus exactly one more
    # all-gather of K and V per layer. Gradients of K/V are reduce-scattered once either way.
    head_dim, kv_heads, layers = 64 // 8, 4, 2
    regather = layers * 2 * kv_heads * 2 * (32 // 2) * head_dim * 4  # (cp-1)=1 x K and V of the local shard, fp32
    assert cp["bytes"]["plain"]["all_gather"] == pytest.approx(cp["bytes_minimum"]["all_gather"])
    assert cp["bytes"]["library"]["all_gather"] == pytest.approx(cp["bytes_minimum"]["all_gather"] + regather)
    for layout in (cp, sp):
        assert layout["bytes"]["library"]["reduce_scatter"] == pytest.approx(layout["bytes_minimum"]["reduce_scatter"])
        assert all(sum(s.values()) == layout["states_ideal"] for s in layout["states"]["library"])


def test_loss_gap_exposes_a_wrong_baseline(tmp_path, monkeypatch):
    import run
    import workloads

    # Without the hand-written attention each rank of the plain run attends only within its own shard: the loss
    # gap column must show it.
    monkeypatch.setattr(workloads, "install", lambda model, groups: None)
    (cp,) = run.main(["--layouts", "cp", "--out", str(tmp_path), *TINY])
    assert max(cp["loss_gap"]) > 1e-3


def test_a_failing_layout_keeps_the_others_results(tmp_path, monkeypatch):
    import run
    import workloads

    def broken(model, groups):
        raise RuntimeError("hand-written attention broke")

    monkeypatch.setattr(workloads, "install", broken)  # only layouts that shard the sequence install it
    with pytest.raises(SystemExit, match="1 layout.*failed: cp;"):
        run.main(["--layouts", "fsdp2", "cp", "--out", str(tmp_path), *TINY])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["layout"]["name"] for r in saved["results"]] == ["fsdp2"]
    assert "hand-written attention broke" in saved["failures"]["cp"]
    assert "hand-written attention broke" in (tmp_path / "results.md").read_text()


def _gpu_program_on_cpu(out: str) -> dict:
    import gpu

    return gpu.main(["--device", "cpu", "--seq-lens", "32", "64", "--repeats", "1", "--model-layers", "1",
                     "--model-hidden", "64", "--train-seq-len", "32", "--train-steps", "4", "--attention-heads", "4",
                     "2", "--out", out])


@pytest.mark.slow
def test_gpu_benchmark_program_runs_on_cpu(tmp_path):
    """benchmarks/gpu.py is run on GPU machines only when one is lent: its logic is checked here with tiny sizes
    on CPU (`--device cpu`), so a GPU session spends its time on figures, not on fixing the program."""
    result = run_ranks(_gpu_program_on_cpu, 1, str(tmp_path))[0]
    assert [row["seq_len"] for row in result["attention"]] == [32, 64]
    assert all(row["block_kernel"] == "cpu_flash" and row["block_s"] > 0 for row in result["attention"])
    assert [row["activation_checkpointing"] for row in result["training"]] == [False, True]
    # the library and plain PyTorch trained the same model on the same tokens: their losses are close
    assert all(abs(row["library_final_loss"] - row["plain_final_loss"]) < 0.05 for row in result["training"])
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| 64 | cpu_flash |" in table and json.loads((tmp_path / "gpu_check.json").read_text())["training"]


def test_packed_sequence_benchmark_runs_and_computes_only_visible_pairs(tmp_path):
    import packed_sequences

    result = packed_sequences.main(["--row-len", "256", "--docs", "12", "--median-doc", "30", "--cp", "2",
                                    "--repeats", "1", "--out", str(tmp_path)])
    row = result["results"][0]
    assert row["packed"]["tokens"] == row["padded"]["tokens"] == row["packed, dealt"]["tokens"]  # the same tokens
    assert all(row[k]["computed"] == row[k]["visible"] > 0 for k in ("packed", "packed, dealt", "padded"))
    assert row["packed, dealt"]["imbalance"] <= row["packed"]["imbalance"]
    assert "| 2 | packed, dealt |" in (tmp_path / "packed_sequences.md").read_text()


@pytest.mark.slow
def test_pipeline_benchmark_counts_what_the_stages_send_and_trains_as_plain_pipelining():
    """benchmarks/pipeline.py on a tiny Llama over 2 stages: the library and hand-written pipelining trained the same
    model on the same batches (their losses agree to rounding), and each stage sent exactly one activation-sized
    tensor per direction and step (stage 0 the hidden states forward, stage 1 their gradient backward)."""
    import pipeline

    rows = pipeline.main(["--hidden", "32", "--layers", "2", "--vocab", "64", "--seq", "16", "--batch", "4",
                          "--microbatches", "2", "--schedules", "gpipe", "1f1b", "--warmup", "1", "--steps", "1",
                          "--repeats", "2"])
    assert [(r["schedule"], r["m"]) for r in rows] == [("gpipe", 2), ("1f1b", 2)]
    for r in rows:
        assert r["loss_gap"] < 1e-4, r["loss_gap"]
        assert r["activation"] == 4 * 16 * 32 * 4
        assert r["sent"] == [{"forward": r["activation"], "backward": 0}, {"forward": 0, "backward": r["activation"]}]
        assert r["sent_plain"] == r["sent"]
        assert r["bubble_formula"] == pytest.approx(1 / 3) and r["ratio"] > 0
        assert r["layers"] == [[0], [1]]


# ---- GPU scripts fork their ranks from a parent that never initialised CUDA ---------------------------------------
CUDA_ENTRY_POINTS = ("_lazy_init", "init", "is_available", "device_count", "get_device_name", "get_device_properties",
                     "get_device_capability", "current_device", "set_device", "synchronize", "memory_allocated",
                     "max_memory_allocated", "max_memory_reserved", "reset_peak_memory_stats", "mem_get_info")
NVML_SAFE = ("is_available", "device_count")  # driver-free when PYTORCH_NVML_BASED_CUDA_CHECK=1


def _forbid_cuda_in_this_process(monkeypatch) -> None:
    """Every torch.cuda call that initialises CUDA, or asks the CUDA driver about devices (after which a forked child
    cannot use CUDA: "Cannot re-initialize CUDA in forked subprocess"), raises in this process; forked children call
    the real ones. Asking NVML (PYTORCH_NVML_BASED_CUDA_CHECK=1) how many GPUs there are is allowed."""
    import os

    parent = os.getpid()
    for name in CUDA_ENTRY_POINTS:
        original = getattr(torch.cuda, name)

        def guarded(*args, _name=name, _original=original, **kwargs):
            nvml = _name in NVML_SAFE and os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1"
            if os.getpid() == parent and not nvml:
                raise AssertionError(f"torch.cuda.{_name}() called in the parent process before it forks its ranks")
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch.cuda, name, guarded)


@pytest.mark.slow
def test_long_context_gpu_benchmark_forks_its_ranks_from_a_parent_without_cuda(tmp_path, monkeypatch):
    """benchmarks/long_context_gpu.py (scripts/gpu_check.sh runs it) forks a rank per measurement: its parent asked
    torch.cuda for the GPU's name first and every rank then failed on a GPU ("Cannot re-initialize CUDA in forked
    subprocess", issue 38). Here its whole parent path runs with torch.cuda forbidden in the parent (the program on
    a tiny model, `--device cpu`: the same parent path as on a GPU)."""
    import long_context_gpu

    _forbid_cuda_in_this_process(monkeypatch)
    result = long_context_gpu.gpu_rows(["--device", "cpu", "--out", str(tmp_path)])
    assert [(r["model"], r["setting"]) for r in result["rows"]] == [("tiny", "all"), ("tiny", "plain")]
    assert all(r["measured"] is not None for r in result["rows"]) and result["longest"]["tiny"]["all"] > 0
    assert "on one CPU" in (tmp_path / "long_context_gpu.md").read_text()


@pytest.mark.slow
def test_long_context_gpu_issue50_rows_run_each_setting_under_each_allocator(tmp_path, monkeypatch):
    """`--issue50` (the fused norm and FSDP2's CPU offload beside `all`, each under the default allocator and under
    expandable segments) runs end to end on the CPU's tiny model, with the reserve in its table."""
    import long_context_gpu

    _forbid_cuda_in_this_process(monkeypatch)
    result = long_context_gpu.gpu_rows(["--device", "cpu", "--issue50", "--out", str(tmp_path)])
    assert [(r["setting"], r["allocator"]) for r in result["rows"]] == [
        ("all", "default"), ("all", "expandable"), ("all + issue 50", "default"), ("all + issue 50", "expandable")]
    assert all(r["measured"] is not None for r in result["rows"])
    assert "reserve GiB" in (tmp_path / "long_context_gpu_issue50.md").read_text()


def test_long_context_gpu_settings_ask_the_planner_for_what_they_run():
    """Each setting's planner flags (`FEATURES`) name the features its run turns on (`SETTINGS`), so the predicted
    column is the prediction for the measured run."""
    import long_context_gpu

    assert long_context_gpu.SETTINGS.keys() == long_context_gpu.FEATURES.keys()
    for name, (fields, checkpointing, cpu_offload) in long_context_gpu.SETTINGS.items():
        flags = long_context_gpu.FEATURES[name]
        assert flags.get("chunked_loss", True) == fields.get("chunked_loss", True), name
        assert flags.get("tiled_mlp", False) == fields.get("tiled_mlp", False), name
        assert flags.get("fused_norms", False) == fields.get("fused_rms_norm", False), name
        offload = isinstance(checkpointing, dict) and checkpointing.get("offload", False)
        assert flags.get("offload", False) == offload, name
        assert flags.get("offload_params", False) == cpu_offload, name
