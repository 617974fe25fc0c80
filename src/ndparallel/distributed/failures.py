"""When a collective does not complete, every rank's error says where every rank was.

A collective made on some ranks only -- ``save_state`` under ``if accelerator.is_main_process:`` while the others
train on -- ends on the rank in the library's call with a clear error
(`ndparallel.distributed.agreement.monitored_barrier`); the others fail inside a raw collective of their training step
(an FSDP2 all-gather, a DDP all-reduce) with the backend's own words: gloo's ``Timed out waiting ...`` or ``Connection
closed by peer``, nothing about ``save_state``. Three
layers turn those into errors that name the cause, and nothing of them runs while training goes well:

- `watched(call, ranks)`: around the Accelerator's own per-step collectives (gather, reduce, reduce_loss,
  gather_for_metrics, ...): a local count while they work; when the backend raises, `CollectiveTimeoutError`.
- `watch_training_step(model)` (the prepared model's forward, a hook that runs only when the forward raises) and
  `explained` (``accelerator.backward``, ``clip_grad_norm_``): their collectives are FSDP2's, DDP's, tensor and
  pipeline parallelism's, inside torch; a collective failure raised there keeps its type and gets the report
  appended to its message.
- `explain_collective_failures`, an excepthook: an uncaught collective failure raised anywhere else gets the same
  report (from every rank's last monitored library call) after its traceback.

The report (`failure_report`): this rank posts where it failed to the default store (`agreement.post_failure`), waits
up to a grace period (`agreement.grace_period`) for the other ranks of the collective to post theirs (or, for a rank
in a monitored call, to give up waiting in it: that rank posts nothing more and exits), and names the
call each rank was in, and for a rank that posted nothing, its last monitored call (a ``save_state`` it is waiting
in). A rank waiting in a `monitored_barrier` that times out reads the same posts, so it names the training step the
others were in. Within the timeout plus the grace period, on gloo; on NCCL where torch raises the failure (its
watchdog may stop the process instead: ``ndparallel launch --stall-timeout`` then reads the heartbeats).
"""

from __future__ import annotations

import datetime
import re
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .agreement import (
    STATES,
    CollectiveTimeoutError,
    barrier_places,
    failed_calls,
    grace_period,
    post_failure,
    rank_list,
    where_ranks,
    world_store,
)
from .runtime import heartbeat, last_library_call, resolve_timeout

# What the backends say when a collective fails for want of a peer (gloo's timeout and closed connections, NCCL's
# watchdog and communicator errors).
_COLLECTIVE_FAILURE = re.compile(r"Timed out waiting|Connection closed by peer|Connection reset by peer|"
                                 r"Socket Timeout|NCCL|ProcessGroupGloo|gloo/transport|DistBackendError")
