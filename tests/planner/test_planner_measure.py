"""``ndparallel plan --measure``: the top predicted layouts run on this machine through ``ndparallel launch``; their
measured tokens/s and peak memory (written by each rank at ``end_training``) are printed beside the predictions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from test_cli import run_cli

ROOT = Path(__file__).resolve().parents[2]
PLAN = ["plan", "--gpu", "h100", "--nodes", "1", "--gpus-per-node", "2", "--seq-len", "128",
        "--global-batch-tokens", "1024", "--mixed-precision", "fp32"]


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> str:
    sys.path.insert(0, str(ROOT / "examples"))
    import nd_parallel

    path = tmp_path_factory.mktemp("config")
    nd_parallel.build_model().config.save_pretrained(path)
    return str(path)


@pytest.mark.slow
def test_the_top_layouts_run_and_are_ranked_by_what_they_measure(tiny_config):
    done = run_cli(*PLAN, "--model", tiny_config, "--json", "--measure-top", "2", "--measure",
                   str(ROOT / "examples" / "nd_parallel.py"), "--steps", "4", "--log-every", "2",
                   timeout=600)  # two 2-rank launches: minutes when the machine is busy
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    measured = out["measured"]
    assert len(measured) == 2 and all("error" not in m for m in measured), measured
    predicted = [row["name"] for row in out["rows"][:2]]
    assert sorted(m["layout"] for m in measured) == sorted(predicted)  # the two best predicted layouts ran
    assert all(m["tokens_per_s_per_gpu"] > 0 and m["peak_memory_bytes"] > 2**20 for m in measured)
    assert all(m["steps"] == 2 for m in measured)  # 4 steps, 2 of them warm-up
    assert "measuring 1/2" in done.stderr


@pytest.mark.slow
def test_a_script_without_a_step_timer_is_reported_not_hidden(tiny_config, tmp_path):
    script = tmp_path / "untimed.py"
    script.write_text("from ndparallel import Accelerator\nAccelerator().end_training()\n")
    done = run_cli(*PLAN, "--model", tiny_config, "--measure-top", "1", "--measure", str(script))
    assert done.returncode == 2
    assert "failed: the script timed no steps" in done.stdout and "no layout could be measured" in done.stderr


@pytest.mark.slow
def test_measure_runs_on_one_node_only(tiny_config):
    done = run_cli(*[a if a != "1" else "2" for a in PLAN[:5]], *PLAN[5:], "--model", tiny_config, "--measure",
                   "train.py")
    assert done.returncode == 2 and "--measure runs the layouts on this machine: use --nodes 1" in done.stderr
