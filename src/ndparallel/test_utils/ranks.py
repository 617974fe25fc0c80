"""Run a function on N ranks forked from this (warm) process and collect their results.

Forking from a parent that has already imported torch and transformers is about 3x cheaper than spawning.
Each child gets torchrun's environment variables, runs `fn(*args)` and sends back its pickled return value or
its traceback; the parent re-raises the first failure and kills every rank that is still running after
`timeout` seconds, so a hung collective fails the caller instead of hanging it.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, results: mp.Queue,
           args: tuple, env: dict[str, str]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # The Accelerator reads NDPARALLEL_* (what `ndparallel launch` sets): ranks see none but those in `env`.
    for key in [k for k in os.environ if k.startswith("NDPARALLEL_")]:
        del os.environ[key]
    os.environ.update(env)
    torch.set_num_threads(1)
    # A rank that crashes in native code prints its Python stack (to the real stderr: capsys's has no file number).
    faulthandler.enable(file=sys.__stderr__, all_threads=True)
    try:
        payload = (rank, True, pickle.dumps(fn(*args)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        payload = (rank, False, traceback.format_exc())
    try:
        import torch.distributed as dist

        if payload[1] and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    results.put(payload)
    results.close()
    results.join_thread()
    os._exit(0)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0,
              env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args)`` on `world_size` forked ranks; return the list of their results, by rank."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, results, args, env or {}), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(out))
                # A rank that died without a result (a native crash, a kill) fails the test now, by name,
                # instead of leaving its peers blocked in a collective until the timeout.
                dead = [(r, procs[r].exitcode) for r in missing if procs[r].exitcode not in (None, 0)]
                if dead:
                    raise AssertionError("rank(s) died without a result: " + ", ".join(
                        f"rank {r} exit code {code}" + (f" ({signal.Signals(-code).name})" if code < 0 else "")
                        for r, code in dead))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {missing} of {world_size} gave no result within {timeout:.0f} s "
                                       "(a collective probably hangs)") from None
                continue
            if not ok:
                raise AssertionError(f"rank {rank} of {world_size} failed:\n{payload}")
            out[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]
