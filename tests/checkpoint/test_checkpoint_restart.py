"""Fault tolerance: under ``ndparallel launch --max-restarts 1``, a rank that dies (SIGKILL) mid-run is restarted with
the others, and examples/resume.py continues from its newest checkpoint exactly as the run that never failed."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.checkpoint  # noqa: F401 - imported once here, not again in every forked rank

from harness import run_ranks

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "resume.py"
ARGS = ["--steps", "6", "--checkpoint-every", "2", "--seq-len", "64"]


def load_example():
    spec = importlib.util.spec_from_file_location("resume_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a_killed_rank_restarts_and_resumes_from_the_newest_checkpoint(tmp_path):
    example = load_example()
    uninterrupted = run_ranks(example.main, 2, ["--project-dir", str(tmp_path / "a"), *ARGS],
                              env={"NDPARALLEL_DP_SHARD_SIZE": "2"})[0]
    out = tmp_path / "attempt.json"
    cmd = [sys.executable, "-m", "ndparallel.cli", "launch", "--nproc-per-node", "2", "--dp-shard-size", "2",
           "--max-restarts", "1", str(EXAMPLE), "--project-dir", str(tmp_path / "b"), *ARGS, "--crash-at-step", "3",
           "--json-out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:  # hung: stop the launcher and its workers (one process group)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    attempt = json.loads(out.read_text())
    assert attempt["attempt"] == 1  # the second attempt finished the run
    assert attempt["resumed_from"] == str(tmp_path / "b" / "checkpoints" / "checkpoint_0")  # saved after step 2
    expected = {str(k): v for k, v in uninterrupted["losses"].items() if k > 2}
    assert attempt["losses"] == expected, (attempt["losses"], expected)
    # total_limit=2 kept the newest two of the three checkpoints (steps 2, 4, 6).
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]
