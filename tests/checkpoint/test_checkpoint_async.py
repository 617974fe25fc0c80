"""``save_state(async_save=True)``: the state is copied to host memory and written by a background thread while
training goes on, with the same guarantees as a save that blocks: the checkpoint holds the state of the moment of
the call, resumes exactly, and a process killed during the background write leaves the previous checkpoint the
newest complete one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import checkpoint_train
from harness import run_ranks

from ndparallel.checkpoint import latest_checkpoint
from ndparallel.checkpoint.storage import METADATA_FILE

SCRIPT = Path(checkpoint_train.__file__)


def test_an_async_save_holds_the_state_of_its_moment_and_resumes_exactly(tmp_path):
    """Under FSDP2 on 2 ranks, saved in the background at steps 1 and 2 (the second save's state dicts made without
    torch's naming pass, `checkpoint.state_dicts`) while steps 3-4 change the parameters: resumed from step 2, the
    run continues the uninterrupted run's losses."""
    flags = ["--dp-shard-size", "2", "--steps", "5"]
    run = run_ranks(checkpoint_train.main, 2, [*flags, "--save-dir", str(tmp_path), "--save-at", "1", "2",
                                               "--async-save"])[0]
    saved = tmp_path / "step_2"
    assert run["saved"] == [str(tmp_path / "step_1"), str(saved)] and (saved / METADATA_FILE).is_file()
    assert json.loads((saved / METADATA_FILE).read_text())["step"] == 2
    resumed = run_ranks(checkpoint_train.main, 2, [*flags, "--load", str(saved)])[0]
    assert resumed["losses"] == {k: v for k, v in run["losses"].items() if k > 2}


def test_kill_9_during_an_async_save_keeps_the_previous_checkpoint(tmp_path):
    """The second save's writer pauses with every file written but not committed while training goes on to step 4
    (so the save did not stop it); then SIGKILL: the first checkpoint is the newest complete one and resumes."""
    project, marker, progress = tmp_path / "project", tmp_path / "paused", tmp_path / "step"
    cmd = [sys.executable, str(SCRIPT), "--no-fsdp-plugin", "--steps", "4", "--project-dir", str(project),
           "--save-at", "1", "2", "--async-save", "--pause-in-save", "2", "--pause-marker", str(marker),
           "--progress-file", str(progress)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NDPARALLEL_", "RANK", "WORLD_SIZE", "MASTER_"))}
    proc = subprocess.Popen(cmd, env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not (marker.exists() and progress.exists() and progress.read_text() == "4"):
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.time() < deadline, "the background save never paused, or training did not go on"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    checkpoints = project / "checkpoints"
    partial = checkpoints / ".checkpoint_1.partial"
    assert (partial / "optimizer_0").is_dir() and not (partial / METADATA_FILE).exists()
    assert latest_checkpoint(project) == checkpoints / "checkpoint_0"
    resumed = run_ranks(checkpoint_train.main, 1, ["--no-fsdp-plugin", "--steps", "4", "--project-dir", str(project),
                                                   "--load", "latest"])[0]
    uninterrupted = run_ranks(checkpoint_train.main, 1, ["--no-fsdp-plugin", "--steps", "4"])[0]
    assert resumed["loaded"] == str(checkpoints / "checkpoint_0")
    assert resumed["losses"] == {k: v for k, v in uninterrupted["losses"].items() if k > 1}


def _async_save_on_a_full_disk(project: str) -> dict:
    """A background save whose model write fails on rank 1 as on a full disk: the call returns, training goes on, the
    error is printed at once and raised by `wait_for_checkpoint` on both ranks; the next save works."""
    import errno
    import io

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    class FullDisk(FileSystemWriter):
        def write_data(self, plan, planner):
            if dist.get_rank() == 1:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write_data(plan, planner)

    args = checkpoint_train.parse(["--dp-shard-size", "2", "--project-dir", project])
    accelerator, model, optimizer, loader, *_ = checkpoint_train.build(args)
    accelerator.save_state()
    writer, stderr = torch.distributed.checkpoint.FileSystemWriter, sys.stderr
    torch.distributed.checkpoint.FileSystemWriter, sys.stderr = FullDisk, io.StringIO()
    out: dict = {}
    try:
        out["returned"] = accelerator.save_state(async_save=True)
        batch = next(iter(loader))
        accelerator.backward(model(**batch).loss)  # training goes on meanwhile
        optimizer.step()
        try:
            accelerator.wait_for_checkpoint()
        except Exception as exc:  # noqa: BLE001 -- what is raised is the test's subject
            out["error"] = (type(exc).__name__, str(exc))
        out["printed"] = sys.stderr.getvalue()
    finally:
        torch.distributed.checkpoint.FileSystemWriter, sys.stderr = writer, stderr
    out["again"] = accelerator.save_state(async_save=True)
    out["waited"] = accelerator.wait_for_checkpoint()
    out["after"] = accelerator.wait_for_checkpoint()  # nothing under way any more
    accelerator.end_training()
    return out


def test_a_failed_async_save_is_said_at_once_and_raised_on_every_rank(tmp_path):
    results = run_ranks(_async_save_on_a_full_disk, 2, str(tmp_path))
    checkpoints = tmp_path / "checkpoints"
    for rank, out in enumerate(results):
        assert out["returned"] == str(checkpoints / "checkpoint_1")
        kind, message = out["error"]
        assert kind == "CheckpointError", out
        assert message.startswith(f"no space left on the device while writing model 0 under {checkpoints} (")
        assert out["printed"].startswith(f"ndparallel: rank {rank}: the background save_state of "
                                         f"{checkpoints / 'checkpoint_1'} failed: no space left on the device")
        assert out["again"] == out["waited"] == str(checkpoints / "checkpoint_1") and out["after"] is None
    assert sorted(os.listdir(checkpoints)) == ["checkpoint_0", "checkpoint_1"]  # no partial files left


_ENDS_DURING_A_SAVE = """
import sys, time
import torch
from ndparallel import Accelerator
from ndparallel.checkpoint import storage

accelerator = Accelerator()
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.AdamW(model.parameters())
model, optimizer = accelerator.prepare(model, optimizer)
accelerator.backward(model(torch.randn(3, 4)).sum())
optimizer.step()
accelerator.save_state(sys.argv[1] + "/first", async_save=True)
accelerator.wait_for_checkpoint()  # the writer thread now waits for work: it must not keep the process alive
checksum_files = storage.checksum_files

def slow(*args, **kwargs):
    time.sleep(3)
    return checksum_files(*args, **kwargs)

storage.checksum_files = slow
accelerator.save_state(sys.argv[1] + "/second", async_save=True)
print("returned", time.time(), flush=True)
"""


def test_a_script_that_ends_during_a_background_save_ends_once_it_is_committed(tmp_path):
    """No wait, no end_training: the interpreter's exit waits for the write under way (the checkpoint is complete),
    and the idle writer thread of the earlier save does not keep it alive."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NDPARALLEL_", "RANK", "WORLD_SIZE", "MASTER_"))}
    proc = subprocess.run([sys.executable, "-c", _ENDS_DURING_A_SAVE, str(tmp_path)], env=env, capture_output=True,
                          check=False, text=True, timeout=120)
    ended = time.time()
    assert proc.returncode == 0, proc.stderr[-3000:]
    returned = float(proc.stdout.split("returned ")[1])
    assert ended - returned >= 3  # it waited for the slow write
    for name in ("first", "second"):
        assert json.loads((tmp_path / name / METADATA_FILE).read_text())["complete"] is True
