"""What `ndparallel launch` does beside torchrun while the ranks run: the roll call of a multi-node launch's nodes
(`RollCall`) and the watch for ranks that make no progress (`StallWatch`, ``--stall-timeout``)."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .worker import STACK_SIGNAL, alive


class LaunchError(RuntimeError):
    """The launch cannot go on (nodes that do not meet); the message says why and what to do."""


def note(message: str) -> None:
    """Say `message` on the launcher's stderr."""
    print(f"ndparallel launch: {message}", file=sys.stderr, flush=True)


@dataclass
class RollCall:
    """The nodes of a static multi-node launch meet before torchrun starts: each registers its ``--node-rank`` at
    ``--rdzv-endpoint`` (a TCPStore that node 0 serves -- ``multi_tenant``, so torchrun's own store on that port is
    the same server, kept up for the whole job) and waits until all `nnodes` have, at most `timeout` seconds.

    Refused, each with a message naming the endpoint, the node count and the node ranks: a node rank claimed twice
    (also by a node arriving late), node 0 started on a host that is not the endpoint's, the endpoint's port taken
    on node 0's host, node 0 unreachable, and nodes that do not arrive in time."""

    host: str
    port: int
    nnodes: int
    node_rank: int
    timeout: float
    run_id: str
    store: Any = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def _key(self, *parts: Any) -> str:
        return "/".join(["ndparallel/rollcall", self.run_id, *map(str, parts)])

    def _fix(self) -> str:
        return (f"give each of the {self.nnodes} nodes its own --node-rank in 0..{self.nnodes - 1}, node 0 on "
                f"{self.host}, all with --rdzv-endpoint {self.endpoint} --nnodes {self.nnodes}")

    def _serve(self) -> Any:
        from torch.distributed import DistNetworkError, TCPStore

        try:
            addresses = {info[4][0] for info in socket.getaddrinfo(self.host, None, proto=socket.IPPROTO_TCP)}
        except OSError as exc:
            raise LaunchError(f"--rdzv-endpoint {self.endpoint}: cannot resolve {self.host!r} ({exc})") from None
        local = False
        for address in addresses:
            with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as probe:
                try:
                    probe.bind((address, 0))
                    local = True
                except OSError:
                    pass
        if not local:
            raise LaunchError(f"this node has --node-rank 0, which hosts the rendezvous at {self.endpoint}, but "
                              f"{self.host} is not an address of this machine ({socket.gethostname()}): start node 0 "
                              f"on {self.host}, or {self._fix()}")
        try:
            return TCPStore(self.host, self.port, None, True, datetime.timedelta(seconds=self.timeout),
                            wait_for_workers=False, multi_tenant=True)
        except DistNetworkError as exc:
            if "EADDRINUSE" not in str(exc) and "in use" not in str(exc):
                raise LaunchError(f"cannot serve the rendezvous at {self.endpoint}: {exc}") from None
            raise LaunchError(f"port {self.port} of --rdzv-endpoint {self.endpoint} is already in use on this machine: "
                              "another launch with --node-rank 0 holds it (two nodes claim node rank 0?), or another "
                              f"program does; {self._fix()}, or pick a free port") from None

    def _connect(self, deadline: float) -> Any:
        from torch.distributed import TCPStore

        next_note = time.monotonic() + 30
        while True:  # a plain socket first: TCPStore's own retries print a C++ traceback on every attempt
            try:
                socket.create_connection((self.host, self.port), timeout=1.0).close()
                break
            except OSError:
                if time.monotonic() >= deadline:
                    raise LaunchError(
                        f"could not reach the rendezvous at {self.endpoint} within {self.timeout:g} s (--rdzv-timeout) "
                        f"from node rank {self.node_rank} of {self.nnodes}: node 0 (--node-rank 0, on {self.host}) has "
                        "not started, or the address is wrong or blocked by a firewall") from None
                if time.monotonic() >= next_note:
                    note(f"node rank {self.node_rank}: waiting for node 0 at {self.endpoint}")
                    next_note += 30
                time.sleep(0.5)
        remaining = max(1.0, deadline - time.monotonic())
        return TCPStore(self.host, self.port, None, False, datetime.timedelta(seconds=remaining),
                        wait_for_workers=False)

    def _claims(self) -> dict[int, list[str]]:
        """Node rank -> the nodes ("host (pid N)") that claimed it."""
        out = {}
        for rank in range(self.nnodes):
            count = self.store.add(self._key("node", rank), 0)
            out[rank] = [self.store.get(self._key("node", rank, i)).decode() for i in range(1, count + 1)]
        return out

    def _problems(self, claims: dict[int, list[str]]) -> str:
        missing = [r for r, nodes in claims.items() if not nodes]
        parts = [f"node rank {r} is claimed by {len(nodes)} nodes: {', '.join(nodes)}"
                 for r, nodes in claims.items() if len(nodes) > 1]
        if missing:
            arrived = [r for r, nodes in claims.items() if nodes]
            parts.append(f"{len(arrived)} of {self.nnodes} nodes arrived (node ranks {arrived}); node rank(s) "
                         f"{missing} never did")
        return "; ".join(parts)

    def hold(self) -> None:
        """Register this node and wait for the others; raise `LaunchError` saying what went wrong.

        Node 0 decides a timeout and posts its verdict for the others (whose own deadline is a few seconds later),
        so every node that arrived reports the same missing and duplicate node ranks."""
        from torch.distributed import DistError

        try:
            self._hold()
        except DistError as exc:
            raise LaunchError(f"lost the rendezvous at {self.endpoint} (--nnodes {self.nnodes}): node 0 ended or "
                              f"is unreachable ({str(exc).splitlines()[0]}); see node 0's output") from None

    def _hold(self) -> None:
        deadline = time.monotonic() + self.timeout
        me = f"{socket.gethostname()} (pid {os.getpid()})"
        self.store = self._serve() if self.node_rank == 0 else self._connect(deadline)
        if self.node_rank != 0:
            deadline += 5.0  # node 0 gives the verdict on the roll call; the others wait a little longer for it
        claim = self.store.add(self._key("node", self.node_rank), 1)
        self.store.set(self._key("node", self.node_rank, claim), me)
        if claim > 1:
            first = self.store.get(self._key("node", self.node_rank, 1)).decode()
            raise LaunchError(f"rendezvous at {self.endpoint} (--nnodes {self.nnodes}): node rank {self.node_rank} is "
                              f"already taken by {first}; this node ({me}) claims it too: {self._fix()}")
        arrived = self.store.add(self._key("count"), 1)
        verdict, next_note = self._key("verdict"), time.monotonic() + 10
        while arrived < self.nnodes:
            if self.node_rank != 0 and self.store.check([verdict]):
                self.store.add(self._key("verdict", "read"), 1)
                raise LaunchError(self.store.get(verdict).decode())
            if time.monotonic() >= deadline:
                message = (f"rendezvous at {self.endpoint} timed out after {self.timeout:g} s (--rdzv-timeout) with "
                           f"--nnodes {self.nnodes}: {self._problems(self._claims())}. Start the missing node(s) with "
                           f"--rdzv-endpoint {self.endpoint} --nnodes {self.nnodes}, or check that they can reach "
                           f"{self.endpoint}")
                if self.node_rank == 0:  # let the nodes that did arrive read the same verdict before the store goes
                    self.store.set(verdict, message)
                    until = time.monotonic() + 5
                    while self.store.add(self._key("verdict", "read"), 0) < arrived - 1 and time.monotonic() < until:
                        time.sleep(0.05)
                raise LaunchError(message)
            if time.monotonic() >= next_note:
                claims = self._claims()
                note(f"waiting at {self.endpoint}: {sum(1 for n in claims.values() if n)} of {self.nnodes} nodes "
                      f"arrived (node ranks {[r for r, n in claims.items() if n]})")
                next_note += 30
            time.sleep(0.1)
            arrived = self.store.add(self._key("count"), 0)
        if self.node_rank != 0:
            self.store = None  # node 0 keeps serving (torchrun's store is the same server); the others let go


