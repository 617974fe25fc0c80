"""Small process-level helpers with Accelerate's names: `set_seed` and a main-process progress bar; `current`, the
newest Accelerator's state object for Accelerate code that calls its singleton classes with no arguments."""

from __future__ import annotations

import os
import random
from collections.abc import Iterable
from typing import Any

import torch


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python, NumPy (if installed) and torch; with `device_specific`, add this process's rank; with
    `deterministic`, ask torch for deterministic algorithms."""
    if device_specific:
        seed += int(os.environ.get("RANK", "0"))
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def progress_bar(iterable: Iterable[Any] | None = None, *, main_process: bool = True, **kwargs: Any):
    """A tqdm progress bar, shown only when `main_process` is True."""
    from tqdm.auto import tqdm

    disable = kwargs.pop("disable", False)
    return tqdm(iterable, disable=disable or not main_process, **kwargs)


def current(cls: type, what: str) -> Any:
    """The instance of `cls` that the newest Accelerator of this process made (``cls._latest``, a weak reference), for
    Accelerate code that reaches its singletons by calling the class with no arguments (``AcceleratorState()``); a
    clear error when there is none."""
    latest = cls.__dict__.get("_latest")
    found = latest() if latest is not None else None
    if found is None:
        raise RuntimeError(f"{what}() with no arguments is the state of this process's Accelerator, and none exists: "
                           "create the Accelerator first")
    return found
