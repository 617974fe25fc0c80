"""The Accelerate-style script started by `ndparallel launch` (real torchrun processes) matches the
single-process reference, exactly as the forked runs of test_parity.py do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reference import reference_run

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "accelerate_style.py"


@pytest.mark.slow
def test_launch_hsdp_matches_single_process(tmp_path):
    out = tmp_path / "losses.json"
    cmd = [sys.executable, "-m", "ndparallel.cli", "launch", "--nproc-per-node", "4", "--dp-replicate-size", "2",
           "--dp-shard-size", "2", str(SCRIPT), "--micro-batch", "2", "--json-out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 4
    ref = reference_run("llama", global_batch=8)
    diff = max(abs(a - b) for a, b in zip(result["losses"], ref["losses"]))
    assert len(result["losses"]) == 6 and diff <= 1e-5, f"losses differ by {diff:.2e}"
