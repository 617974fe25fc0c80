"""Saves that must not destroy anything, and resumes that must not give up: `save_state` replaces only a previous
checkpoint, `total_limit` never deletes the checkpoint just written and automatic names never reuse an old run's,
`load_state()` of a project falls back past a damaged newest checkpoint, and a full disk or a refused permission
during a save is reported in those words on every rank with the previous checkpoints left whole (simulated by a
writer that raises, and for real on a small tmpfs where this machine lets a test mount one)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint  # noqa: F401 - imported once here, not again in every forked rank
from transformers import LlamaForCausalLM  # noqa: F401 - likewise

import checkpoint_train
from harness import outcomes, run_ranks

META = "ndparallel_checkpoint.json"
SCRIPTS = Path(checkpoint_train.__file__).parent
ONE = ["--no-fsdp-plugin"]  # one process, no sharding: the cheapest run that writes every kind of file


def _hidden(directory: Path) -> list[str]:
    """Leftovers of a save next to its target: ``.<name>.partial`` / ``.<name>.old``."""
    return sorted(p.name for p in directory.glob(".*"))


# ---- save_state(dir) replaces only a checkpoint --------------------------------------------------------------------
def _save_into(paths: dict[str, str]) -> dict:
    accelerator, *_ = checkpoint_train.build(checkpoint_train.parse(["--dp-shard-size", "2"]))
    started = time.perf_counter()
    out = outcomes({case: (lambda p=path: accelerator.save_state(p)) for case, path in paths.items()})
    out["seconds"] = time.perf_counter() - started
    accelerator.end_training()
    return out


def test_save_state_replaces_only_an_empty_directory_or_a_checkpoint(tmp_path):
    user = tmp_path / "user_dir"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    (tmp_path / "plain_file").write_text("mine too")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "link").symlink_to(user)
    paths = {"user_dir": user, "plain_file": tmp_path / "plain_file", "link": tmp_path / "link",
             "empty_dir": tmp_path / "empty_dir", "new": tmp_path / "ckpt", "again": tmp_path / "ckpt"}
    results = run_ranks(_save_into, 2, {k: str(v) for k, v in paths.items()})
    refused = {
        "user_dir": rf"refusing to write to {user}: {user} exists and is not a complete ndparallel checkpoint "
                    r"\(it holds notes\.txt\); only an empty directory or a complete ndparallel checkpoint is "
                    r"replaced: choose another directory, or move or delete this one yourself",
        "plain_file": r"plain_file exists and is a file, not a directory",
        "link": r"link is a symbolic link",
    }
    for case, pattern in refused.items():
        for rank, out in enumerate(results):
            assert out[case][0] == "CheckpointError" and __import__("re").search(pattern, out[case][1]), \
                (case, rank, out[case])
    for case in ("empty_dir", "new", "again"):  # "again" replaces the checkpoint "new" wrote
        assert results[0][case] == results[1][case] == ("no error", ""), results[0][case]
    assert (user / "notes.txt").read_text() == "mine" and sorted(os.listdir(user)) == ["notes.txt"]
    assert (tmp_path / "plain_file").read_text() == "mine too"
    assert (tmp_path / "empty_dir" / META).is_file() and (tmp_path / "ckpt" / META).is_file()
    assert _hidden(tmp_path) == [], "a refused or finished save left files behind"
    # Timed inside the ranks around the saves only (about 1 s here): a refusal decided on one rank only would leave
    # the other waiting in a collective for the timeout (10 minutes); 30 s leaves a loaded machine a wide margin.
    assert results[0]["seconds"] < 30


# ---- automatic naming and total_limit ------------------------------------------------------------------------------
@pytest.mark.slow
def test_total_limit_keeps_the_new_checkpoint_in_a_folder_an_earlier_run_filled(tmp_path):
    project, other = tmp_path / "project", tmp_path / "other"
    checkpoints = project / "checkpoints"

    def train(*flags: str) -> dict:
        return run_ranks(checkpoint_train.main, 1, [*ONE, "--steps", "2", *flags])[0]

    first = train("--project-dir", str(project), "--save-at", "1", "2")
    assert first["saved"] == [str(checkpoints / "checkpoint_0"), str(checkpoints / "checkpoint_1")]
    train("--project-dir", str(other), "--save-at", "1")  # other/checkpoints/checkpoint_0
    # A run that resumes another project's checkpoint_0 (iteration becomes 1) into this folder, total_limit=1.
    resumed = train("--project-dir", str(project), "--total-limit", "1", "--load",
                    str(other / "checkpoints" / "checkpoint_0"), "--save-at", "2")
    assert resumed["saved"] == [str(checkpoints / "checkpoint_2")] and Path(resumed["saved"][0]).is_dir()
    assert sorted(os.listdir(checkpoints)) == ["checkpoint_2"]
    # A fresh run (iteration 0) reusing the folder, total_limit=2: numbering continues, the new one is kept.
    fresh = train("--project-dir", str(project), "--total-limit", "2", "--save-at", "1")
    assert fresh["saved"] == [str(checkpoints / "checkpoint_3")]
    assert sorted(os.listdir(checkpoints)) == ["checkpoint_2", "checkpoint_3"]
    assert json.loads((checkpoints / "checkpoint_3" / META).read_text())["step"] == 1  # the fresh run's
    latest = train("--project-dir", str(project), "--load", "latest", "--steps", "1")
    assert latest["loaded"] == str(checkpoints / "checkpoint_3")


# ---- load_state() falls back past a damaged newest checkpoint -------------------------------------------------------
def _resume(argv: list[str]) -> tuple[dict, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = checkpoint_train.main(argv)
    return result, [str(w.message) for w in caught if "load_state" in str(w.message)]


def _load_latest(project: str) -> dict:
    accelerator, *_ = checkpoint_train.build(checkpoint_train.parse(["--dp-shard-size", "2", "--project-dir",
                                                                     project]))
    out = outcomes({"latest": accelerator.load_state})
    accelerator.end_training()
    return out


@pytest.mark.slow
def test_load_state_skips_a_damaged_newest_checkpoint(tmp_path):
    flags = ["--dp-shard-size", "2", "--steps", "3", "--project-dir", str(tmp_path)]
    full = run_ranks(checkpoint_train.main, 2, [*flags, "--save-at", "1", "2"])[0]
    checkpoints = tmp_path / "checkpoints"
    shard = sorted((checkpoints / "checkpoint_1" / "model_0").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    results = run_ranks(_resume, 2, [*flags, "--load", "latest"])
    for rank, (resumed, caught) in enumerate(results):
        assert resumed["loaded"] == str(checkpoints / "checkpoint_0"), rank
        assert resumed["losses"] == {k: v for k, v in full["losses"].items() if k > 1}, rank
    warned = results[0][1]  # rank 0 warns
    assert len(warned) == 1 and results[1][1] == [], results
    assert f"load_state(): skipping {checkpoints / 'checkpoint_1'}, it is damaged: " in warned[0]
    assert f"file model_0/{shard.name} is corrupt (its CRC32 differs" in warned[0]
    assert warned[0].endswith("trying checkpoint_0")

    (checkpoints / "checkpoint_0" / "gradient_state.json").write_text("{}")  # now every checkpoint is damaged
    for out in run_ranks(_load_latest, 2, str(tmp_path)):
        kind, message = out["latest"]
        assert kind == "CheckpointError", out
        assert message.startswith(f"no checkpoint in {checkpoints} can be loaded, all are damaged: checkpoint_")
        assert "checkpoint_0: " in message and "gradient_state.json has 2 bytes, the checkpoint recorded" in message


# ---- disk full, permission denied ----------------------------------------------------------------------------------
def _save_with_failing_writes(project: str) -> dict:
    """Save once, then save while a rank's writes fail as on a full disk (model shards, DCP) and as without
    permission (small files); then save again once they succeed."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    from ndparallel.checkpoint import storage

    class FullDisk(FileSystemWriter):
        def write_data(self, plan, planner):
            if dist.get_rank() == 1:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write_data(plan, planner)

    def refused(path, data):
        if dist.get_rank() == 0 and path.name == "dataloaders.json":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return write_bytes(path, data)

    accelerator, *_ = checkpoint_train.build(checkpoint_train.parse(["--dp-shard-size", "2", "--project-dir",
                                                                     project]))
    accelerator.save_state()
    writer, write_bytes = torch.distributed.checkpoint.FileSystemWriter, storage.write_bytes
    torch.distributed.checkpoint.FileSystemWriter = FullDisk
    out = outcomes({"full_disk": accelerator.save_state})
    torch.distributed.checkpoint.FileSystemWriter, storage.write_bytes = writer, refused
    out["no_permission"] = outcomes({"save": accelerator.save_state})["save"]
    storage.write_bytes = write_bytes
    out["after"] = accelerator.save_state()
    accelerator.end_training()
    return out


