"""The Hugging Face Trainer under ``ndparallel launch --fault-tolerant`` (`ndparallel.integrations.trainer_faults`).

Launched runs of tests/scripts/fault_tolerant_trainer.py: 2 replica groups of 1 process (an SGD Trainer on a tiny
Llama, accumulation 2, a warm-up-then-linear LR schedule, 3 updates per epoch, so the runs cross epochs). Without
faults the groups train as the plain ``--dp-replicate-size 2`` job does, also with tensor parallelism inside each group
(``--tp-size 2``: 2 groups x 2 ranks). With group 1 SIGKILLed in a step, what is
checked is what the run did, not when: group 1 was restarted, took the live state and went on at the live global
step, with the learning rate and epoch group 0 had at each step; every step was ended once; both groups end with
bit-identical parameters at max_steps; the checkpoints were written.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fault_tolerant_trainer.py"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs torchft (the test extra)")]


def launch(out: Path, *script_args: str, fault_tolerant: bool = True, tp: int = 1) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NDPARALLEL_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env["NDPARALLEL_FT_LOG"] = str(out / "log")
    mode = ["--fault-tolerant", "--quorum-timeout", "30", "--ft-timeout", "20"] if fault_tolerant else []
    command = [sys.executable, "-m", "ndparallel", "launch", "--cpu", *mode, "--dp-replicate-size", "2",
               "--tp-size", str(tp), "--nproc-per-node", str(2 * tp), str(SCRIPT), str(out), *script_args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]


def final(out: Path, replica: int, rank: int = 0) -> dict:
    return torch.load(out / f"params_replica{replica}_rank{rank}.pt")


def steps_ended(out: Path, replica: int, attempt: int) -> list[dict]:
    return json.loads((out / f"result_replica{replica}_rank0_attempt{attempt}.json").read_text())


def participation(out: Path, replica: int) -> list[dict]:
    return [json.loads(line) for line in (out / "log" / f"replica_{replica}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("tp", [1, 2], ids=["groups_of_1", "groups_of_tp2"])
def test_without_faults_the_groups_train_as_the_plain_replicated_job(tmp_path, tp):
    steps = 8 if tp == 1 else 4
    launch(tmp_path / "ft", "--steps", str(steps), tp=tp)
    launch(tmp_path / "plain", "--steps", str(steps), fault_tolerant=False, tp=tp)
    groups = [final(tmp_path / "ft", replica) for replica in (0, 1)]
    plain = final(tmp_path / "plain", 0)
    assert groups[0]["global_step"] == groups[1]["global_step"] == plain["global_step"] == steps
    for name, value in plain["params"].items():
        assert torch.equal(groups[0]["params"][name], groups[1]["params"][name]), name
        torch.testing.assert_close(groups[0]["params"][name], value, rtol=1e-6, atol=1e-7)
    for replica in (0, 1):  # every step, both groups, committed
        assert [(r["committed"], r["participants"]) for r in participation(tmp_path / "ft", replica)] == \
            [(True, 2)] * steps


def test_a_killed_group_rejoins_at_the_live_step_with_the_live_schedule(tmp_path):
    steps, kill = 16, 3
    launch(tmp_path, "--steps", str(steps), "--kill-at", str(kill), "--step-seconds", "1", "--save-steps", "4")
    healthy = {r["step"]: r for r in steps_ended(tmp_path, 0, 0)}
    assert sorted(healthy) == list(range(1, steps + 1))
    before, after = steps_ended(tmp_path, 1, 0), steps_ended(tmp_path, 1, 1)
    assert [r["step"] for r in before] == list(range(1, kill + 1))  # it died in the step after these
    # the restarted group went on at the live global step, each step once, to the end, with the learning rate and
    # the epoch of the group that did not fail
    first = after[0]["step"]
    assert kill < first and [r["step"] for r in after] == list(range(first, steps + 1)), after
    for r in after:
        assert (r["lr"], r["epoch"]) == (healthy[r["step"]]["lr"], healthy[r["step"]]["epoch"]), (r, healthy)
    # it took the live state in one step, contributing nothing, then both took part again
    restarted = [r for r in participation(tmp_path, 1) if r["step"] >= kill]
    assert not restarted[0]["participating"] and all(r["participants"] == 2 for r in restarted[1:]), restarted
    groups = [final(tmp_path, replica) for replica in (0, 1)]
    assert groups[0]["global_step"] == groups[1]["global_step"] == steps
    for name, value in groups[0]["params"].items():
        assert torch.equal(value, groups[1]["params"][name]), name
    # one group wrote the Trainer's checkpoints (save_total_limit=2 kept the last two)
    kept = sorted(p.name for p in (tmp_path / "trainer").glob("checkpoint-*"))
    assert kept == ["checkpoint-12", "checkpoint-16"], kept
    for name in kept:
        state = json.loads((tmp_path / "trainer" / name / "trainer_state.json").read_text())
        assert state["global_step"] == int(name.split("-")[1])
