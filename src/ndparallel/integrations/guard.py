"""A plain Accelerate ``Accelerator`` under ``ndparallel launch`` with sizes is refused.

``ndparallel launch --cp-size 2 script.py`` passes the sizes as ``NDPARALLEL_*`` variables, which only ndparallel
reads. A script that builds ``accelerate.Accelerator`` would ignore them and train plain data parallelism -- not
what was asked for, and without a word. Every rank raises the same error when it builds one, before any collective.
The Hugging Face Trainer is not refused: ndparallel builds its Accelerator (`ndparallel.integrations.trainer`).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from ..launch.worker import launch_sizes

_INSTALLED = "_ndparallel_guard"


def requested_layout() -> str | None:
    """The sizes ``ndparallel launch`` was given, as ``dp_shard(2) * cp(2)``; None when it was given none."""
    sizes = {name[: -len("_size")]: size for name, size in launch_sizes().items() if size != 1}
    return " * ".join(f"{axis}({size})" for axis, size in sizes.items()) or None


def install(module: ModuleType) -> None:
    """Refuse ``module.Accelerator`` (accelerate.accelerator) when the launch asked for sizes."""
    cls = module.Accelerator
    if getattr(cls.__init__, _INSTALLED, False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        layout = requested_layout()
        if layout is not None:
            raise RuntimeError(
                f"ndparallel launch was asked for {layout}, but this script builds accelerate's Accelerator, which "
                "ignores those sizes and would train plain data parallelism instead. Import the Accelerator from "
                "ndparallel (`from ndparallel import Accelerator`, and ParallelismConfig / plugins likewise: only "
                "the import lines change), or launch without sizes to run the script as torchrun would. A Hugging "
                "Face Trainer needs no change: ndparallel takes it over."
            )
        original(self, *args, **kwargs)

    setattr(__init__, _INSTALLED, True)
    cls.__init__ = __init__