@dataclass
class StallWatch:
    """In the launcher: reads the heartbeats of this node's ranks (``<directory>/rank_<r>.json``, written by
    `ndparallel.distributed.runtime.heartbeat`) every few seconds; when one is older than `timeout` seconds and its
    process is alive, reports it -- rank, host, pid, last library call, and what the other ranks of the node last did --
    and kills it with SIGKILL: torchrun then stops the other ranks and ends the job non-zero, or restarts it under
    ``--max-restarts``. Ranks that never made a library call are not watched."""

    directory: Path
    timeout: float
    stopped_ranks: list[int] = field(default_factory=list)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    def records(self) -> list[dict[str, Any]]:
        out = []
        for path in self.directory.glob("rank_*.json"):
            try:
                record = json.loads(path.read_bytes().strip())
            except (OSError, ValueError):
                continue  # being written
            if alive(int(record["pid"])):
                out.append(record)
        return out

    def check(self) -> str | None:
        """Report and stop the stalled rank, if one is past the timeout; return the report.

        Every rank past the timeout is asked for its Python stack (`stacks`): a rank blocked in a collective (torch's
        distributed code, or one of the library's calls, is on its stack) is only waiting for another; the one to
        stop is the stalled rank that is not -- stuck in its own code. While every stalled rank waits and some rank
        is still within the timeout (the one they wait for, stuck since its last call), the verdict waits for that
        one to pass the timeout too; when all wait (a deadlock among collectives), or after twice the timeout, the
        rank heard from longest ago is stopped."""
        now = time.time()
        records = sorted(self.records(), key=lambda r: r["rank"])
        stale = sorted((r for r in records if now - r["time"] > self.timeout), key=lambda r: r["time"])
        if not stale:
            return None
        stacks = self.stacks(stale)
        waiting = {r["rank"]: _collective_frame(stacks.get(r["rank"])) for r in stale}
        elsewhere = [r for r in stale if stacks.get(r["rank"]) and waiting[r["rank"]] is None]
        if not elsewhere and len(stale) < len(records) and now - stale[0]["time"] < 2 * self.timeout:
            return None  # the stalled ranks wait for one not yet past the timeout: it is the one to name
        culprit = (elsewhere or stale)[0]
        others = "; ".join(f"rank {r['rank']} in {r['call']!r} {now - r['time']:.0f} s ago" for r in records
                           if r is not culprit) or "none"
        where = ""
        if culprit in elsewhere:
            where = f"; it is not in a collective but at {_frame(stacks[culprit['rank']][0])}"
        waiters = [r["rank"] for r in stale if r is not culprit and waiting[r["rank"]] is not None]
        waiting_for_it = (f" Rank(s) {waiters} only wait for it in collectives ("
                          + "; ".join(f"rank {w} at {_frame(waiting[w])}" for w in waiters) + ")." if waiters else "")
        report = (f"rank {culprit['rank']} (host {culprit['host']}, pid {culprit['pid']}) made no progress for "
                  f"{now - culprit['time']:.0f} s (--stall-timeout {self.timeout:g}): its last library call was "
                  f"{culprit['call']!r}, entered {now - culprit['since']:.0f} s ago{where}. The other ranks of this "
                  f"node were last heard: {others}.{waiting_for_it} Stopping rank {culprit['rank']}: the job ends with "
                  "a non-zero exit, or restarts under --max-restarts")
        note(report)
        self.stopped_ranks.append(int(culprit["rank"]))
        try:
            os.kill(int(culprit["pid"]), signal.SIGKILL)
        except ProcessLookupError:
            pass
        for path in [*self.directory.glob("rank_*.json"), *self.directory.glob("stack_*.txt")]:
            path.unlink(missing_ok=True)  # the next attempt starts afresh
        return report

    def stacks(self, ranks: list[dict[str, Any]], wait: float = 1.0) -> dict[int, list[str]]:
        """The main thread's Python stack of each of `ranks` (frames innermost first, as ``File "...", line N in f``),
        asked with `worker.STACK_SIGNAL` (each rank's faulthandler writes ``stack_<rank>.txt``); ranks that do not
        answer within `wait` seconds are left out."""
        if STACK_SIGNAL is None:
            return {}
        asked = {}
        for record in ranks:
            path = self.directory / f"stack_{record['rank']}.txt"
            if not path.exists():
                continue  # a rank whose worker does not answer (started before its file existed)
            size = path.stat().st_size
            try:
                os.kill(int(record["pid"]), STACK_SIGNAL)
            except ProcessLookupError:
                continue
            asked[record["rank"]] = (path, size, record.get("thread"))
        deadline = time.monotonic() + wait
        out: dict[int, list[str]] = {}
        while asked and time.monotonic() < deadline:
            time.sleep(0.05)
            for rank, (path, size, thread) in list(asked.items()):
                text = path.read_text(errors="replace")[size:]
                frames = _main_thread_frames(text, thread)
                if frames:
                    out[rank] = frames
                    del asked[rank]
        return out

    def _run(self) -> None:
        poll = min(max(self.timeout / 4, 0.2), 5.0)
        while not self._done.wait(poll):
            self.check()

    def start(self) -> None:
        threading.Thread(target=self._run, name="ndparallel-stall-watch", daemon=True).start()

    def stop(self) -> None:
        self._done.set()
        shutil.rmtree(self.directory, ignore_errors=True)


