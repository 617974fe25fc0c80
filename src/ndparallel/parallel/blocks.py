"""Which modules of a model are its transformer blocks: the units FSDP2 wraps and activation checkpointing
recomputes."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def block_classes(model: nn.Module, names: Iterable[str] | None) -> list[type[nn.Module]]:
    """Classes of the transformer blocks: `names`, or the model's ``_no_split_modules``.

    Raises when a requested name matches no module of the model, listing the classes it has.
    """
    explicit = names is not None
    names = list(names) if explicit else list(getattr(model, "_no_split_modules", None) or [])
    present = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in names if n not in present]
    if missing and explicit:
        raise ValueError(
            f"transformer_cls_names_to_wrap: {missing} not found in {type(model).__name__}; "
            f"its module classes are: {sorted(present)}"
        )
    return [present[n] for n in names if n in present]


def blocks_of(model: nn.Module, classes: list[type[nn.Module]]) -> list[nn.Module]:
    """The submodules of `model` (not the model itself) that are instances of `classes`, in module order."""
    return [m for m in model.modules() if isinstance(m, tuple(classes)) and m is not model] if classes else []
