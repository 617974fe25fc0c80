"""The planner's memory model of the long-sequence features, its allocator term, --max-seq, and its checks: the
measured peak of a step on CPU (every benchmark layout, and FSDP2 with each feature) and torchtitan's published peaks
of FSDP2 Llama 3.1 8B runs on H100s (docs/planner.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from planner_check import PEAK_CASES, peak_case_name  # noqa: E402
from planner_published import MEMORY_ROWS, memory_table  # noqa: E402
from ndparallel.cli import main  # noqa: E402
from ndparallel.planner import Layout, Recipe, get_hardware, load_model  # noqa: E402
from ndparallel.planner.longest import QUANTUM, _fits, longest_for  # noqa: E402
from ndparallel.planner.footprint import estimate  # noqa: E402
from ndparallel.planner.search import Request  # noqa: E402
from ndparallel.parallel.memory.rms_norm import backward_bytes as norm_backward_bytes  # noqa: E402
from ndparallel.planner.recipe import loss_chunk_rows  # noqa: E402

GiB = 2**30


def _llama(seq: int, **features) -> dict[str, float]:
    memory = estimate(load_model("llama-3.1-8b"), Layout(dp_shard=8), Recipe(seq, 1, 1, "bf16", True, **features), 0.19)
    return {name: term.bytes for name, term in memory.terms.items()}


def test_each_feature_changes_the_terms_it_should():
    plain, chunked = _llama(32768, chunked_loss=False), _llama(32768)
    n, v, h = 32768, 128256, 4096
    assert plain["activations"] - chunked["activations"] == n * v * 4  # no log-softmax saved
    assert plain["loss_buffers"] == 8 * n * v  # logits + fp32 copy, or their gradients
    rows = loss_chunk_rows(n, v)
    assert chunked["loss_buffers"] == rows * v * (2 + 4) + v * h * (4 + 2) + n * h * 2
    states = plain["params"] + plain["grads"] + plain["optimizer"]
    assert plain["peak"] - plain["allocated"] == pytest.approx(0.19 * (plain["allocated"] - states))
    tiled, offload = _llama(32768, tiled_mlp=True), _llama(32768, tiled_mlp=True, offload=True)
    mlp = 4 * 14336 * 2  # gate, up, activation, product per token, bf16
    # the rebuilt layer's MLP intermediate goes; its backward's largest buffer is now an RMSNorm's (20 B per element,
    # more than one 4096-token tile's intermediate, 4096 x mlp)
    assert chunked["recompute"] - tiled["recompute"] == n * mlp and n * h * 20 > 4096 * mlp
    assert tiled["activations"] - offload["activations"] == (32 - 2) * n * h * 2  # 2 of 32 layer inputs stay
    assert offload["host_offload"] == 32 * n * h * 2
    assert plain["peak"] > chunked["peak"] > tiled["peak"] > offload["peak"]
    fused = _llama(32768, fused_norms=True)  # no norm keeps an fp32 copy of its input: under checkpointing the
    assert chunked["activations"] - fused["activations"] == n * h * 4  # final norm's, and the rebuilt layer's two
    # the rebuilt layer's two, and its backward's largest buffer: the model's own norm's (20 B per element) before; the
    # fused norm's runs over 13 chunks of 2,521 tokens (`rms_norm.backward_bytes`: the bf16 input gradient and one
    # chunk's 12 h + 4 B a token), less than the attention's gradients of o, q, k, v, which are the largest then
    attention = n * (4096 + 4096 + 1024 + 1024) * 2
    assert norm_backward_bytes(n, h, 2) == n * h * 2 + 2521 * (12 * h + 4) < attention
    assert chunked["recompute"] - fused["recompute"] == 2 * n * h * 4 + n * h * 20 - attention
    with pytest.raises(ValueError, match="offloading .* needs activation checkpointing"):
        Recipe(1024, 1, offload=True)


def test_the_fused_norm_term_is_what_the_library_keeps():
    """The planner's activations with and without fused RMSNorms differ by what the library's fused norms keep less
    (counted exactly on a bf16 Llama: the storages autograd saves, tests/parallel/memory/test_rms_norm.py's way)."""
    import torch

    from ndparallel.parallel.memory.rms_norm import apply_fused_rms_norm
    from ndparallel.planner.model import spec_from_config
    from ndparallel.test_utils.memory import training_step_kept_bytes
    from tiny_models import build_model

    torch.manual_seed(0)
    model = build_model("llama", hidden_size=64).to(torch.bfloat16)
    tokens = 256
    ids = torch.randint(0, 96, (1, tokens))
    plain = training_step_kept_bytes(model, ids)
    apply_fused_rms_norm(model)
    measured = plain - training_step_kept_bytes(model, ids)
    spec = spec_from_config(model.config.to_dict(), "tiny")
    predicted = [estimate(spec, Layout(), Recipe(tokens, 1, 1, "bf16", False, fused_norms=fused), 0.0
                          ).terms["activations"].bytes for fused in (False, True)]
    assert measured == predicted[0] - predicted[1] == (2 * model.config.num_hidden_layers + 1) * tokens * 64 * 4


@pytest.mark.parametrize("row", MEMORY_ROWS, ids=lambda r: r[0])
def test_published_torchtitan_peaks_within_three_percent(row):
    (_, peak, _, error), = [r for r in memory_table() if r[0] is row]
    assert abs(error) <= 0.03, f"{row[0]}: predicted {peak:.1f} GiB, published {row[-1]} GiB ({error:+.1%})"


def test_max_seq_finds_the_longest_sequence_that_fits(capsys):
    request = Request(load_model("llama-3.1-8b"), get_hardware("h100"), 1, 8, 1024, 1024)
    for layout in (Layout(dp_shard=8), Layout(cp=8), Layout(sp=4, tp=2)):
        for name in ("all", "plain"):
            tokens, memory = longest_for(layout, name, request)
            step = QUANTUM * 2 * layout.cp * layout.sp
            assert tokens % step == 0 and memory.peak <= request.budget_bytes
            assert _fits(layout, tokens + step, name, request) is None  # one step longer does not fit
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--max-seq", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["tokens"]["all"] >= 4 * max(r["tokens"]["plain"] for r in rows)
    fsdp = next(r for r in rows if r["name"] == "dp_shard=8")
    assert fsdp["tokens"]["all"] > 4 * fsdp["tokens"]["plain"] > 0


def test_plan_tries_the_features_and_says_which_it_needs(capsys):
    # The activation features alone (FSDP2's CPU offload, which lets AC off fit here, is test_planner_offload.py's)
    args = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--seq-len", "131072", "--global-batch-tokens",
            "1048576", "--top", "3", "--offload-params", "off", "--fused-rms-norm", "off"]
    assert main(args + ["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert all(r["chunked_loss"] for r in rows) and rows[0]["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 8,
                                                                           "cp": 1, "sp": 1, "tp": 1}
    assert rows[0]["offload"] and rows[0]["activation_checkpointing"]  # FSDP 8 at 131k tokens fits only so
    assert main(args + ["--chunked-loss", "off", "--tiled-mlp", "off", "--offload", "off", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["rows"]
    assert plain[0]["name"] != "dp_shard=8" and not any(r["chunked_loss"] or r["offload"] for r in plain)
    assert main(args) == 0
    assert "activation_checkpointing={\"every\": 1, \"offload\": True}" in capsys.readouterr().out
    # With the fused RMSNorm allowed (auto), sequence parallelism over 8 fits without checkpointing, and is faster
    assert main(args[:-1] + ["auto", "--json"]) == 0
    fused = json.loads(capsys.readouterr().out)["rows"][0]
    assert fused["fused_rms_norm"] and not fused["activation_checkpointing"] and fused["name"] == "sp=8"
    assert main(args[:-1] + ["auto"]) == 0
    assert "MemoryKwargs(tiled_mlp=True, fused_rms_norm=True)" in capsys.readouterr().out


def test_estimate_memory_with_the_features(capsys):
    base = ["estimate-memory", "--model", "llama-3.1-8b", "--seq-len", "65536", "--dp-shard-size", "8",
            "--activation-checkpointing", "on", "--gpu", "h100", "--json"]
    peaks = {}
    for name, extra in (("plain", ["--chunked-loss", "off"]), ("chunked", []), ("all", ["--tiled-mlp", "--offload"])):
        assert main(base + extra) == 0
        peaks[name] = json.loads(capsys.readouterr().out)["memory_bytes"]
    assert peaks["plain"]["peak"] > peaks["chunked"]["peak"] > peaks["all"]["peak"]
    assert "host_offload" in peaks["all"] and peaks["all"]["fragmentation"] > 0


# Of benchmarks/planner_check.py's PEAK_CASES (all of them: `python benchmarks/planner_check.py --peak`, docs/planner.md),
# the ones that cover each term once, to keep the suite's time down: TP's vocabulary-split loss, CP x SP's shards,
# Hugging Face's loss, the chunked loss under checkpointing with tiled MLPs and offloading (fp32), and with tiled MLPs
# in bf16 with accumulation.
TESTED_PEAK_CASES = [c for c in PEAK_CASES if peak_case_name(c) in (
    "tp fp32 x1 C", "cp_sp fp32 x1 C", "fsdp2 fp32 x1 -", "fsdp2 fp32 x1 AC CTO", "fsdp2 bf16 x2 AC CT")]


def test_the_tested_peak_cases_exist():
    assert len(TESTED_PEAK_CASES) == 5


@pytest.mark.slow
@pytest.mark.parametrize("case", TESTED_PEAK_CASES, ids=peak_case_name)
def test_predicted_peak_against_the_librarys_measured_peak_on_cpu(case):
    """One step's peak resident memory per rank above the state before it, against the prediction (no allocator
    fragmentation on the CPU; offloading moves nothing there). The prediction may be high by up to 25% (it counts
    every layer's rebuilt activations and two layers' FSDP2 buffers at once), never low by more than 5%."""
    measured, predicted = _measure_peak_in_a_fresh_process(case)
    assert 0.75 <= measured / predicted <= 1.05, (peak_case_name(case), measured, predicted)


def _measure_peak_in_a_fresh_process(case: tuple) -> tuple[int, float]:
    """`measure_peak` with ranks forked from a new interpreter: ranks forked from this long-lived one inherit its heap,
    whose free pages serve (or, fragmented, inflate) the step's small blocks, so the resident set they measure
    depends on the tests before (the same case read 0.60 of the prediction from a parent with a used heap, 0.96 from
    a fresh one)."""
    import subprocess

    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import torch; torch.set_num_threads(1); "
            "from planner_check import PEAK_CASES, measure_peak, peak_case_name; "
            "case = next(c for c in PEAK_CASES if peak_case_name(c) == sys.argv[2]); "
            "print(json.dumps(measure_peak(case)))")
    proc = subprocess.run([sys.executable, "-c", code, str(BENCH), peak_case_name(case)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    measured, predicted = json.loads(proc.stdout.strip().splitlines()[-1])
    return measured, predicted


def test_expandable_segments_is_printed_in_the_recipe_and_its_reserve_left_unmeasured(capsys):
    """--expandable-segments puts PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the recipe and says the reserve
    under it is unmeasured; nothing was measured on a GPU to model it by, so every predicted figure is unchanged."""
    seq = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--gpus-per-node", "1", "--max-seq"]
    ranked = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--seq-len", "8192", "--global-batch-tokens",
              "65536", "--top", "2"]
    for args in (seq, ranked):
        assert main(args + ["--json"]) == 0
        plain = capsys.readouterr().out
        assert main(args + ["--json", "--expandable-segments"]) == 0
        assert capsys.readouterr().out == plain
        assert main(args + ["--expandable-segments"]) == 0
        text = capsys.readouterr().out
        assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in text and "unmeasured" in text
        assert main(args) == 0
        assert "unmeasured" not in capsys.readouterr().out