def test_disk_full_and_permission_errors_say_so_on_every_rank(tmp_path):
    results = run_ranks(_save_with_failing_writes, 2, str(tmp_path))
    checkpoints = tmp_path / "checkpoints"
    for out in results:
        kind, message = out["full_disk"]
        assert kind == "CheckpointError", out
        assert message.startswith(f"no space left on the device while writing model 0 under {checkpoints} (")
        assert "MiB free): free some space, keep fewer checkpoints" in message
        assert "previous checkpoints are untouched" in message
        kind, message = out["no_permission"]
        assert kind == "CheckpointError" and message.startswith(
            f"permission denied while writing the small states (schedulers, data loaders, random states...) under "
            f"{checkpoints} ({checkpoints / '.checkpoint_1.partial' / 'dataloaders.json'}): check that this user may "
            "create files there"), message
    assert results[0]["after"] == results[1]["after"] == str(checkpoints / "checkpoint_1")  # the failed saves' number
    assert sorted(os.listdir(checkpoints)) == ["checkpoint_0", "checkpoint_1"]  # no partial files left


def _can_mount_tmpfs(directory: Path) -> bool:
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            f"mount -t tmpfs -o size=64k tmpfs {directory}"], capture_output=True)
    return probe.returncode == 0


DRIVER = """
import json, os, sys
import checkpoint_train
from ndparallel.checkpoint import CheckpointError
project, out = sys.argv[1], {}
try:
    checkpoint_train.main(["--no-fsdp-plugin", "--steps", "2", "--project-dir", project, "--save-at", "1", "2"])
except CheckpointError as exc:
    out["error"] = str(exc)
out["listing"] = sorted(os.listdir(os.path.join(project, "checkpoints")))
out["loaded"] = checkpoint_train.main(["--no-fsdp-plugin", "--steps", "1", "--project-dir", project,
                                       "--load", "latest"])["loaded"]
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_a_real_full_disk_keeps_the_previous_checkpoint(tmp_path):
    """On a tmpfs of 1200 KiB (one checkpoint takes 840 KiB: model 140, optimizer 675), in a private mount namespace."""
    mount = tmp_path / "small"
    mount.mkdir()
    if sys.platform != "linux" or not _can_mount_tmpfs(mount):
        pytest.skip("cannot mount a tmpfs here (needs Linux and unprivileged user namespaces, or root)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NDPARALLEL_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), env.get("PYTHONPATH", "")])
    script = f"mount -t tmpfs -o size=1200k tmpfs {mount} && exec {sys.executable} -c '{DRIVER}' {mount}"
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT "):])
    # The second checkpoint's model (140 KiB) still fits; its optimizer (AdamW's two states, and the settings of each
    # parameter's group) does not.
    assert out["error"].startswith(f"no space left on the device while writing optimizer 0 under {mount}/checkpoints ")
    assert out["listing"] == ["checkpoint_0"]  # the partial save is gone, the previous checkpoint whole
    assert out["loaded"] == f"{mount}/checkpoints/checkpoint_0"


def test_save_model_and_merge_weights_replace_only_an_export(tmp_path):
    """No processes: the rule `save_model` / `merge-weights` follow (`storage.replace_problem` with EXPORT)."""
    from ndparallel.checkpoint import CheckpointError, storage

    export = tmp_path / "export"
    export.mkdir()
    for name in ("config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                 "model-00002-of-00002.safetensors", "model.safetensors.index.json"):
        (export / name).write_text("{}")
    assert storage.replace_problem(export, storage.EXPORT) is None
    (export / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"export exists and is not a Hugging Face model export \(it holds "
                                              r"config\.json, generation_config\.json, model-00001-of-00002"):
        storage.prepare_staging(export, storage.EXPORT)
    assert (export / "notes.txt").read_text() == "mine" and _hidden(tmp_path) == []
    # and a checkpoint directory is not an export (nor the reverse)
    assert "is not a complete ndparallel checkpoint" in storage.replace_problem(export, storage.CHECKPOINT)
