"""When a rank dies of a collective that did not complete, its error says where every rank was.

A collective made on some ranks only -- ``save_state`` under ``if accelerator.is_main_process:`` while the others
train on -- ends on the rank in the library's call with a clear error (`ndparallel.agreement.monitored_barrier`), but
the others die inside a raw collective of their training step (an FSDP2 all-gather, a DDP all-reduce) with the
backend's own words: gloo's ``Timed out waiting ...`` or ``Connection closed by peer``, nothing about ``save_state``.

`explain_collective_failures` (installed once per process when the library starts torch.distributed) adds to an
uncaught error of that kind, after its traceback: where this rank was (the innermost frame of the collective it
failed in, and its last library call) and where every rank was by its last monitored library call (from the
rendezvous store, which the launcher hosts), with the likely cause. Nothing runs while training goes well.
"""

from __future__ import annotations

import datetime
import re
import sys
import traceback
from types import TracebackType
from typing import Any

import torch.distributed as dist

from .agreement import CollectiveTimeoutError, where_ranks
from .runtime import last_library_call

# What the backends say when a collective fails for want of a peer (gloo's timeout and closed connections, NCCL's
# watchdog and communicator errors).
_COLLECTIVE_FAILURE = re.compile(r"Timed out waiting|Connection closed by peer|Connection reset by peer|"
                                 r"Socket Timeout|NCCL|ProcessGroupGloo|gloo/transport|DistBackendError")
_COLLECTIVE_CODE = ("/torch/distributed/", "/torch/nn/parallel/", "/ndparallel/")
_installed = False


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` is a backend's error for a collective that did not complete (not one the library explained)."""
    if isinstance(exc, CollectiveTimeoutError):
        return False
    return isinstance(exc, (RuntimeError, dist.DistError)) and bool(_COLLECTIVE_FAILURE.search(
        f"{type(exc).__name__}: {exc}"))


def _innermost_collective(tb: TracebackType | None) -> str | None:
    frames = [f for f in traceback.extract_tb(tb) if any(part in f.filename for part in _COLLECTIVE_CODE)
              and "/ndparallel/launch/worker.py" not in f.filename]
    if not frames:
        return None
    frame = frames[-1]
    return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}"


def explanation(exc: BaseException, tb: TracebackType | None) -> str:
    """What to add to the error: this rank's place, and every rank's last monitored library call."""
    rank = dist.get_rank() if dist.is_initialized() else None
    inside = _innermost_collective(tb)
    call = last_library_call()
    head = (f"ndparallel: rank {rank} stopped in a collective that did not complete"
            f"{f', inside {inside}' if inside else ''}{f' (its last library call: {call!r})' if call else ''}.")
    try:
        where = where_ranks(timeout=datetime.timedelta(seconds=5))
    except Exception as lost:  # noqa: BLE001 -- the store's host (rank 0 or the launcher) is gone
        return (f"{head} The rendezvous store is gone too ({type(lost).__name__}), so where the other ranks were is "
                "unknown: see rank 0's output and the launcher's.")
    return (f"{head} Where every rank was, by its last monitored library call:\n  {where}\nA rank that is waiting in "
            "a library call (save_state, wait_for_everyone, save_pretrained...) the others never made was given it "
            "under `if accelerator.is_main_process:` or an exception on that rank only: call it on every rank. A rank "
            "that stopped elsewhere failed or was stopped first: see its own output.")


def explain_collective_failures() -> None:
    """Install (once) the excepthook that explains an uncaught collective failure (see the module docstring)."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> Any:
        previous(kind, exc, tb)
        try:
            if is_collective_failure(exc):
                print(explanation(exc, tb), file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 -- the explanation must never hide the error itself
            pass

    sys.excepthook = hook
