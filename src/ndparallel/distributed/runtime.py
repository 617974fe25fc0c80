"""Starting torch.distributed: backend, device, collective timeout, and a one-process world when nothing launched us;
and the heartbeat a rank leaves for ``ndparallel launch --stall-timeout``.

Environment variables read here (``ndparallel launch`` sets the first ones):
- ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``: torchrun's;
- ``NDPARALLEL_CPU=1``: use the CPU and gloo even where CUDA is available;
- ``NDPARALLEL_TIMEOUT``: seconds a collective may wait for the other ranks before it fails (default 600; see
  `resolve_timeout`); an explicit ``init_runtime(timeout=...)`` (``InitProcessGroupKwargs(timeout=...)``) wins;
- ``NDPARALLEL_HEARTBEAT_DIR``: set by ``ndparallel launch --stall-timeout``; `heartbeat` writes there.

A process group left to interpreter shutdown (a script that never calls ``end_training()``, or one that raises) now
and then aborts its rank (gloo's threads outlive the interpreter: "terminate called without an active exception",
exit code 134): `release_process_group` runs at exit to release it while the interpreter is whole.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import json
import os
import socket
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

CPU_ENV = "NDPARALLEL_CPU"
DEVICE_ENVS = ("NDPARALLEL_TORCH_DEVICE", "ACCELERATE_TORCH_DEVICE")  # this process's device, instead of the default
TIMEOUT_ENV = "NDPARALLEL_TIMEOUT"
HEARTBEAT_ENV = "NDPARALLEL_HEARTBEAT_DIR"
# Long enough for a slow checkpoint write on a shared filesystem, short enough that a rank that never arrives is
# reported within minutes instead of torch's 30 (gloo) -- and the same for NCCL.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    # How long a collective may wait (what the process group got when this module started it; the library's
    # monitored barriers use it either way).
    timeout: datetime.timedelta = DEFAULT_TIMEOUT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def resolve_timeout(timeout: datetime.timedelta | float | None = None) -> datetime.timedelta:
    """The collective timeout: `timeout` if given (a timedelta or seconds), else ``$NDPARALLEL_TIMEOUT`` (seconds),
    else `DEFAULT_TIMEOUT` (10 minutes). Raises ValueError / TypeError naming the setting when it is not > 0."""
    where = "timeout"
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV, "").strip()
        if not raw:
            return DEFAULT_TIMEOUT
        where = f"${TIMEOUT_ENV}"
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"{where} must be a number of seconds > 0, got {raw!r}") from None
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = datetime.timedelta(seconds=timeout)
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"{where} must be a datetime.timedelta or a number of seconds, got {timeout!r}")
    if timeout.total_seconds() <= 0:
        raise ValueError(f"{where} must be > 0 seconds, got {timeout.total_seconds():g}")
    return timeout


def init_runtime(cpu: bool = False, timeout: datetime.timedelta | float | None = None,
                 backend: str | None = None) -> Runtime:
    """Initialise the default process group if needed and pick this rank's device.

    NCCL and ``cuda:LOCAL_RANK`` when CUDA is available and `cpu` is False; gloo and the CPU otherwise (`backend`
    overrides the choice). Collectives wait at most `timeout` (see `resolve_timeout`: by default
    ``$NDPARALLEL_TIMEOUT`` or 10 minutes) for the other ranks, then fail; a process group that already exists
    keeps its own timeout. A process not started by a launcher becomes a world of one.
    """
    timeout = resolve_timeout(timeout)
    cpu = cpu or env_flag(CPU_ENV) or not torch.cuda.is_available()
    if not dist.is_initialized():
        if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise RuntimeError(
                f"incomplete launch environment: {', '.join(missing)} not set; start the script with "
                "`ndparallel launch` (or torchrun), or set all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"
            )
        backend = backend or ("gloo" if cpu else "nccl")
        if "nccl" in backend:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if _Released.count == 0:
            dist.init_process_group(backend, timeout=timeout)
        else:  # once more in this process, after `release_process_group`: see `_Released`
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
            store.set_timeout(timeout)
            dist.init_process_group(backend, store=dist.PrefixStore(f"ndparallel/{_Released.count}", store),
                                    rank=rank, world_size=world, timeout=timeout)
    release_at_exit()  # whoever started it: the library's groups hang off it
    backend = dist.get_backend()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if cpu or "nccl" not in str(backend):
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    device = _device_from_environment(device, str(backend))
    heartbeat("init_process_group")
    return Runtime(rank, world_size, local_rank, local_world_size, device, str(backend), timeout)


def _device_from_environment(default: torch.device, backend: str) -> torch.device:
    """``$NDPARALLEL_TORCH_DEVICE`` (or Accelerate's ``$ACCELERATE_TORCH_DEVICE``): this process's device instead of
    `default`, made current (``torch.<type>.set_device``); it must be of `default`'s type, the one the process
    group's backend serves."""
    name = next((n for n in DEVICE_ENVS if os.environ.get(n, "").strip()), None)
    if name is None:
        return default
    value = os.environ[name].strip()
    try:
        device = torch.device(value)
    except RuntimeError:
        raise ValueError(f"${name}={value!r} is not a torch device (e.g. {default})") from None
    if device.type != default.type:
        raise ValueError(f"${name}={value!r}: this process runs on {default.type} (process group backend "
                         f"{backend}), so its device must be a {default.type} device, e.g. {default}; unset ${name} "
                         "for the default")
    set_device = getattr(getattr(torch, device.type, None), "set_device", None)
    if set_device is not None and device.index is not None:
        set_device(device)
    return device


def group_name(group: dist.ProcessGroup | None) -> str | None:
    """The name torch registered `group` under in this process (None for None): how a group is pickled."""
    return None if group is None else dist.distributed_c10d._get_process_group_name(group)


def resolve_group(name: str | None) -> dist.ProcessGroup | None:
    """The process group named `name` in this process (`group_name`); a clear error where there is none (an object
    pickled in one process and unpickled in another that has not built the same groups)."""
    if name is None:
        return None
    try:
        return dist.distributed_c10d._resolve_process_group(name)
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError or KeyError depending on the version
        raise RuntimeError(f"process group {name!r} does not exist in this process: a prepared object that holds a "
                           "process group can only be unpickled where its Accelerator runs") from exc


class _Released:
    """How many times this process released a process group (`release_process_group`).

    torch's rendezvous keeps rank 0's store server for the life of the process (the next ``init_process_group`` on
    the same port reuses it, keys and all) and names a new world's groups as it named the last one's, so a second
    world would read the first one's keys (gloo's addresses, barrier counts) and hang in its first collective. The
    library's next world therefore puts its keys under a prefix of its own, the same on every rank (they release and
    start worlds in the same order)."""

    count = 0


def world_generation() -> int:
    """A number that changes with every world this process releases (`release_process_group`): state kept per world
    (the monitored barriers' count) starts again on every rank alike when it changes."""
    return _Released.count


def release_process_group() -> None:
    """Destroy the default process group (and every group made from it), if one exists, after freeing the finished
    gloo work objects that reference it. Local: no collective, so it cannot wait for another rank."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        _Released.count += 1


_registered = False


def release_at_exit() -> None:
    """Release a gloo process group at interpreter exit if the script did not (see the module's docstring). NCCL's
    is left to torch: destroying it while a peer has failed mid-collective can block, where its destructor does not."""
    global _registered
    if _registered:
        return
    _registered = True

    def release() -> None:
        try:
            if dist.is_initialized() and dist.get_backend() == "gloo":
                release_process_group()
        except Exception:  # noqa: BLE001 -- at exit, nothing is left to report to
            pass

    atexit.register(release)


# ---- heartbeat -------------------------------------------------------------------------------------------------
_RECORD_BYTES = 512  # every record is padded to this size, so each beat is one write at offset 0


class _Heartbeat:
    last: str = ""
    fd: int | None = None
    pid: int = -1
    host: str = ""
    call: str = ""
    since: float = 0.0
    written: float = 0.0


def last_library_call() -> str:
    """The name of the last library call this process made (`heartbeat`'s), "" before any."""
    return _Heartbeat.last


def heartbeat(call: str) -> None:
    """Tell ``ndparallel launch --stall-timeout`` that this rank is alive and in library call `call`.

    A no-op unless the launcher asked for heartbeats (``$NDPARALLEL_HEARTBEAT_DIR``). Otherwise one write of 512
    bytes to ``<dir>/rank_<RANK>.json`` when the call changes, or when a second has passed since the last write --
    a few microseconds, cheap enough for every training step. The launcher reports a rank whose record is older
    than the stall timeout, names the call it was last in, and stops the job.
    """
    _Heartbeat.last = call  # what `last_library_call` reports, launched with --stall-timeout or not
    directory = os.environ.get(HEARTBEAT_ENV)
    if not directory:
        return
    now = time.time()
    if call == _Heartbeat.call and now - _Heartbeat.written < 1.0 and _Heartbeat.pid == os.getpid():
        return
    if _Heartbeat.pid != os.getpid():  # first beat, or a forked child (a data-loader worker): its own record
        if _Heartbeat.pid != -1 and _Heartbeat.fd is not None:
            return  # a forked child is not a rank: only the process that opened the record writes it
        path = os.path.join(directory, f"rank_{os.environ.get('RANK', '0')}.json")
        try:
            _Heartbeat.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        except OSError:
            _Heartbeat.fd = None
        _Heartbeat.pid, _Heartbeat.host = os.getpid(), socket.gethostname()
    if _Heartbeat.fd is None:
        return
    if call != _Heartbeat.call:
        _Heartbeat.call, _Heartbeat.since = call, now
    record = json.dumps({"rank": int(os.environ.get("RANK", "0")), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                         "host": _Heartbeat.host, "pid": _Heartbeat.pid, "call": call[:200],
                         "since": _Heartbeat.since, "time": now,
                         "thread": threading.main_thread().ident}).encode()  # whose stack the launcher reads
    try:
        if hasattr(os, "pwrite"):
            os.pwrite(_Heartbeat.fd, record.ljust(_RECORD_BYTES), 0)
        else:  # Windows
            os.lseek(_Heartbeat.fd, 0, os.SEEK_SET)
            os.write(_Heartbeat.fd, record.ljust(_RECORD_BYTES))
    except OSError:
        return
    _Heartbeat.written = now
