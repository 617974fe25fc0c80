"""``ndparallel launch --fault-tolerant``: the replicated axis as torchft replica groups that outlive each other.

The launch's layout (say ``--dp-replicate-size 2 --dp-shard-size 2`` on 4 processes) becomes R = dp_replicate_size
groups of world/R processes. This process starts torchft's lighthouse (unless ``--lighthouse`` names one already
running), then each group as its own torchrun job -- its own rendezvous store and process group, restarted alone
(``--max-restarts`` per group) when one of its ranks fails -- and waits for them. Inside a group the script runs
unchanged: `ndparallel.fault_tolerance` reads the variables set here and averages gradients across the groups.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from ..fault_tolerance.replica_groups import require_torchft
from ..fault_tolerance.settings import (
    JOIN_TIMEOUT,
    LIGHTHOUSE_ENV,
    MIN_REPLICAS_ENV,
    QUORUM_TIMEOUT_ENV,
    REPLICA_ID_ENV,
    REPLICAS_ENV,
    START_STORE_ENV,
    TIMEOUT_ENV,
)
from .supervision import note

DEFAULT_RESTARTS = 3  # per group, when --max-restarts is not given: a dead group comes back


@dataclass
class ReplicaLaunch:
    """What `run` starts: R groups of `group_size` processes, each restarted up to `restarts` times."""

    replicas: int
    group_size: int
    restarts: int
    min_replicas: int
    quorum_timeout: float | None
    timeout: float | None
    lighthouse: str | None  # None: start one here


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("fault tolerance (torchft replica groups; docs/failures.md)")
    group.add_argument("--fault-tolerant", action="store_true", default=False,
                       help="run the dp_replicate_size replicas as torchft replica groups: a group that fails is "
                            "restarted alone and takes the live state from a healthy one while the others go on")
    group.add_argument("--min-replicas", type=int, default=1, metavar="N",
                       help="with --fault-tolerant: the fewest replica groups a step is taken with (default 1)")
    group.add_argument("--quorum-timeout", type=float, default=None, metavar="SECONDS",
                       help="with --fault-tolerant: how long a group waits for the others to agree on a step "
                            "(default 60)")
    group.add_argument("--ft-timeout", type=float, default=None, metavar="SECONDS",
                       help="with --fault-tolerant: how long a cross-group all-reduce or state transfer may take "
                            "before the step is given up (default 60)")
    group.add_argument("--lighthouse", default=None, metavar="HOST:PORT",
                       help="with --fault-tolerant: a torchft lighthouse already running (default: start one here)")


def plan_replicas(args: argparse.Namespace, dp_replicate: int, nproc: int, nnodes: int,
                  max_restarts: int | None) -> ReplicaLaunch | None:
    """The groups to start, or None without --fault-tolerant; raises on settings that cannot work, before any
    process starts."""
    given = [flag for flag, value in (("--min-replicas", args.min_replicas != 1), ("--lighthouse", args.lighthouse),
                                      ("--quorum-timeout", args.quorum_timeout), ("--ft-timeout", args.ft_timeout))
             if value]
    if not args.fault_tolerant:
        if given:
            raise ValueError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for --fault-tolerant runs; "
                             "add --fault-tolerant or drop them")
        return None
    replicas = dp_replicate
    if replicas < 2:
        raise ValueError("--fault-tolerant needs replica groups: give --dp-replicate-size R with R >= 2 (the groups "
                         "that keep training when one fails); the other sizes are each group's layout")
    if nnodes > 1:
        raise ValueError(f"--fault-tolerant starts every replica group on this node; with --nnodes {nnodes} start "
                         "them yourself (one torchrun per group with NDPARALLEL_FT_REPLICA_ID, NDPARALLEL_FT_REPLICAS "
                         "and TORCHFT_LIGHTHOUSE set; docs/failures.md)")
    if nproc % replicas:
        raise ValueError(f"--fault-tolerant: {nproc} processes do not split into {replicas} equal replica groups")
    if not 1 <= args.min_replicas <= replicas:
        raise ValueError(f"--min-replicas must be in 1..{replicas} (the replica groups), got {args.min_replicas}")
    for flag, value in (("--quorum-timeout", args.quorum_timeout), ("--ft-timeout", args.ft_timeout)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0 seconds, got {value:g}")
    if args.stall_timeout is not None:
        raise ValueError("--stall-timeout does not apply to --fault-tolerant runs (a stuck replica group is left "
                         "out of the quorum after --quorum-timeout); drop one of them")
    require_torchft()
    return ReplicaLaunch(replicas, nproc // replicas, DEFAULT_RESTARTS if max_restarts is None else max_restarts,
                         args.min_replicas, args.quorum_timeout, args.ft_timeout, args.lighthouse)


def run(replicas: ReplicaLaunch, env: dict[str, str | None], worker_args: list[str]) -> int:
    """Start the lighthouse and the groups; wait for every group; return 0, or the first failed group's code."""
    lighthouse, address = None, replicas.lighthouse
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum and commit at info
    if address is None:
        from torchft._torchft import LighthouseServer

        # join_timeout: how long the first quorum waits for every group before starting with min_replicas
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=replicas.min_replicas,
                                      join_timeout_ms=int(JOIN_TIMEOUT * 1000))
        address = lighthouse.address()
    # Where the groups meet before the job's first quorum (`ReplicaGroups._meet_every_group`): the lighthouse waits
    # only for the groups it has heard from, so a group slower to start would find the others trained on alone.
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = {key: value for key, value in {**os.environ, **env}.items() if value is not None}
    # A restarted group must not find its dead ranks' addresses in the rendezvous store (`launcher.RESTART_STORE_ENV`)
    base.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    base.update({REPLICAS_ENV: str(replicas.replicas), LIGHTHOUSE_ENV: address,
                 MIN_REPLICAS_ENV: str(replicas.min_replicas), START_STORE_ENV: f"127.0.0.1:{store.port}"})
    for var, value in ((QUORUM_TIMEOUT_ENV, replicas.quorum_timeout), (TIMEOUT_ENV, replicas.timeout)):
        if value is not None:
            base[var] = str(value)
    note(f"fault tolerant: {replicas.replicas} replica groups of {replicas.group_size} process(es), lighthouse "
         f"{address}, each group restarted up to {replicas.restarts} time(s)")
    groups = []
    for replica in range(replicas.replicas):
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={replicas.group_size}",
                   "--nnodes=1", f"--max-restarts={replicas.restarts}", "--standalone", *worker_args]
        groups.append(subprocess.Popen(command, env={**base, REPLICA_ID_ENV: str(replica)}))
    codes: dict[int, int] = {}
    try:
        while len(codes) < len(groups):
            for replica, proc in enumerate(groups):
                if replica not in codes and proc.poll() is not None:
                    codes[replica] = proc.returncode
                    if proc.returncode:
                        note(f"replica group {replica} failed with exit code {proc.returncode} after its restarts; "
                             "the other groups go on while they are at least --min-replicas")
            time.sleep(0.2)
    finally:
        for proc in groups:
            if proc.poll() is None:
                proc.terminate()
        if lighthouse is not None:
            lighthouse.shutdown()
    failed = [code for code in codes.values() if code]
    return failed[0] if failed else 0
