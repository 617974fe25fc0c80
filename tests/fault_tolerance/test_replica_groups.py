"""Fault-tolerant replica groups on torchft (`ndparallel.fault_tolerance`, ``ndparallel launch --fault-tolerant``).

The launched runs: 2 replica groups x 2 FSDP2 shards (4 ranks) of tests/scripts/fault_tolerant_train.py, one with rank
1 of group 1 SIGKILLed in the middle of a step. What is checked is what the run did, not when: group 0 went on
stepping alone (steps committed with one participant) and no step of it waited longer than the quorum timeout; group
1 was restarted, took the live state (a step where it healed without contributing) and contributed again; at the end
every rank holds bit-identical parameters across the groups; and a one-process replay of the participation log (each
committed step's update from the gradients of the groups that took part, on their batches) gives the losses the
groups logged, to 1e-5, and the final parameters.
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
from torch import nn

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
SCRIPT = SCRIPTS / "fault_tolerant_train.py"
QUORUM_TIMEOUT = 30.0
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs torchft (the test extra)")


def _train_module():
    spec = importlib.util.spec_from_file_location("fault_tolerant_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch(out: Path, *script_args: str, replicas: int = 2, shard: int = 2) -> subprocess.CompletedProcess:
    """`replicas` fault-tolerant groups of `shard` FSDP2 ranks; `replicas=1`: one plain job of `shard` ranks."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NDPARALLEL_", "RANK", "WORLD_SIZE", "MASTER_"))}
    mode = (["--fault-tolerant", "--quorum-timeout", str(QUORUM_TIMEOUT), "--ft-timeout", "20",
             "--dp-replicate-size", str(replicas)] if replicas > 1 else [])
    command = [sys.executable, "-m", "ndparallel", "launch", "--cpu", *mode, "--dp-shard-size", str(shard),
               "--nproc-per-node", str(replicas * shard), str(SCRIPT), str(out), *script_args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    return done


def records(out: Path) -> dict[int, list[dict]]:
    return {int(p.stem.split("_")[1]): [json.loads(line) for line in p.read_text().splitlines()]
            for p in sorted((out / "log").glob("replica_*.jsonl"))}


def replay(logs: dict[int, list[dict]], steps: int, replicas: int, shard: int) -> tuple[dict, nn.Module]:
    """One process: each committed step, the gradients of the participating groups' batches averaged, one AdamW
    update. Returns {(replica, step): the loss that group's first rank saw} and the model."""
    train = _train_module()
    per_rank = train.SAMPLES_PER_RANK
    global_batch = per_rank * shard * replicas
    data = train.dataset(steps, global_batch)
    model = train.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    committed: dict[int, dict[int, dict]] = {}
    for replica, recs in logs.items():
        for r in recs:
            if r["committed"] and r["participating"]:
                committed.setdefault(r["step"], {})[replica] = r
    losses = {}
    for step in sorted(committed):
        optimizer.zero_grad()
        groups = committed[step]
        for replica, r in groups.items():
            end = r["position"] if r["epoch"] == 0 else len(data)  # where the loader stood after the step's batch
            start = end - global_batch + replica * shard * per_rank
            x, y = data[start:start + shard * per_rank]
            loss = nn.functional.mse_loss(model(x), y)
            (loss / len(groups)).backward()
            with torch.no_grad():
                losses[(replica, step)] = nn.functional.mse_loss(model(x[:per_rank]), y[:per_rank]).item()
        optimizer.step()
    return losses, model


def check_against_replay(out: Path, steps: int, replicas: int = 2, shard: int = 2) -> dict[int, list[dict]]:
    logs = records(out)
    losses, model = replay(logs, steps, replicas, shard)
    checked = 0
    for replica, recs in logs.items():
        for r in recs:
            if r["committed"] and r["participating"]:
                assert r["loss"] == pytest.approx(losses[(replica, r["step"])], rel=1e-5, abs=1e-7), (replica, r)
                checked += 1
    assert checked >= steps  # every committed step of every group that took part
    shards = [[torch.load(out / f"params_replica{g}_rank{r}.pt") for r in range(shard)] for g in range(replicas)]
    for g in range(1, replicas):
        for r in range(shard):
            for name, value in shards[0][r].items():
                assert torch.equal(value, shards[g][r][name]), f"replica {g} rank {r} {name} differs from replica 0"
    for name, value in model.named_parameters():
        run = torch.cat([shards[0][r][name] for r in range(shard)]) if shard > 1 else shards[0][0][name]
        torch.testing.assert_close(run, value.detach(), rtol=1e-4, atol=1e-5)
    return logs


@pytest.mark.slow
def test_every_group_takes_part_in_every_step_without_faults_and_one_writes_the_checkpoint(tmp_path):
    # with an evaluation forward between steps, which must not start a step of its own
    launch(tmp_path, "--steps", "6", "--checkpoint-every", "3", "--evaluate-every", "2")
    logs = check_against_replay(tmp_path, 6)
    for recs in logs.values():
        assert [(r["committed"], r["participating"], r["participants"]) for r in recs] == [(True, True, 2)] * 6
    # save_state beside it: one group wrote the checkpoint (at the last step), which a plain job of one group's
    # layout loads to the parameters the groups ended with
    launch(tmp_path, "--steps", "6", "--verify-checkpoint", replicas=1)
    for rank in range(2):
        loaded = torch.load(tmp_path / f"loaded_rank{rank}.pt")
        final = torch.load(tmp_path / f"params_replica0_rank{rank}.pt")
        assert loaded.keys() == final.keys() and all(torch.equal(loaded[k], final[k]) for k in final)


@pytest.mark.slow
def test_a_killed_group_restarts_heals_and_rejoins_while_the_other_keeps_stepping(tmp_path):
    steps, kill = 24, 4
    launch(tmp_path, "--steps", str(steps), "--kill-at", str(kill), "--step-seconds", "0.3")
    logs = check_against_replay(tmp_path, steps)
    healthy, restarted = logs[0], logs[1]
    # group 0 stepped without group 1 (alone, or beside it while it healed), never waiting a quorum timeout;
    # whether the step group 1 died in was dropped depends on when the lighthouse saw it go (a group restarted
    # before the next quorum joins that one)
    assert any(r["committed"] and r["participants"] == 1 for r in healthy), healthy
    assert max(r["seconds"] for r in healthy) < QUORUM_TIMEOUT
    # group 1 came back: one step healing (taking group 0's live state, contributing nothing), then both again
    after = [r for r in restarted if r["step"] >= kill]
    assert after and not after[0]["participating"], after
    assert all(r["participating"] and r["participants"] == 2 for r in after[1:]), after
    assert healthy[-1]["participants"] == 2 and healthy[-1]["step"] == restarted[-1]["step"]
