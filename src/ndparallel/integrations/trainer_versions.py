"""Which transformers the Trainer integration (`ndparallel.integrations.trainer`) takes over, and the checks made
before it does: the version policy (`check_version`) and whether the Trainer's methods it replaces are there as they
were written for (`hook_problems`, `check_support`). The policy is the integration module's docstring's.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable
from types import ModuleType
from typing import Any

TESTED_TRANSFORMERS = ("5.16", "5.25")  # the oldest minor supported (older is refused) and the newest minor tested
_WARNED: set[str] = set()  # the versions already warned about in this process


def check_version(version: str) -> str | None:
    """Refuse a transformers older than the oldest supported minor; for one newer than the newest tested minor, the
    warning to give (None within the tested range). Patch releases and pre-releases count as their minor."""
    from packaging.version import Version

    minor = Version(version).release[:2]
    oldest, newest = (Version(bound).release[:2] for bound in TESTED_TRANSFORMERS)
    tested = f"{TESTED_TRANSFORMERS[0]} to {TESTED_TRANSFORMERS[1]}"
    if minor < oldest:
        raise RuntimeError(
            f"ndparallel's Trainer integration needs transformers >= {TESTED_TRANSFORMERS[0]} (tested: {tested}), but "
            f"transformers {version} is installed: pip install 'transformers>={TESTED_TRANSFORMERS[0]}', or run the "
            "Trainer without ndparallel (no sizes, no ndparallel ParallelismConfig)")
    if minor > newest:
        return (f"transformers {version} is newer than any ndparallel's Trainer integration was tested with "
                f"({tested}); every Trainer method it replaces is there as it expects, so the run goes on. If "
                "something looks wrong, pin the newest tested release: pip install "
                f"'transformers<{newest[0]}.{newest[1] + 1}'")
    return None


def warn_once(message: str | None, main_process: bool) -> None:
    if message is not None and main_process and message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


# The Trainer's methods the integration replaces (`ndparallel.integrations.trainer.HOOKS`), with the parameters each
# was written for (the same in every minor from 5.16 to 5.25); and the names of ``transformers.trainer`` replaced.
EXPECTED_PARAMETERS: dict[str, tuple[str, ...]] = {
    "create_accelerator_and_postprocess": ("self",),
    "_get_num_items_in_batch": ("self", "batch_samples", "device"),
    "_prepare_context_parallel_inputs": ("self", "model", "inputs"),
    "save_model": ("self", "output_dir", "_internal_call"),
    "_save_optimizer_and_scheduler": ("self", "output_dir"),
    "_load_optimizer_and_scheduler": ("self", "checkpoint"),
    "_load_from_checkpoint": ("self", "resume_from_checkpoint", "model"),
    "_load_best_model": ("self",),
    "_wrap_model": ("self", "model", "training", "dataloader"),
    "_prepare_input": ("self", "data"),
    "set_initial_training_values": ("self", "args", "dataloader"),
}
MODULE_HOOKS: dict[str, tuple[str, ...] | None] = {"Accelerator": None, "skip_first_batches": ("dataloader", "num_batches")}


def _parameters(function: Any) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None


def hook_problems(module: ModuleType) -> list[str]:
    """What of ``transformers.trainer`` (`module`) is not as the integration's hooks were written for: each entry
    names the method and what was expected. Empty when every hook fits."""
    trainer = module.Trainer
    wanted_names = [(trainer, f"Trainer.{name}", name, expected) for name, expected in EXPECTED_PARAMETERS.items()]
    wanted_names += [(module, f"transformers.trainer.{name}", name, expected) for name, expected in MODULE_HOOKS.items()]
    problems = []
    for owner, label, name, expected in wanted_names:
        if not hasattr(owner, name):
            problems.append(f"{label} is gone")
            continue
        found = _parameters(getattr(owner, name))
        if expected is not None and found != expected:
            problems.append(f"{label} takes ({', '.join(found or ('?',))}), where the integration was written for "
                            f"({', '.join(expected)})")
    return problems


HOOK_MARK = "_ndparallel_hook"  # set on each installed hook: the name of the Trainer method it replaces


def _replaced_hooks(trainer: type) -> list[str]:
    """The hooked methods of the Trainer class that were replaced after the integration attached (another library
    assigning its own to ``Trainer``: Axolotl's ``patch_prepare_cp`` did), naming where the replacement comes from."""
    if not getattr(trainer, "_ndparallel_integration", False) or getattr(trainer, "_ndparallel_refusing", False):
        return []
    found = []
    for name in EXPECTED_PARAMETERS:
        current = trainer.__dict__.get(name)
        if getattr(current, HOOK_MARK, None) != name:
            where = getattr(current, "__module__", "?")
            label = getattr(current, "__qualname__", name)
            found.append(f"Trainer.{name} was replaced after ndparallel attached (by {where}.{label})")
    return found


def _bypassing_overrides(cls: type, base: type, names: Iterable[str] = EXPECTED_PARAMETERS) -> list[str]:
    """The hooked methods (`names`) that `cls` (a Trainer subclass: TRL's, Axolotl's, the user's) overrides without
    calling the Trainer's own (its code neither calls ``super()`` nor names the method), which would bypass the hook."""
    found = []
    for name in names:
        for klass in cls.__mro__:
            if klass is base:
                break
            override = klass.__dict__.get(name)
            if override is None:
                continue
            code = getattr(getattr(override, "__func__", override), "__code__", None)
            if code is not None and not {"super", name} <= set(code.co_names):
                found.append(f"{klass.__module__}.{klass.__qualname__}.{name}")
            break
    return found


def check_support(trainer: Any, module: ModuleType | None = None) -> str | None:
    """Before a Trainer is taken over: refuse a transformers older than supported, a hook that does not fit
    (`hook_problems` of `module`, ``transformers.trainer`` by default) or that the Trainer's class bypasses; return
    the warning for a newer transformers than tested."""
    import transformers

    if module is None:
        import transformers.trainer as module
    warning = check_version(transformers.__version__)
    bypassing = _bypassing_overrides(type(trainer), module.Trainer)
    problems = hook_problems(module) + _replaced_hooks(module.Trainer) + [
        f"{name} overrides it without calling the Trainer's own" for name in bypassing]
    if problems:
        raise RuntimeError(
            f"ndparallel's Trainer integration cannot take over this Trainer (transformers {transformers.__version__}; "
            f"tested {TESTED_TRANSFORMERS[0]} to {TESTED_TRANSFORMERS[1]}): " + "; ".join(problems) + ". Run it "
            "without ndparallel (no sizes, no ndparallel ParallelismConfig), or with a tested transformers")
    return warning
