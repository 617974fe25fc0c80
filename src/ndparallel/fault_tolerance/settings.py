"""`FaultToleranceKwargs`: replica groups that keep training when one of them fails (torchft).

``ndparallel launch --fault-tolerant`` starts torchft's lighthouse and each replica group as a job of its own, and
passes each process what it needs in the variables below; a script needs no change (``Accelerator()`` reads them). A
script may pass ``FaultToleranceKwargs(...)`` in ``kwargs_handlers`` to set the step's rules (minimum replicas,
timeouts, where the participation log goes); the launch still says which group this process belongs to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..configuration.plugins import KwargsHandler

REPLICAS_ENV = "NDPARALLEL_FT_REPLICAS"  # number of replica groups (the job's dp_replicate_size)
REPLICA_ID_ENV = "NDPARALLEL_FT_REPLICA_ID"  # this process's group, 0 .. replicas-1
MIN_REPLICAS_ENV = "NDPARALLEL_FT_MIN_REPLICAS"
QUORUM_TIMEOUT_ENV = "NDPARALLEL_FT_QUORUM_TIMEOUT"
TIMEOUT_ENV = "NDPARALLEL_FT_TIMEOUT"
LOG_ENV = "NDPARALLEL_FT_LOG"  # directory of the participation log
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own name for the lighthouse's address
START_STORE_ENV = "NDPARALLEL_FT_START_STORE"  # host:port of the launcher's store where the groups meet at the start
JOIN_TIMEOUT = 60.0  # seconds the job's first quorum waits for every group (the lighthouse's join timeout too)


@dataclass
class FaultToleranceKwargs(KwargsHandler):
    """Fault-tolerant data parallelism over replica groups (`ndparallel.fault_tolerance`).

    The replicated axis (``dp_replicate_size``) runs as torchft replica groups: each group is a job of its own
    (FSDP2, TP, CP, SP inside it as configured), gradients are averaged over the groups that take part in a step, and
    a group that fails is restarted and takes the live state from a healthy one, while the others keep stepping.

    Attributes:
        min_replicas: the fewest groups a step may be taken with (torchft's ``min_replica_size``); a step with fewer
            is not committed (the optimizer does not step) and the groups wait for the next quorum.
        quorum_timeout: seconds a group waits for the other groups to agree on a step's members.
        timeout: seconds any cross-group operation (the gradient all-reduce, fetching a peer's state) may take before
            the step is given up (not committed) and the group moves on.
        participation_log: a directory where each group's first rank appends one JSON line per step (which groups
            took part, whether it was committed, the group's loss); None: ``$NDPARALLEL_FT_LOG``, else no file (the
            records stay in `ReplicaGroups.records`).
        replica_id, replicas, lighthouse: where this process belongs -- set by ``ndparallel launch
            --fault-tolerant`` (``$NDPARALLEL_FT_REPLICA_ID``, ``$NDPARALLEL_FT_REPLICAS``, ``$TORCHFT_LIGHTHOUSE``);
            give them only when starting the groups yourself (one torchrun per group).
    """

    min_replicas: int | None = None
    quorum_timeout: float | None = None
    timeout: float | None = None
    participation_log: str | None = None
    replica_id: int | None = None
    replicas: int | None = None
    lighthouse: str | None = None

    def __post_init__(self) -> None:
        for name, low in (("min_replicas", 1), ("replica_id", 0), ("replicas", 1)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"FaultToleranceKwargs.{name} must be an int >= {low}, got {value!r}")
        for name in ("quorum_timeout", "timeout"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"FaultToleranceKwargs.{name} must be a number of seconds > 0, got {value!r}")

    @classmethod
    def from_env(cls, handler: FaultToleranceKwargs | None,
                 environ: Mapping[str, str]) -> FaultToleranceKwargs | None:
        """The settings of this process: `handler`'s fields, the launcher's variables for those it leaves unset, the
        defaults for the rest; None when neither a handler nor ``ndparallel launch --fault-tolerant`` asks for fault
        tolerance. Raises naming what is missing when it is asked for but this process's group is not known."""
        if handler is None and not environ.get(REPLICAS_ENV):
            return None
        given: dict[str, Any] = {f.name: getattr(handler, f.name) for f in fields(cls)} if handler else {}
        read = {"replicas": (REPLICAS_ENV, int), "replica_id": (REPLICA_ID_ENV, int),
                "min_replicas": (MIN_REPLICAS_ENV, int), "quorum_timeout": (QUORUM_TIMEOUT_ENV, float),
                "timeout": (TIMEOUT_ENV, float), "participation_log": (LOG_ENV, str),
                "lighthouse": (LIGHTHOUSE_ENV, str)}
        values: dict[str, Any] = {}
        for name, (var, kind) in read.items():
            value = given.get(name)
            if value is None and environ.get(var):
                try:
                    value = kind(environ[var])
                except ValueError:
                    raise ValueError(f"${var}={environ[var]!r} is not a valid {kind.__name__}") from None
            values[name] = value
        missing = [f"{name} (${read[name][0]})" for name in ("replicas", "replica_id", "lighthouse")
                   if values[name] is None]
        if missing:
            raise ValueError(
                "FaultToleranceKwargs: fault tolerance needs to know this process's replica group, but "
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set; launch with "
                "`ndparallel launch --fault-tolerant --dp-replicate-size R ...`, which starts the lighthouse and the "
                "groups and sets them")
        out = cls(**{**values, "min_replicas": values["min_replicas"] or 1,
                     "quorum_timeout": values["quorum_timeout"] or 60.0, "timeout": values["timeout"] or 60.0})
        if out.replica_id >= out.replicas:
            raise ValueError(f"fault tolerance: replica_id {out.replica_id} is not one of the {out.replicas} groups "
                             f"(0 .. {out.replicas - 1})")
        if out.min_replicas > out.replicas:
            raise ValueError(f"fault tolerance: min_replicas={out.min_replicas} is more than the {out.replicas} "
                             "replica groups; no step could ever be taken")
        return out


def replica_group_config(config: Any, replicas: int) -> Any:
    """The `ParallelismConfig` one replica group runs: `config` with ``dp_replicate_size`` 1 (the replicated axis is
    torchft's, across the groups). `config`'s dp_replicate_size must be the number of groups (or 1, or -1)."""
    import dataclasses

    if config.dp_replicate_size not in (1, -1, replicas):
        raise ValueError(f"fault tolerance runs {replicas} replica groups, but the ParallelismConfig has "
                         f"dp_replicate_size={config.dp_replicate_size}; make it {replicas} (or leave it unset)")
    if config.pp_size > 1:
        raise ValueError(f"fault tolerance with pp_size={config.pp_size}: pipeline stages run backward inside the "
                         "forward, before the replica groups could average gradients; use pp_size=1 (dp_shard, tp, "
                         "cp, sp run inside each group)")
    return dataclasses.replace(config, dp_replicate_size=1)