_COLLECTIVE_CODE = ("/torch/distributed/", "/torch/nn/parallel/", "/ndparallel/")
_EXPLAINED = "_ndparallel_explained"  # set on an exception whose message carries the report
_installed = False


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` is a backend's error for a collective that did not complete (not one the library explained)."""
    if isinstance(exc, CollectiveTimeoutError) or getattr(exc, _EXPLAINED, False):
        return False
    return isinstance(exc, (RuntimeError, dist.DistError)) and bool(_COLLECTIVE_FAILURE.search(
        f"{type(exc).__name__}: {exc}"))


# ---- the report -------------------------------------------------------------------------------------------------------
class _Calls:
    seq: int = 0  # this rank's watched calls and failed step calls so far


def failure_report(call: str, seq: int, started: float, exc: BaseException, ranks: Sequence[int] | None = None,
                   timeout: datetime.timedelta | float | None = None) -> str:
    """Post that this rank's collective in `call` failed, wait up to the grace period for the other `ranks` (global
    ranks; default every rank) to post theirs, and say where each was (see the module docstring)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = sorted(ranks or range(world))
    error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    head = (f"{call}: the collective over {rank_list(ranks)} failed after {time.time() - started:.1f} s "
            f"({error[:300]})")
    try:
        store = world_store()
        post_failure(store, rank, seq, call, started)
        deadline = time.monotonic() + grace_period(resolve_timeout(timeout))
        # Wait for each other rank's own report, or for the sign that none is coming: a rank that gave up waiting in
        # a monitored call (a save_state the others skipped) raises at once and exits -- and the launcher then stops
        # this rank, so waiting out the grace period here would lose this rank's report.
        while (len((set(failed_calls(store, ranks)) | _gave_up(store, world)) & set(ranks)) < len(ranks)
               and time.monotonic() < deadline):
            time.sleep(0.05)  # polled: the store's own wait logs a warning when it times out
        posted, barriers = failed_calls(store, ranks), barrier_places(store, world)
    except Exception as lost:  # noqa: BLE001 - the store's host (rank 0 or the launcher) is gone
        return f"{head}; the rendezvous store is gone too ({type(lost).__name__}: {lost}): see rank 0's output"
    lines, silent = [], []
    for r in ranks:
        if r in posted:
            seq_r, call_r, host, started_r, _ = posted[r]
            lines.append(f"rank {r} ({host}): in {call_r!r} (its collective call #{seq_r}, for "
                         f"{time.time() - started_r:.1f} s)")
            continue
        silent.append(r)
        entry = barriers.get(r)
        last = "has made no monitored call" if entry is None else (
            f"{STATES[entry[2]]} monitored call {entry[1]!r} ({time.time() - entry[4]:.0f} s ago)")
        where = f" ({entry[3]})" if entry is not None else ""
        lines.append(f"rank {r}{where}: did not report being in a collective; {last}")
    calls: dict[str, list[int]] = {}
    for r in sorted(posted):
        calls.setdefault(repr(posted[r][1]), []).append(r)
    summary = "; ".join(f"{rank_list(rs)} in {c}" for c, rs in calls.items())
    summary += f"; {rank_list(silent)} did not report" if silent else ""
    hints = []
    if len(calls) > 1:
        hints.append("the ranks called different collectives: call gather / reduce in the same order on every "
                     "rank of the group")
    if silent:
        hints.append("a rank that did not report is busy outside the library's collectives (raise the timeout: "
                     "NDPARALLEL_TIMEOUT / InitProcessGroupKwargs(timeout=...)), stuck, or skipped this call (a "
                     "collective call -- save_state, wait_for_everyone, gather / reduce -- under `if "
                     "accelerator.is_main_process:`, or an exception on that rank only: see its own output)")
    return f"{head}: {summary}.\n  " + "\n  ".join(lines) + "".join(f"\n{h[0].upper()}{h[1:]}." for h in hints)


def _gave_up(store: Any, world: int) -> set[int]:
    """The ranks whose last monitored call says they gave up waiting in it (`agreement.monitored_barrier`)."""
    return {rank for rank, entry in barrier_places(store, world).items() if entry[2] == "gave up"}


# ---- the Accelerator's per-step collectives ---------------------------------------------------------------------------
def watched(call: str, ranks: Callable[[], Sequence[int]] | Sequence[int] | None = None,
            timeout: datetime.timedelta | float | None = None) -> _Watch:
    """A context manager around one of the Accelerator's per-step collectives (``with watched("reduce", ...):``).

    While the collective works: a local count and `ndparallel.distributed.runtime.heartbeat` (about a microsecond, no
    communication). When the backend raises (a collective timeout -- gloo raises RuntimeError ``Timed out waiting
    ...`` after the process group's timeout -- or a peer's connection closing), `CollectiveTimeoutError` with
    `failure_report` over `ranks` (their global ranks, or a callable giving them, asked only then; default every rank),
    chained to the backend's error. Calls are numbered among this rank's watched calls, so a call made on some ranks
    only shows as differing numbers. A rank that entered its own watched call more than the grace period after this
    one, and is stuck there, shows as not posting.
    """
    return _Watch(call, ranks, timeout)


