"""The example Trainer and TRL scripts, unmodified, under ``ndparallel launch`` (`examples/trainer_clm.py`,
`examples/sft.py`), each against ``python`` of the same script: the losses it logged, within 1e-5 (test_trainer.py's
tolerance).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_trainer import TOL

ROOT = Path(__file__).resolve().parents[2]


def launched(tmp_path: Path, name: str, launcher: list[str], script: str, *flags: str,
             use_cpu: bool = True) -> tuple[list[dict], str]:
    """Run an example script as a user would; return the Trainer's log history (trainer_state.json) and what the run
    printed."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NDPARALLEL_", "RANK", "WORLD_SIZE", "MASTER_", "ACCELERATE_"))}
    out = tmp_path / name
    proc = subprocess.run([*launcher, str(ROOT / "examples" / script), "--output_dir", str(out),
                           *(["--use_cpu"] if use_cpu else []), "--report_to", "none", "--logging_steps", "1",
                           "--disable_tqdm", "true", *flags],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "trainer_state.json").read_text())["log_history"], proc.stdout


def launched_history(tmp_path: Path, name: str, launcher: list[str], script: str, *flags: str) -> list[dict]:
    return launched(tmp_path, name, launcher, script, *flags)[0]


def losses_of(history: list[dict]) -> list[float]:
    return [entry["loss"] for entry in history if "loss" in entry]


LAUNCH = [sys.executable, "-m", "ndparallel.cli", "launch", "--nproc-per-node", "2"]


def test_an_unmodified_trainer_script_under_ndparallel_launch(tmp_path):
    """examples/trainer_clm.py, launched with --cp-size 2 and no change to the script, against `python` of it."""
    flags = ["--max_steps", "4", "--per_device_train_batch_size", "4"]
    one = launched_history(tmp_path, "one", [sys.executable], "trainer_clm.py", *flags)
    cp = launched_history(tmp_path, "cp", [*LAUNCH, "--cp-size", "2"], "trainer_clm.py", *flags)
    assert len(losses_of(cp)) == len(losses_of(one)) == 4
    assert max(abs(a - b) for a, b in zip(losses_of(cp), losses_of(one))) < TOL
    assert abs(cp[-1]["eval_loss"] - one[-1]["eval_loss"]) < TOL


@pytest.mark.slow
def test_a_cpu_launch_without_use_cpu_logs_once_from_the_main_process(tmp_path):
    """`ndparallel launch --cpu` of examples/trainer_clm.py without --use_cpu, with the Trainer's --fsdp: the Trainer
    knows it runs distributed (the launcher exports ACCELERATE_USE_CPU, as Accelerate's does), so --fsdp is accepted
    and only the main process logs -- each step's loss once, the one process's loss on the same global batch."""
    flags = ["--max_steps", "3", "--per_device_train_batch_size", "4"]
    one = launched_history(tmp_path, "one", [sys.executable], "trainer_clm.py", *flags)
    history, printed = launched(tmp_path, "fsdp", [*LAUNCH, "--cpu", "--dp-shard-size", "2"], "trainer_clm.py",
                                "--max_steps", "3", "--per_device_train_batch_size", "2", "--fsdp", "full_shard",
                                use_cpu=False)
    logged = [line for line in printed.splitlines() if line.startswith("{'loss'")]
    assert len(logged) == len(losses_of(history)) == len(losses_of(one)) == 3, printed
    assert max(abs(a - b) for a, b in zip(losses_of(history), losses_of(one))) < TOL
    assert [entry["epoch"] for entry in history if "loss" in entry] == [entry["epoch"] for entry in one
                                                                         if "loss" in entry]


def test_an_unmodified_sft_script_under_ndparallel_launch(tmp_path):
    """examples/sft.py with --packing, launched with --sp-size 2, against `python` of it."""
    flags = ["--max_steps", "3", "--per_device_train_batch_size", "2", "--bf16", "false", "--packing",
             "--max_length", "64"]
    one = launched_history(tmp_path, "one", [sys.executable], "sft.py", *flags)
    sp = launched_history(tmp_path, "sp", [*LAUNCH, "--sp-size", "2"], "sft.py", *flags)
    assert len(losses_of(sp)) == len(losses_of(one)) == 3
    assert max(abs(a - b) for a, b in zip(losses_of(sp), losses_of(one))) < TOL
