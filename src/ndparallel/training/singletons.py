"""Accelerate's singleton classes called with no arguments (``AcceleratorState()``, ``GradientState()``): in
ndparallel each Accelerator has its own, and the call with no arguments gives the newest Accelerator's."""

from __future__ import annotations

from typing import Any


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
