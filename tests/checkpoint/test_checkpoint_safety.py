"""Checkpoints that must not load, and saves that must not break: a table of bad checkpoints (each with its clear
error, the same on every rank, raised before any rank can hang, and nothing of the run touched), a real ``kill -9``
in the middle of a save, and automatic naming with ``total_limit``."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint  # noqa: F401 - imported once here, not again in every forked rank
from transformers import LlamaForCausalLM  # noqa: F401 - likewise

import checkpoint_train
from harness import run_ranks
from ndparallel.checkpoint import ProjectConfiguration, latest_checkpoint

SCRIPT = Path(checkpoint_train.__file__)
META = "ndparallel_checkpoint.json"


# ---- the table of bad checkpoints ------------------------------------------------------------------------------
class Payload:
    """Unpickling this runs a shell command: what a malicious checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _record(checkpoint: Path, name: str) -> None:
    """Re-record size and CRC32 of a replaced file, as an attacker would, so only the safe loader stands guard."""
    meta = json.loads((checkpoint / META).read_text())
    data = (checkpoint / name).read_bytes()
    meta["files"][name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    (checkpoint / META).write_text(json.dumps(meta))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _save(tmp: Path, name: str, world: int, *flags: str) -> Path:
    run_ranks(checkpoint_train.main, world, [*flags, "--steps", "1", "--save-at", "1", "--save-dir", str(tmp / name)])
    return tmp / name / "step_1"


def _run_state(accelerator, model, optimizer, dataloader, scheduler, counter) -> str:
    """Everything load_state could overwrite, as one string (parameters and optimizer moments summed)."""
    local = [getattr(t, "_local_tensor", t) for t in model.parameters()]
    moments = [getattr(v, "_local_tensor", v) for state in optimizer.optimizer.state.values() for v in state.values()]
    return repr((float(sum(t.double().abs().sum() for t in local)), float(sum(t.double().abs().sum() for t in moments)),
                 dataloader.state_dict(), scheduler.state_dict()["last_epoch"], counter.count,
                 accelerator.gradient_state.state_dict(), torch.get_rng_state().sum().item()))


def _try_loads(cases: dict[str, str]) -> dict[str, tuple[str, str, bool]]:
    """In each rank of an FSDP2 run after one step: load every case; collect what each raised, and whether the
    run's state changed."""
    args = checkpoint_train.parse(["--dp-shard-size", "2"])
    objects = checkpoint_train.build(args)
    accelerator, model, optimizer, dataloader, *_ = objects
    batches = iter(dataloader)
    next(batches)
    batch = next(batches)  # at sample 16: the checkpoints (saved after one step) are at sample 8
    accelerator.backward(model(**batch).loss)
    optimizer.step()
    optimizer.zero_grad()
    out = {}
    for case, path in cases.items():
        before = _run_state(*objects)
        try:
            accelerator.load_state(path)
            out[case] = ("no error", "")
        except Exception as exc:  # noqa: BLE001 - the test looks at the type and message
            out[case] = (type(exc).__name__, str(exc))
        out[case] += (_run_state(*objects) != before,)
    accelerator.end_training()
    return out


@pytest.fixture(scope="module")
def bad_checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    good = _save(tmp, "good", 2, "--dp-shard-size", "2")
    marker = tmp / "pwned"
    cases: dict[str, Path] = {"missing": tmp / "does_not_exist"}

    def copy(case: str) -> Path:
        cases[case] = Path(shutil.copytree(good, tmp / case))
        return cases[case]

    (copy("interrupted_save") / META).unlink()
    (copy("not_ndparallel") / META).write_text("{not json")
    (copy("missing_file") / "scheduler_0.pt").unlink()
    distcp = sorted((good / "model_0").glob("*.distcp"))[0].name
    path = copy("truncated_file") / "model_0" / distcp
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    _flip_byte(copy("corrupt_file") / "optimizer_0" / distcp)
    (copy("malicious_metadata") / "model_0" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _record(cases["malicious_metadata"], "model_0/.metadata")
    buffer = io.BytesIO()
    torch.save({"last_epoch": Payload(marker)}, buffer)
    (copy("malicious_state") / "scheduler_0.pt").write_bytes(buffer.getvalue())
    _record(cases["malicious_state"], "scheduler_0.pt")
    # Files that pass their CRC32 (re-recorded) but hold values no save writes.
    for case, name, content in [
        ("bad_gradient_state", "gradient_state.json", {"step": "x", "num_steps": 2, "sync_gradients": True}),
        ("bad_dataloaders", "dataloaders.json", {"epoch": 0, "position": 8}),
        ("bad_dataloader_entry", "dataloaders.json", [{"epoch": -1, "position": "8", "unit": "samples"}]),
    ]:
        (copy(case) / name).write_text(json.dumps(content))
        _record(cases[case], name)
    torch.save({"python": (3, (1, 2), None), "torch": torch.zeros(3, dtype=torch.uint8)},
               copy("bad_random_states") / "random_states_1.pt")
    _record(cases["bad_random_states"], "random_states_1.pt")
    # Valid files that the objects themselves refuse: the loader (another kind of batching), the registered object
    # (a state without its key) -- refused after the data loader was loaded, which must be put back.
    state = json.loads((good / "dataloaders.json").read_text())
    state[0]["unit"] = "batches"
    (copy("other_batching") / "dataloaders.json").write_text(json.dumps(state))
    _record(cases["other_batching"], "dataloaders.json")
    torch.save({}, copy("refused_by_object") / "custom_checkpoint_0.pt")
    _record(cases["refused_by_object"], "custom_checkpoint_0.pt")
    meta = json.loads((copy("bad_metadata_field") / META).read_text())
    meta["optimizer_models"] = [5]
    (cases["bad_metadata_field"] / META).write_text(json.dumps(meta))
    cases["other_shapes"] = _save(tmp, "wide", 1, "--no-fsdp-plugin", "--hidden-size", "64")
    cases["other_depth"] = _save(tmp, "deep", 1, "--no-fsdp-plugin", "--layers", "3")
    cases["other_optimizer"] = _save(tmp, "sgd", 1, "--no-fsdp-plugin", "--optimizer", "sgd")
    cases["good"] = good  # last: the one load that changes the run
    results = run_ranks(_try_loads, 2, {k: str(v) for k, v in cases.items()})
    return results, marker


CORRUPT = "CheckpointCorruptError"  # a CheckpointError: damaged files (load_state() of a project skips these)
BAD = [  # case, exception class, message pattern
    ("missing", "CheckpointNotFoundError", r"does_not_exist does not exist"),
    ("interrupted_save", "CheckpointError", r"is incomplete: it has no ndparallel_checkpoint\.json"),
    ("not_ndparallel", CORRUPT, r"ndparallel_checkpoint\.json \(checkpoint metadata\) cannot be read"),
    ("missing_file", CORRUPT, r"file scheduler_0\.pt is missing"),
    ("truncated_file", CORRUPT, r"file model_0/__\d_0\.distcp has \d+ bytes, the checkpoint recorded \d+"),
    ("corrupt_file", CORRUPT, r"file optimizer_0/__\d_0\.distcp is corrupt \(its CRC32 differs"),
    ("malicious_metadata", CORRUPT, r"refusing to load posix\.system from checkpoint metadata"),
    ("malicious_state", CORRUPT, r"scheduler_0\.pt \(LR scheduler 0\) cannot be read: .*Weights only load"),
    ("bad_gradient_state", CORRUPT, r"gradient_state\.json has invalid values: step='x' \(step and num_steps: ints"),
    ("bad_dataloaders", CORRUPT, r"dataloaders\.json must be a list of 1 data loader state\(s\), got dict"),
    ("bad_dataloader_entry", CORRUPT, r"dataloaders\.json entry 0 has invalid values: epoch=-1, position='8'"),
    ("bad_random_states", CORRUPT, r"random_states_1\.pt does not hold valid random generator states"),
    ("other_batching", "CheckpointError", r"data loader 0 refused its saved state: ValueError: data loader position "
                                          r"was saved in batches \(batch_size=\d+\) but this loader counts samples"),
    ("refused_by_object", "CheckpointError", r"registered object 0 \(StepCounter\) refused its saved state: "
                                             r"KeyError: 'count'"),
    ("bad_metadata_field", CORRUPT, r"ndparallel_checkpoint\.json is not valid: 'optimizer_models' must list the "
                                    r"model index of each of the 1 optimizer\(s\), got \[5\]"),
    ("other_shapes", "CheckpointError", r"model 0 does not match the model .*differ in shape: "
                                        r".*model\.embed_tokens\.weight: checkpoint \(96, 64\) vs model \(96, 32\)"),
    ("other_depth", "CheckpointError", r"tensor\(s\) of the checkpoint are not in the model: model\.layers\.2\."),
    ("other_optimizer", "CheckpointError", r"cannot be loaded into this Accelerator: it holds .*optimizers \['SGD'\]"
                                           r".*this Accelerator has .*optimizers \['AdamW'\]"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case,kind,pattern", BAD, ids=[b[0] for b in BAD])
def test_bad_checkpoint_raises_a_clear_error_on_every_rank(bad_checkpoints, case, kind, pattern):
    results, marker = bad_checkpoints
    assert results[0][case] == results[1][case], f"ranks disagree: {results[0][case]} / {results[1][case]}"
    raised, message, touched = results[0][case]
    assert raised == kind, f"{case}: {raised}: {message}"
    assert __import__("re").search(pattern, message), f"{case}: {message!r} does not match {pattern!r}"
    assert not touched, f"{case}: the refused load changed the model, optimizer, data loader or counters"
    assert not marker.exists(), "a malicious checkpoint ran code"


def test_the_good_checkpoint_loads_and_changes_the_run(bad_checkpoints):
    """The control of the table: the checkpoint the bad ones were made from loads, and `_run_state` sees it."""
    results, _ = bad_checkpoints
    assert results[0]["good"] == results[1]["good"] == ("no error", "", True)


# ---- kill -9 in the middle of a save ------------------------------------------------------------------------------
@pytest.mark.slow
def test_kill_9_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    """A real process, killed with SIGKILL while its second save is half written (after the model, before the
    optimizer and metadata), leaves the first checkpoint intact: `load_state()` finds it, and training resumed
    from it continues the uninterrupted run's loss curve."""
    project, marker = tmp_path / "project", tmp_path / "paused"
    cmd = [sys.executable, str(SCRIPT), "--no-fsdp-plugin", "--steps", "4", "--project-dir", str(project),
           "--save-at", "1", "2", "--pause-in-save", "2", "--pause-marker", str(marker)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NDPARALLEL_", "RANK", "WORLD_SIZE", "MASTER_"))}
    proc = subprocess.Popen(cmd, env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.time() < deadline, "the save never reached the pause point"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    checkpoints = project / "checkpoints"
    partial = checkpoints / ".checkpoint_1.partial"
    assert (partial / "model_0").is_dir() and not (partial / META).exists()  # killed half-way through the save
    assert sorted(p.name for p in checkpoints.iterdir()) == [".checkpoint_1.partial", "checkpoint_0"]
    assert latest_checkpoint(project) == checkpoints / "checkpoint_0"

    resumed = run_ranks(checkpoint_train.main, 1, ["--no-fsdp-plugin", "--steps", "4", "--project-dir", str(project),
                                                   "--load", "latest", "--save-at", "4"])[0]
    uninterrupted = run_ranks(checkpoint_train.main, 1, ["--no-fsdp-plugin", "--steps", "4"])[0]
    assert resumed["loaded"] == str(checkpoints / "checkpoint_0")
    assert resumed["losses"] == {k: v for k, v in uninterrupted["losses"].items() if k > 1}
    # The next save took the next number and cleared what the killed save left.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_0", "checkpoint_1"]


def test_automatic_naming_keeps_the_newest_total_limit_checkpoints(tmp_path):
    result = run_ranks(checkpoint_train.main, 2, ["--dp-shard-size", "2", "--steps", "4", "--project-dir",
                                                  str(tmp_path), "--save-at", "1", "2", "3", "4", "--total-limit", "2"])
    checkpoints = tmp_path / "checkpoints"
    assert result[0]["saved"] == [str(checkpoints / f"checkpoint_{i}") for i in range(4)]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_2", "checkpoint_3"]
    meta = json.loads((checkpoints / "checkpoint_3" / META).read_text())
    assert meta["step"] == 4 and meta["iteration"] == 3 and meta["world_size"] == 2
    assert meta["parallelism"]["dp_shard_size"] == 2 and meta["versions"]["torch"] == torch.__version__


def test_project_configuration_is_checked():
    with pytest.raises(ValueError, match="total_limit must be an int >= 1"):
        ProjectConfiguration(project_dir=".", total_limit=0)
    # The directory may come with the Accelerator (as in Accelerate): checked there, before any process group.
    from ndparallel import Accelerator

    with pytest.raises(ValueError, match=r"automatic_checkpoint_naming needs a project_dir: pass "
                                         r"Accelerator\(project_dir=\.\.\.\) or ProjectConfiguration"):
        Accelerator(project_config=ProjectConfiguration(automatic_checkpoint_naming=True))