class _Watch:
    __slots__ = ("call", "ranks", "seq", "started", "timeout")

    def __init__(self, call: str, ranks: Any, timeout: datetime.timedelta | float | None) -> None:
        self.call, self.ranks, self.timeout = call, ranks, timeout

    def __enter__(self) -> None:
        _Calls.seq += 1
        self.seq, self.started = _Calls.seq, time.time()
        heartbeat(self.call)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        if exc is None or not isinstance(exc, RuntimeError) or isinstance(exc, torch.OutOfMemoryError) \
                or not (dist.is_available() and dist.is_initialized()):
            return False
        ranks = self.ranks() if callable(self.ranks) else self.ranks
        raise CollectiveTimeoutError(failure_report(self.call, self.seq, self.started, exc, ranks,
                                                    self.timeout)) from exc


# ---- the training step: forward, backward, clipping --------------------------------------------------------------------
def explain(exc: BaseException, call: str, started: float, timeout: datetime.timedelta | float | None = None) -> None:
    """If `exc` is a collective failure, append `failure_report` to its message, in place (it keeps its type, so
    code that catches it still does). Once per exception; never raises."""
    if not is_collective_failure(exc) or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        _Calls.seq += 1
        report = failure_report(call, _Calls.seq, started, exc, None, timeout)
        first = str(exc.args[0]) if exc.args else ""
        exc.args = (f"{first}\nndparallel: {report}", *exc.args[1:])
        setattr(exc, _EXPLAINED, True)
    except Exception:  # noqa: BLE001 -- the explanation must never hide the error itself
        pass


class explained:  # noqa: N801 - used as a context manager, like contextlib's
    """``with explained("backward", timeout):`` -- a collective failure raised inside gets `explain`\\ ed."""

    __slots__ = ("call", "started", "timeout")

    def __init__(self, call: str, timeout: datetime.timedelta | float | None = None) -> None:
        self.call, self.timeout = call, timeout

    def __enter__(self) -> None:
        self.started = time.time()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        if exc is not None:
            explain(exc, self.call, self.started, self.timeout)
        return False


class _Forward:
    started: float = 0.0


def _forward_begins(module: nn.Module, args: Any) -> None:
    _Forward.started = time.time()


def _forward_ended(module: nn.Module, args: Any, output: Any) -> None:
    exc = sys.exc_info()[1]  # set only when the forward raised (torch calls this hook from its except clause)
    if exc is not None and output is None:
        explain(exc, "forward", _Forward.started, getattr(module, "_ndparallel_timeout", None))


def watch_training_step(model: nn.Module, timeout: datetime.timedelta | float | None = None) -> None:
    """Hooks on a prepared model so that a collective failure raised in its forward (FSDP2's all-gathers, DDP's
    buffer broadcast, tensor and pipeline parallelism's collectives) gets `explain`\\ ed: a pre-hook first of all
    (one clock read) and a forward hook torch calls even when the forward raises (``always_call``)."""
    model._ndparallel_timeout = timeout
    model.register_forward_pre_hook(_forward_begins, prepend=True)
    model.register_forward_hook(_forward_ended, always_call=True)


# ---- anything else: the excepthook ------------------------------------------------------------------------------------
def _innermost_collective(tb: TracebackType | None) -> str | None:
    frames = [f for f in traceback.extract_tb(tb) if any(part in f.filename for part in _COLLECTIVE_CODE)
              and "/ndparallel/launch/worker.py" not in f.filename]
    if not frames:
        return None
    frame = frames[-1]
    return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}"


def explanation(exc: BaseException, tb: TracebackType | None) -> str:
    """What to add to an uncaught error: this rank's place, and every rank's last monitored library call."""
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


__all__ = ["explain", "explain_collective_failures", "explained", "failure_report", "is_collective_failure",
           "watch_training_step", "watched"]