def _main_thread_frames(dump: str, thread: int | None) -> list[str]:
    """From a faulthandler dump, the frames (innermost first) of thread `thread` (the main thread's ident), or of the
    first thread listed when the ident is unknown."""
    blocks = [b for b in dump.split("\n\n") if "(most recent call first)" in b]
    for block in blocks:
        head, *lines = block.strip().splitlines()
        if thread is None or f"0x{thread:016x}" in head:  # "[Current t|T]hread 0x... (most recent call first):"
            return [line.strip() for line in lines if line.strip().startswith("File ")]
    return []


_LIBRARY_COLLECTIVES = ("/torch/distributed/", "/torch/nn/parallel/", "/ndparallel/")


def _collective_frame(frames: list[str] | None) -> str | None:
    """The innermost frame of `frames` in a collective (torch's distributed code or a library call), or None."""
    for frame in frames or []:
        if any(part in frame for part in _LIBRARY_COLLECTIVES) and "/ndparallel/launch/worker.py" not in frame:
            return frame
    return None


def _frame(frame: str) -> str:
    """``File "/a/b/c.py", line 12 in f`` as ``c.py:12 in f``."""
    match = re.match(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+)', frame)
    return f"{Path(match['file']).name}:{match['line']} in {match['func']}" if match else frame
