"""Files of a checkpoint: staging and atomic commit, the metadata file, checksums, and safe reading.

A checkpoint is a directory that becomes visible only when complete:

1. every rank writes into ``<parent>/.<name>.partial`` (rank 0 removes a stale one left by a crash first), once
   every rank has seen the token rank 0 put there (`check_shared`: the nodes must share the filesystem);
2. after a barrier, the ranks checksum the files (each a share of them) and rank 0 writes
   ``ndparallel_checkpoint.json`` (format, layout, world size, step, versions, size and CRC32 of every file),
   fsyncs it, and renames the staging directory to ``<parent>/<name>`` (an atomic `rename` on one filesystem).

A ``kill -9`` at any point before the rename leaves only a hidden ``.partial`` directory, which loading never
picks; the previous checkpoint is untouched. Only an empty directory or one of the same kind (a complete
ndparallel checkpoint for ``save_state``, a Hugging Face export for ``save_model``) is ever replaced: anything else
at the target -- a file, a symbolic link, a directory with other files -- is refused before anything is written
(`replace_problem`), and checked again just before the rename. A replaced directory is moved aside to
``.<name>.old`` first and deleted after the rename; a crash between those two renames leaves the new, complete
checkpoint in place or the old one under ``.<name>.old``.

A failed write (disk full, permission denied, read-only filesystem) is reported in those words on every rank
(`write_error`); the caller removes the staging directory, and previous checkpoints are untouched.

Reading never unpickles arbitrary objects: ``torch.load`` runs with ``weights_only=True``, and the pickled
``.metadata`` file of `torch.distributed.checkpoint` is read by an unpickler that only builds DCP's own metadata
classes, dtypes, sizes and paths.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pickle
import re
import shutil
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

METADATA_FILE = "ndparallel_checkpoint.json"
FORMAT = "ndparallel-checkpoint"
FORMAT_VERSION = 1
PARTIAL_SUFFIX = ".partial"
OLD_SUFFIX = ".old"
SHARED_MARK = ".ndparallel_shared"  # rank 0's token in a new staging directory: does every rank see it?
CHECKPOINT, EXPORT = "checkpoint", "export"  # what a directory that commit() may replace must hold
# Files of a Hugging Face export (save_model / merge-weights): a directory holding only these may be replaced.
_EXPORT_FILE = re.compile(r"(config|generation_config)\.json|(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)"
                          r"|(model\.safetensors|pytorch_model\.bin)\.index\.json")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded here: incomplete, corrupt, of another model, or of another layout."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint where one was asked for."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint whose files are damaged: missing, truncated, failing their checksum, or holding values that
    cannot be what a save wrote. ``load_state()`` with automatic naming skips such a checkpoint for an older one."""


_ERRORS = {cls.__name__: cls for cls in (CheckpointError, CheckpointNotFoundError, CheckpointCorruptError)}


# ---- collectives that never leave a rank behind -------------------------------------------------------------
def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


_collectives = threading.local()  # .group: the process group checkpoint collectives of this thread use


@contextlib.contextmanager
def collectives_on(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Run this thread's checkpoint collectives (`agree`, `on_main`, `barrier`, `checksum_files`, DCP's) on `group`
    -- a background save uses a process group of its own, so its collectives never meet training's."""
    before = getattr(_collectives, "group", None)
    _collectives.group = group
    try:
        yield
    finally:
        _collectives.group = before


def group() -> dist.ProcessGroup | None:
    """The process group of this thread's checkpoint collectives (None: the default group)."""
    return getattr(_collectives, "group", None)


def agree(error: BaseException | str | None) -> None:
    """Collective: raise on every rank when any rank had an error -- the same class and message everywhere (the
    lowest failing rank's).

    Each rank calls it after work that may fail locally (reading a file), so no rank walks into the next
    collective while another has given up.
    """
    if error is None:
        mine = None
    elif isinstance(error, CheckpointError):
        mine = (type(error).__name__ if type(error).__name__ in _ERRORS else "CheckpointError", str(error))
    else:
        mine = ("CheckpointError", error if isinstance(error, str) else f"{type(error).__name__}: {error}")
    found: list[Any] = [mine]
    if is_distributed():
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine, group=group())
    first = next((f for f in found if f is not None), None)
    if first is not None:
        kind, message = first
        raise _ERRORS[kind](message)


