"""Files of a checkpoint: staging and atomic commit, the metadata file, checksums, and safe reading.

A checkpoint is a directory that becomes visible only when complete:

1. every rank writes into ``<parent>/.<name>.partial`` (rank 0 removes a stale one left by a crash first);
2. after a barrier, the ranks checksum the files (each a share of them) and rank 0 writes
   ``ndparallel_checkpoint.json`` (format, layout, world size, step, versions, size and CRC32 of every file),
   fsyncs it, and renames the staging directory to ``<parent>/<name>`` (an atomic `rename` on one filesystem).

A ``kill -9`` at any point before the rename leaves only a hidden ``.partial`` directory, which loading never
picks; the previous checkpoint is untouched. Overwriting an existing directory moves it aside to
``.<name>.old`` first and deletes it after the rename; a crash between those two renames leaves the new,
complete checkpoint in place or the old one under ``.<name>.old``.

Reading never unpickles arbitrary objects: ``torch.load`` runs with ``weights_only=True``, and the pickled
``.metadata`` file of `torch.distributed.checkpoint` is read by an unpickler that only builds DCP's own metadata
classes, dtypes, sizes and paths.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
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
# Test hook: when set to a path, `pause_point` creates that file and sleeps, so a test can kill the process in
# the middle of a save at a known moment.
PAUSE_ENV = "NDPARALLEL_TEST_PAUSE_IN_SAVE"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded here: incomplete, corrupt, of another model, or of another layout."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint where one was asked for."""


# ---- collectives that never leave a rank behind -------------------------------------------------------------
def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def agree(error: BaseException | str | None) -> None:
    """Collective: raise on every rank when any rank had an error -- the same class and message everywhere (the
    lowest failing rank's).

    Each rank calls it after work that may fail locally (reading a file), so no rank walks into the next
    collective while another has given up.
    """
    if error is None:
        mine = None
    elif isinstance(error, CheckpointError):
        mine = (type(error).__name__, str(error))
    else:
        mine = ("CheckpointError", error if isinstance(error, str) else f"{type(error).__name__}: {error}")
    found: list[Any] = [mine]
    if is_distributed():
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
    first = next((f for f in found if f is not None), None)
    if first is not None:
        kind, message = first
        raise (CheckpointNotFoundError if kind == "CheckpointNotFoundError" else CheckpointError)(message)


def on_main(fn: Callable[[], Any]) -> Any:
    """Run `fn` on rank 0 and hand its result -- or its error, raised as `CheckpointError` -- to every rank."""
    payload: list[Any] = [None]
    if rank() == 0:
        try:
            payload = [("ok", fn())]
        except Exception as exc:  # noqa: BLE001 - whatever it is, every rank must hear of it (or they would hang)
            payload = [("error", exc if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}")]
    if is_distributed():
        dist.broadcast_object_list(payload, src=0)
    status, value = payload[0]
    if status == "error":
        if isinstance(value, BaseException):
            raise value
        raise CheckpointError(value)
    return value


def barrier() -> None:
    if is_distributed():
        dist.barrier()


# ---- staging and commit -------------------------------------------------------------------------------------
def staging_dir(final: Path) -> Path:
    return final.parent / f".{final.name}{PARTIAL_SUFFIX}"


def prepare_staging(final: Path) -> Path:
    """Rank 0: create an empty staging directory for `final` (removing a stale one); return its path."""
    staging = staging_dir(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    return staging


def fsync_path(path: Path) -> None:
    """Flush a file or directory entry to disk (directories: so a rename survives a power cut)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_json(path: Path, obj: Any) -> None:
    write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def torch_bytes(obj: Any, what: str) -> bytes:
    """Serialise `obj` with torch.save and check that it reads back with ``weights_only=True``.

    The check fails the *save* when a state holds something a safe load refuses (a lambda, a NumPy array, a
    custom class), instead of failing the resume much later.
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - report whatever the safe unpickler refused
        raise TypeError(
            f"{what}: its state_dict() cannot be loaded back with torch.load(weights_only=True) ({exc}); a "
            "checkpointed state may hold only tensors and plain Python values (dict, list, tuple, str, int, "
            "float, bool, None)"
        ) from None
    return data


def commit(staging: Path, final: Path, metadata: dict[str, Any] | None) -> None:
    """Rank 0: write the metadata file (if any) into `staging`, then make it `final` with an atomic rename."""
    if metadata is not None:
        write_json(staging / METADATA_FILE, metadata)
    fsync_path(staging)
    old = final.parent / f".{final.name}{OLD_SUFFIX}"
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(staging, final)
    fsync_path(final.parent)
    if old.exists():
        shutil.rmtree(old)


def pause_point(stage: str) -> None:
    """Test hook (see `PAUSE_ENV`): stop here, in the middle of a save, until killed."""
    marker = os.environ.get(PAUSE_ENV)
    if marker:
        import time

        Path(marker).write_text(stage)
        while True:
            time.sleep(60)


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
        dist.broadcast_object_list(holder, src=0)
    files = holder[0]
    mine = {name: {"bytes": (root / name).stat().st_size, "crc32": crc32_file(root / name)}
            for name in files[rank()::world_size()]}
    parts: list[Any] = [mine]
    if is_distributed():
        parts = [None] * world_size()
        dist.all_gather_object(parts, mine)
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
    agree(CheckpointError(error) if error else None)


# ---- reading -------------------------------------------------------------------------------------------------------
def load_torch_file(path: Path, what: str) -> Any:
    """``torch.load(path, weights_only=True)`` with an error that names the file and what it holds."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} ({what}) is missing") from None
    except Exception as exc:  # noqa: BLE001 - a corrupt file raises many kinds of errors
        raise CheckpointError(f"checkpoint file {path} ({what}) cannot be read: {type(exc).__name__}: {exc}") from None


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} ({what}) is missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path} ({what}) cannot be read: {exc}") from None


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
        raise CheckpointError(f"checkpoint directory {directory} has no .metadata file (incomplete save?)") from None
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"checkpoint file {path} cannot be read: {type(exc).__name__}: {exc}") from None


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
