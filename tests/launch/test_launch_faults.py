"""`ndparallel launch` when things go wrong around the ranks: the launcher killed (SIGKILL, and SIGTERM as before)
takes its ranks with it within seconds; nodes that never meet at the rendezvous, or that claim the same node rank,
end the launch within --rdzv-timeout with a message naming the endpoint, the node count and the node ranks; a rank
that stops making library calls is reported by --stall-timeout and the job exits non-zero."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import free_port

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "launch_faults.py")
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process and signal checks use Linux's /proc")


def launch(*args: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NDPARALLEL_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(extra_env or {})
    return subprocess.Popen([sys.executable, "-m", "ndparallel.cli", "launch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may wait for a reaper that a container lacks)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):  # gone (ProcessLookupError: reaped while reading)
        return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_ranks_end_with_their_launcher(tmp_path, sig):
    proc = launch("--nproc-per-node", "2", SCRIPT, "loop", "--pid-dir", str(tmp_path))
    pids: list[int] = []
    try:
        deadline = time.time() + 120
        while len(pids) < 2:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline, "the ranks never started"
            pids = [int(p.read_text()) for p in tmp_path.glob("rank_*.pid") if p.read_text()]
            time.sleep(0.1)
        time.sleep(0.5)  # the ranks are running their loop
        killed = time.time()
        proc.send_signal(sig)
        # The ranks loop forever: gone within 15 s means their launcher took them (a parent-death signal or the
        # SIGTERM it passes on, at once; the fallback watch, within a second), with room for a loaded machine.
        while any(running(pid) for pid in pids) and time.time() - killed < 15:
            time.sleep(0.1)
        assert not any(running(pid) for pid in pids), \
            f"ranks {pids} outlived their launcher ({sig.name}) by {time.time() - killed:.1f} s"
    finally:
        for pid in [*pids, proc.pid]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()


def _serving(port: int, proc: subprocess.Popen, within: float = 120) -> None:
    deadline = time.time() + within
    while True:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.time() < deadline, "node 0 never served the endpoint"
            time.sleep(0.1)


@pytest.mark.slow
def test_two_nodes_with_node_rank_0_on_one_host(tmp_path):
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    # The rendezvous would wait 600 s (--rdzv-timeout): the second node 0 ending within communicate's 120 s means it
    # was refused at once, however long a loaded machine takes to start its interpreter (not timed).
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-timeout", "600", SCRIPT,
              "loop", "--pid-dir", str(tmp_path)]
    first = launch("--node-rank", "0", *common)
    try:
        _serving(port, first)
        second = launch("--node-rank", "0", *common)
        out = second.communicate(timeout=120)[1]
        assert second.returncode == 1, out
        assert (f"ndparallel launch: error: port {port} of --rdzv-endpoint {endpoint} is already in use on this "
                "machine: another launch with --node-rank 0 holds it (two nodes claim node rank 0?), or another "
                "program does; give each of the 2 nodes its own --node-rank in 0..1, node 0 on 127.0.0.1") in out, out
        assert "Traceback" not in out
    finally:
        first.send_signal(signal.SIGTERM)  # still waiting for its node 1: it stops there
        first.communicate(timeout=60)
    assert not list(tmp_path.iterdir())  # no rank ever started


@pytest.mark.slow
def test_a_node_rank_claimed_twice_and_a_node_that_never_arrives(tmp_path):
    """Nodes 0, 1 and 1 again of --nnodes 3: the second node 1 is refused at once; the others time out waiting for
    node rank 2 and name the duplicate too. The timeout leaves room for slow interpreter starts on a busy machine."""
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    common = ["--nnodes", "3", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-timeout", "10", SCRIPT,
              "loop", "--pid-dir", str(tmp_path)]
    procs = [launch("--node-rank", str(rank), *common) for rank in (0, 1, 1)]
    # Ending within communicate's 120 s, each with the verdict "timed out after 10 s (--rdzv-timeout)", is the
    # behaviour: a launch that ignored --rdzv-timeout would wait the default 300 s. The time interpreters take to
    # start on a loaded machine is not timed.
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [1, 1, 1], errors
    taken = [e for e in errors if "node rank 1 is already taken by " in e]
    assert len(taken) == 1 and "claims it too: give each of the 3 nodes its own --node-rank in 0..2" in taken[0], errors
    for e in (e for e in errors if e not in taken):  # node 0 and the first node 1: the same verdict, node 0's
        assert (f"ndparallel launch: error: rendezvous at {endpoint} timed out after 10 s (--rdzv-timeout) with "
                "--nnodes 3: node rank 1 is claimed by 2 nodes: ") in e, e
        assert ("; 2 of 3 nodes arrived (node ranks [0, 1]); node rank(s) [2] never did. Start the missing node(s) "
                f"with --rdzv-endpoint {endpoint} --nnodes 3") in e, e
        assert "Traceback" not in e
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_a_stalled_rank_is_reported_and_the_job_exits_non_zero():
    proc = launch("--nproc-per-node", "2", "--stall-timeout", "2", SCRIPT, "stall")
    # Rank 1 sleeps 600 s: ending within communicate's 120 s means the stall watch stopped it (no speed is timed).
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert "ndparallel launch: rank 1 (host " in err and ") made no progress for 2 s (--stall-timeout 2): its last " \
        "library call was 'training step', entered " in err, err[-3000:]
    assert "The other ranks of this node were last heard: rank 0 in 'barrier' " in err
    assert "ndparallel launch: rank(s) [1] were stopped for making no progress (--stall-timeout)" in err


def test_the_stalled_rank_named_is_the_one_stuck_in_its_own_code():
    """Rank 1, stuck in its own code, was heard from after rank 0 went into a barrier for it: the one heard from
    longest ago is rank 0. The ranks' stacks tell them apart: rank 0 is named as only waiting, rank 1 is stopped."""
    proc = launch("--nproc-per-node", "2", "--stall-timeout", "3", SCRIPT, "stall-late")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert "its last library call was 'backward', entered " in err, err[-3000:]
    assert "; it is not in a collective but at launch_faults.py:" in err and " in <module>" in err, err[-3000:]
    assert "Rank(s) [0] only wait for it in collectives (rank 0 at " in err, err[-3000:]
    assert "ndparallel launch: rank(s) [1] were stopped for making no progress (--stall-timeout)" in err


def test_a_save_on_one_rank_is_named_in_every_ranks_error(tmp_path):
    """save_state under `if accelerator.is_main_process:` while rank 1 trains on: rank 0's error names the barrier,
    who did not come and the step that rank was in; rank 1's, raised inside an FSDP2 collective of its forward, says
    where it was and where rank 0 was -- in save_state -- instead of the backend's bare timeout
    (tests/core/test_failures.py has the cases in detail)."""
    proc = launch("--nproc-per-node", "2", SCRIPT, "save-on-one", "--out", str(tmp_path / "ckpt"),
                  extra_env={"NDPARALLEL_TIMEOUT": "5"})
    _, err = proc.communicate(timeout=180)
    assert proc.returncode != 0
    assert "monitored_barrier('save_state'): not every rank arrived within 5 s" in err, err[-4000:]
    assert re.search(r"rank 1 \([^)]*\): in 'forward' \(its step call #1\), whose collective failed", err), err[-4000:]
    assert "ndparallel: forward: the collective over ranks 0-1 failed after " in err, err[-4000:]
    assert re.search(r"rank 0 \([^)]*\): did not report being in a collective; (gave up )?waiting in monitored call "
                     r"'save_state'", err), err[-4000:]
