"""Which modules of a model are its transformer blocks -- the units activation checkpointing recomputes -- and which
modules FSDP2 shards on their own (its wrap policy)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

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


def modules_to_wrap(model: nn.Module, policy: str | Callable[..., bool], classes: list[type[nn.Module]],
                    min_num_params: int | None = None) -> list[nn.Module]:
    """The submodules FSDP2 shards on their own before the root, children before parents.

    "transformer_based_wrap": the blocks of `classes`; "no_wrap": none; "size_based_wrap": every module whose
    parameters not already in a wrapped descendant number at least `min_num_params`; a callable: every module for
    which ``policy(module=module, recurse=False, nonwrapped_numel=n)`` is true (torch's FSDP1 wrap policies).
    """
    if policy == "no_wrap":
        return []
    if policy == "transformer_based_wrap":
        return blocks_of(model, classes)
    wrapped: list[nn.Module] = []
    covered: set[int] = set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is model:
            return
        numel = sum(p.numel() for p in module.parameters() if id(p) not in covered)
        if numel == 0:
            return
        wrap = numel >= (min_num_params or 0) if policy == "size_based_wrap" else bool(
            policy(module=module, recurse=False, nonwrapped_numel=numel))
        if wrap:
            wrapped.append(module)
            covered.update(id(p) for p in module.parameters())

    visit(model)
    return wrapped
