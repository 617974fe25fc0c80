"""The main job, examples/nd_parallel.py: it trains (the loss falls) and reports what the README says."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from harness import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import nd_parallel  # noqa: E402


def test_corpus_tokenizes_into_blocks():
    dataset = nd_parallel.build_dataset(seq_len=128)
    assert len(dataset) > 100
    sample = dataset[0]
    assert sample["input_ids"].shape == (128,) and (sample["labels"] == sample["input_ids"]).all()


@pytest.mark.slow
@pytest.mark.parametrize("world,flags", [(1, []), (2, ["--dp-shard-size", "2"]),
                                         (4, ["--dp-replicate-size", "2", "--dp-shard-size", "2"]),
                                         (2, ["--cp-size", "2", "--cp-strategy", "ring"]),
                                         (4, ["--cp-size", "2", "--sp-size", "2"])],
                         ids=["1rank", "fsdp2", "hsdp2x2", "cp2", "cp2_sp2"])
def test_example_trains_and_reports_every_rank(world, flags):
    argv = [*flags, "--steps", "8", "--seq-len", "64", "--log-every", "4"]
    results = run_ranks(nd_parallel.main, world, argv)
    summary = results[0]
    losses = summary["losses"]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.3  # a byte-level LM learns quickly from ~ln(259)
    assert [entry["rank"] for entry in summary["peak_memory"]] == list(range(world))
    assert all(entry["bytes"] > 0 for entry in summary["peak_memory"])
    assert summary["tokens_per_s_overall"] > 0
    # The step timer's medians after warm-up: 6 of the 8 steps, each of batch x seq x data-parallel ranks tokens.
    metrics = summary["step_metrics"]
    assert metrics["steps"] == 6 and metrics["step_time_s"] > 0
    data_ranks = world // math.prod(int(flags[i + 1]) for i, f in enumerate(flags) if f in ("--cp-size", "--sp-size"))
    assert metrics["tokens_per_s"] * metrics["step_time_s"] == pytest.approx(
        nd_parallel.parse_args(argv).batch_size * 64 * data_ranks)
    assert 0 < metrics["mfu"] < 1
    # every rank logged the same (reduced) losses
    assert all(r["losses"] == losses for r in results)


# ---- examples/accelerate_api.py: Accelerate's example, ported --------------------------------------------------------
import accelerate_api  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("world,flags", [(2, ["--dp-shard-size", "2"]), (2, ["--cp-size", "2"]),
                                         (4, ["--dp-shard-size", "2", "--tp-size", "2"])],
                         ids=["fsdp2", "cp2", "fsdp2_tp2"])
def test_accelerate_style_example_trains_saves_and_logs(world, flags, tmp_path):
    """Accelerate's API surface end to end: a bf16-loaded pretrained model trains (fp32 master weights), checkpoints
    are written, the JSON-lines tracker logs every step, and the final save_pretrained directory loads in plain
    transformers with the trained weights."""
    import json

    from transformers import AutoModelForCausalLM

    argv = [*flags, "--num-steps", "6", "--checkpoint-frequency", "2", "--save-dir", str(tmp_path)]
    summary = run_ranks(accelerate_api.main, world, argv)[0]
    assert len(summary["losses"]) == 6 and all(math.isfinite(x) for x in summary["losses"])
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    logged = [json.loads(line) for line in (tmp_path / "nd_parallel_training" / "metrics.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in logged] == list(range(6))
    assert [entry["values"]["loss"] for entry in logged] == pytest.approx(summary["losses"])
    start = AutoModelForCausalLM.from_pretrained(tmp_path / "pretrained").state_dict()
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "final").state_dict()
    assert start.keys() == final.keys()
    changed = sum(int((final[k] != start[k]).sum()) for k in start) / sum(v.numel() for v in start.values())
    assert changed > 0.5, f"only {changed:.1%} of the weights changed"
