"""A checkpoint is one directory that the ranks of every node write into: where a node does not see the directory
rank 0 made -- the same path on a disk of its own --, `save_state` says so on every rank, naming the ranks and hosts,
before anything is written, and leaves nothing behind. Rank 1 plays a node with its own disk: a private mount
namespace with an empty tmpfs over the directory (where this machine lets a test make one)."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.checkpoint  # noqa: F401 - imported once here, not again in every forked rank

import checkpoint_train
from harness import outcomes, run_ranks

CLONE_NEWUSER, CLONE_NEWNS, MS_REC, MS_PRIVATE = 0x10000000, 0x00020000, 0x4000, 1 << 18


def _own_disk(directory: Path) -> None:
    """From now on this process alone sees an empty tmpfs at `directory` (what `unshare --user --map-root-user
    --mount` and `mount -t tmpfs` do; the mount does not propagate back)."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
    Path("/proc/self/gid_map").write_text(f"0 {gid} 1")
    for args in ((b"none", b"/", None, MS_REC | MS_PRIVATE, None),
                 (b"tmpfs", str(directory).encode(), b"tmpfs", 0, b"size=4m")):
        if libc.mount(*args) != 0:
            raise OSError(ctypes.get_errno(), "mount")


def _save(base: str) -> dict:
    if os.environ["RANK"] == "1":
        _own_disk(Path(base))
    accelerator, *_ = checkpoint_train.build(checkpoint_train.parse(["--dp-shard-size", "2"]))
    out = outcomes({"save": lambda: accelerator.save_state(os.path.join(base, "ckpt"))})
    out["listing"] = sorted(os.listdir(base))
    accelerator.end_training()
    return out


@pytest.mark.skipif(sys.platform != "linux", reason="mount namespaces are Linux's")
def test_a_checkpoint_directory_that_is_not_shared_is_refused_on_every_rank(tmp_path):
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            f"mount -t tmpfs -o size=64k tmpfs {tmp_path}"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs unprivileged user namespaces, or root)")
    results = run_ranks(_save, 2, str(tmp_path))
    pattern = (rf"cannot save to {re.escape(str(tmp_path))}: rank\(s\) \[1\] \(on .+\) do not see the directory that "
               r"rank 0 \(on .+\) just made there\. The ranks of every node write one checkpoint together: save to a "
               r"filesystem that every node shares, under the same path")
    for rank, out in enumerate(results):
        kind, message = out["save"]
        assert kind == "CheckpointError" and re.search(pattern, message), (rank, message)
        assert out["listing"] == [], (rank, out["listing"])  # nothing written, no staging directory left
    assert os.listdir(tmp_path) == []
