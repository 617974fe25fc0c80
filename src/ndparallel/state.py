"""`ndparallel.state`: Accelerate's `accelerate.state` names (home: `ndparallel.distributed.state`)."""

from .distributed.state import AcceleratorState, DistributedType, GradientState, PartialState

__all__ = ["AcceleratorState", "DistributedType", "GradientState", "PartialState"]
