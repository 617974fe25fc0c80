"""`ndparallel.accelerator`: the `Accelerator` (Accelerate's module path).

core.py          the class: settings, prepare, the training step, trackers, the end
settings.py      its arguments and the environment, resolved and checked before any collective
processes.py     where this process stands and process control (mixin)
collectives.py   gather / reduce / reduce_loss / padding / trigger (mixin)
checkpointing.py save_state / load_state / save_model / save (mixin)
"""

from ..configuration.plugins import DataLoaderConfiguration, GradientAccumulationPlugin
from ..distributed.state import DistributedType
from .core import Accelerator

# Accelerate's `accelerate.accelerator` exports these too (its own tests import them from there).
__all__ = ["Accelerator", "DataLoaderConfiguration", "DistributedType", "GradientAccumulationPlugin"]
