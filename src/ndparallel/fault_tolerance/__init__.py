"""Fault-tolerant data parallelism: replica groups on torchft that keep training when one of them fails.

`FaultToleranceKwargs` (settings), `ReplicaGroups` (one group's part of a step: quorum, gradient average, commit, the
live state a healing group takes). ``ndparallel launch --fault-tolerant`` (`ndparallel.launch.fault_tolerant`) starts
the lighthouse and the groups. docs/failures.md says when to use it and what a step means under faults.
"""

from .replica_groups import ReplicaGroups
from .settings import FaultToleranceKwargs

__all__ = ["FaultToleranceKwargs", "ReplicaGroups"]