def on_main(fn: Callable[[], Any]) -> Any:
    """Run `fn` on rank 0 and hand its result -- or its error, raised as `CheckpointError` -- to every rank."""
    payload: list[Any] = [None]
    if rank() == 0:
        try:
            payload = [("ok", fn())]
        except Exception as exc:  # noqa: BLE001 - whatever it is, every rank must hear of it (or they would hang)
            payload = [("error", exc if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}")]
    if is_distributed():
        dist.broadcast_object_list(payload, src=0, group=group())
    status, value = payload[0]
    if status == "error":
        if isinstance(value, BaseException):
            raise value
        raise CheckpointError(value)
    return value


def barrier() -> None:
    if is_distributed():
        dist.barrier(group=group())


# ---- staging and commit -------------------------------------------------------------------------------------
def staging_dir(final: Path) -> Path:
    return final.parent / f".{final.name}{PARTIAL_SUFFIX}"


def is_complete_checkpoint(path: Path) -> bool:
    """Whether `path` is a directory holding a complete ndparallel checkpoint (its metadata file says so)."""
    meta = path / METADATA_FILE
    if path.is_symlink() or not meta.is_file():
        return False
    try:
        data = json.loads(meta.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT and data.get("complete") is True


def _is_export(path: Path) -> bool:
    return all(p.is_file() and _EXPORT_FILE.fullmatch(p.name) for p in path.iterdir())


def replace_problem(path: Path, kind: str) -> str | None:
    """Why `path` must not be replaced by a new directory of `kind` (CHECKPOINT or EXPORT), or None if it may.

    Only a missing path, an empty directory, or a directory of the same kind may be replaced: a complete
    ndparallel checkpoint, or a Hugging Face export (config and weight files only)."""
    if not os.path.lexists(path):
        return None
    what = "a complete ndparallel checkpoint" if kind == CHECKPOINT else "a Hugging Face model export"
    fix = "choose another directory, or move or delete this one yourself"
    if path.is_symlink():
        return f"{path} is a symbolic link; only a directory holding {what} is replaced: {fix}"
    if not path.is_dir():
        return f"{path} exists and is a file, not a directory: {fix}"
    entries = sorted(p.name for p in path.iterdir())
    if not entries or (is_complete_checkpoint(path) if kind == CHECKPOINT else _is_export(path)):
        return None
    shown = ", ".join(entries[:5]) + (f", ... ({len(entries) - 5} more)" if len(entries) > 5 else "")
    return (f"{path} exists and is not {what} (it holds {shown}); only an empty directory or {what} is "
            f"replaced: {fix}")


def prepare_staging(final: Path, kind: str = CHECKPOINT) -> Path:
    """Rank 0: refuse a `final` that must not be replaced (`replace_problem`), then create an empty staging
    directory for it (removing a stale one); return its path. Nothing is written or moved before the check."""
    problem = replace_problem(final, kind)
    if problem:
        raise CheckpointError(f"refusing to write to {final}: {problem}")
    staging = staging_dir(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
    except OSError as exc:
        raise write_error(exc, final.parent, f"the staging directory {staging.name}") from None
    return staging


def mark_shared(staging: Path) -> str:
    """Rank 0: write a token into the staging directory it just made, for `check_shared`; return the token."""
    token = f"{socket.gethostname()} pid {os.getpid()} {time.time_ns()}"
    try:
        (staging / SHARED_MARK).write_text(token)  # closed before the others open it: NFS shows it them
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise write_error(exc, staging.parent, f"the staging directory {staging.name}") from None
    return token


def check_shared(staging: Path, token: str) -> None:
    """Collective: every rank reads `token` from the staging directory rank 0 made (`mark_shared`), then rank 0
    removes it. The ranks of every node write one checkpoint together, so its directory must be the same on every
    node -- one filesystem that the nodes share, at the same path. Where it is not, every rank raises, naming the
    ranks and hosts that do not see it, before anything is written (each removes its own staging copy)."""
    try:
        seen = (staging / SHARED_MARK).read_text() == token
    except OSError:
        seen = False
    if not is_distributed():
        return
    everywhere = torch.tensor([int(seen)])
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN, group=group())  # one small collective when all is well
    if rank() == 0:
        with contextlib.suppress(OSError):
            (staging / SHARED_MARK).unlink()
    if everywhere.item():
        return
    views: list[Any] = [None] * world_size()
    dist.all_gather_object(views, (seen, socket.gethostname()), group=group())
    blind = [r for r, (ok, _) in enumerate(views) if not ok]
    discard_staging(staging)
    raise CheckpointError(
        f"cannot save to {staging.parent}: rank(s) {blind} (on {', '.join(sorted({views[r][1] for r in blind}))}) do "
        f"not see the directory that rank 0 (on {views[0][1]}) just made there. The ranks of every node write one "
        "checkpoint together: save to a filesystem that every node shares, under the same path (NFS, Lustre, "
        "GPFS...; not a node's local disk, nor a relative path under different working directories)")


def discard_staging(staging: Path) -> None:
    """Every rank, on a failed save: remove the staging directory (its own copy where the disk is not shared).

    Each rank removes it itself rather than waiting on rank 0, so when the error reaches the caller of any rank
    the directory is already gone there, and no collective is needed on the way out of a failure."""
    shutil.rmtree(staging, ignore_errors=True)


def fsync_path(path: Path) -> None:
    """Flush a file or directory entry to disk (directories: so a rename survives a power cut)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


# ---- why a write failed -------------------------------------------------------------------------------------------
_PLAIN = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
          errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
          errno.EROFS: "the filesystem is read-only"}
# How torch's zip writer reports a failed write: it hides the OSError (a full disk reads "unexpected pos").
_TORCH_WRITE_FAILED = ("unexpected pos", "file write failed", "iostream error")


def _os_error(exc: BaseException) -> OSError | None:
    """The first OSError with an errno we can name in `exc`, its causes and contexts, and DCP's per-rank failures."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _PLAIN:
            return e
        todo += [e.__cause__, e.__context__]
        todo += [f[0] for f in (getattr(e, "failures", None) or {}).values() if isinstance(f, tuple)]
    return None


def _free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):
        if p.exists():
            try:
                st = os.statvfs(p)
            except (OSError, AttributeError):  # AttributeError: no statvfs on Windows
                return None
            return st.f_bavail * st.f_frsize
    return None


def write_error(exc: BaseException, directory: Path, what: str) -> CheckpointError:
    """A `CheckpointError` that says in plain words why writing `what` under `directory` failed: no space, quota,
    permission, read-only filesystem -- also when torch's own writer hid the OSError -- or else what was raised."""
    found = _os_error(exc)
    free = _free_bytes(directory)
    if found is None and any(s in str(exc) for s in _TORCH_WRITE_FAILED) and free is not None and free < 2**20:
        found = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if found is None:
        return CheckpointError(f"writing {what} under {directory} failed: {type(exc).__name__}: {str(exc)[:1000]}")
    reason = _PLAIN[found.errno]
    where = f" ({found.filename})" if getattr(found, "filename", None) else ""
    if found.errno in (errno.ENOSPC, errno.EDQUOT):
        space = f" ({free / 2**20:.1f} MiB free)" if free is not None else ""
        fix = ("free some space, keep fewer checkpoints (ProjectConfiguration(total_limit=...)), or save to "
               "another filesystem")
        return CheckpointError(f"{reason} while writing {what} under {directory}{space}: {fix}. This save was "
                               "abandoned and its partial files removed; previous checkpoints are untouched")
    return CheckpointError(f"{reason} while writing {what} under {directory}{where}: check that this user may "
                           "create files there (on every node), or save to another directory. This save was "
                           "abandoned; previous checkpoints are untouched")


def write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()


def write_json(path: Path, obj: Any) -> None:
    write_bytes(path, json_bytes(obj))


def torch_bytes(obj: Any, what: str, check: bool = True) -> bytes:
    """Serialise `obj` with torch.save and (`check`) check that it reads back with ``weights_only=True``.

    The check fails the *save* when a state holds something a safe load refuses (a lambda, a NumPy array, a
    custom class), instead of failing the resume much later; it is left out only for states the library makes
    itself of tensors and plain values (the random states).
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    if not check:
        return data
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - report whatever the safe unpickler refused
        raise TypeError(
            f"{what}: its state_dict() cannot be loaded back with torch.load(weights_only=True) ({exc}); a "
            "checkpointed state may hold only tensors and plain Python values (dict, list, tuple, str, int, "
            "float, bool, None)"
        ) from None
    return data


def commit(staging: Path, final: Path, metadata: dict[str, Any] | None, kind: str = CHECKPOINT) -> None:
    """Rank 0: write the metadata file (if any) into `staging`, then make it `final` with an atomic rename.

    `final` is checked again (`replace_problem`: something may have appeared there during the save); on any
    failure the staging directory is removed and `final` is as it was."""
    try:
        problem = replace_problem(final, kind)
        if problem:
            raise CheckpointError(f"refusing to write to {final}: {problem}")
        try:
            if metadata is not None:
                write_json(staging / METADATA_FILE, metadata)
            fsync_path(staging)
        except OSError as exc:
            raise write_error(exc, final.parent, METADATA_FILE) from None
        old = final.parent / f".{final.name}{OLD_SUFFIX}"
        if old.exists() and replace_problem(old, kind):
            raise CheckpointError(f"refusing to write to {final}: {replace_problem(old, kind)}")
        if os.path.lexists(final):
            if old.exists():  # a leftover older than `final` (a crash between the renames of an earlier save)
                shutil.rmtree(old)
            os.rename(final, old)
        os.rename(staging, final)
        fsync_path(final.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if old.exists():  # only now: until `final` is in place, `old` may be the only copy of the previous one
        shutil.rmtree(old)


# ---- checksums ------------------------------------------------------------------------------------------------
def crc32_file(path: Path, chunk: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb") as f:
        while data := f.read(chunk):
            crc = zlib.crc32(data, crc)
    return crc


def list_files(root: Path) -> list[str]:
    """Every file under `root`, as sorted POSIX paths relative to it (the metadata file excluded)."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != METADATA_FILE)


def checksum_files(root: Path) -> dict[str, dict[str, int]]:
    """Collective: size and CRC32 of every file under `root`; each rank reads its share of the files."""
    files = list_files(root) if rank() == 0 else None
    holder = [files]
    if is_distributed():
        dist.broadcast_object_list(holder, src=0, group=group())
    files = holder[0]
    mine = {name: {"bytes": (root / name).stat().st_size, "crc32": crc32_file(root / name)}
            for name in files[rank()::world_size()]}
    parts: list[Any] = [mine]
    if is_distributed():
        parts = [None] * world_size()
        dist.all_gather_object(parts, mine, group=group())
    return {name: info for part in parts for name, info in sorted(part.items())}


def verify_files(root: Path, files: dict[str, dict[str, int]]) -> None:
    """Collective: check size and CRC32 of every listed file (each rank a share); raise on every rank if bad."""
    names = sorted(files)
    error = None
    for name in names[rank()::world_size()]:
        path = root / name
        expected = files[name]
        if not path.is_file():
            error = f"checkpoint {root}: file {name} is missing (the checkpoint is incomplete or was modified)"
        elif path.stat().st_size != expected["bytes"]:
            error = (f"checkpoint {root}: file {name} has {path.stat().st_size} bytes, the checkpoint recorded "
                     f"{expected['bytes']} (truncated or overwritten)")
        elif crc32_file(path) != expected["crc32"]:
            error = f"checkpoint {root}: file {name} is corrupt (its CRC32 differs from the one recorded at save)"
        if error:
            break
    agree(CheckpointCorruptError(error) if error else None)


# ---- reading -------------------------------------------------------------------------------------------------------
def load_torch_file(path: Path, what: str) -> Any:
    """``torch.load(path, weights_only=True)`` with an error that names the file and what it holds."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"checkpoint file {path} ({what}) is missing") from None
    except Exception as exc:  # noqa: BLE001 - a corrupt file raises many kinds of errors
        raise CheckpointCorruptError(f"checkpoint file {path} ({what}) cannot be read: {type(exc).__name__}: "
                                     f"{exc}") from None


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointCorruptError(f"checkpoint file {path} ({what}) is missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(f"checkpoint file {path} ({what}) cannot be read: {exc}") from None


def _allowed_globals() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {}
    for name in ("Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
                 "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"):
        if hasattr(metadata, name):
            allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = getattr(__import__("pathlib"), name)
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata classes, torch dtypes and sizes, and paths; refuses every other global."""

    allowed: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


def read_dcp_metadata(directory: Path) -> Any:
    """The `Metadata` of a `torch.distributed.checkpoint` directory, read without unpickling arbitrary objects."""
    path = directory / ".metadata"
    if not _MetadataUnpickler.allowed:
        _MetadataUnpickler.allowed = _allowed_globals()
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointCorruptError(f"checkpoint directory {directory} has no .metadata file (incomplete save?)") \
            from None
    except Exception as exc:  # noqa: BLE001
        raise CheckpointCorruptError(f"checkpoint file {path} cannot be read: {type(exc).__name__}: {exc}") from None


def safe_reader(directory: Path):
    """A DCP `FileSystemReader` whose metadata is read by the restricted unpickler above."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_dcp_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(directory))


def safe_load_planner(**kwargs: Any):
    """A DCP `DefaultLoadPlanner` that reads non-tensor values with ``torch.load(weights_only=True)``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._nested_dict import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner(**kwargs)


def iter_shapes(metadata: Any, prefix: str = "") -> Iterator[tuple[str, tuple[int, ...] | None]]:
    """(key, global shape) of every entry of a DCP `Metadata` (shape None for non-tensor values)."""
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith(prefix):
            size = getattr(entry, "size", None)
            yield key[len(prefix):], (tuple(size) if size is not None else None)
