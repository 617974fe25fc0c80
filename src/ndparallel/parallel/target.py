"""The model `parallelize` applies the layout to, resolved once at its entry and handed to every check and apply step.

Under PEFT the steps read the transformers model inside the ``PeftModel`` (its plan, config and forward signature:
`adapted.adapter_free`) and the family table's entry for its ``config.model_type``; at tp > 1 they split the model by
one resolved plan (module name -> style, `tensor.plans.plan_styles`); FSDP2's wrap, activation checkpointing, regional
compilation and the tiled MLP work on its transformer blocks (the classes ``transformer_cls_names_to_wrap`` or the
model's ``_no_split_modules`` name, `blocks.block_classes`); expert parallelism checks and splits a mixture of experts'
routed experts modules and routers (named by the family table). `parallelize` peels the wrapper, resolves the plan,
the block classes and the experts once, into a `Target` it hands the steps in ``options.target``
(`options.PrepareOptions`), so that no step peels or resolves again and the checks and the applies see the same
resolution. A step called on its own
(outside `parallelize`, as a unit test does) resolves its own (`target_of`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..models.families import FAMILIES, Experts, Family, experts_of
from .adapted import adapter_free
from .blocks import block_classes, blocks_of


@dataclass(frozen=True)
class Target:
    """One model as the steps of `parallelize` see it."""

    inner: nn.Module  # the model a plan, config or forward signature belongs to (under PEFT, the one it adapts)
    model_type: str | None  # its config.model_type (None: no Hugging Face config)
    family: Family | None  # the family table's entry for it (`ndparallel.models.families.FAMILIES`)
    experts: Experts | None  # the family's routed experts and router, where it is a known mixture of experts
    # At tp > 1: the plan resolved over the whole model (module name -> style name, ties completed, adapters'
    # parts expanded, checked: `tensor.plans.plan_styles`) and where it came from; None at tp 1.
    tp_plan: Mapping[str, str] | None = None
    tp_source: str = ""
    # The transformer block classes (`blocks.block_classes` of the FSDP plugin's names; empty where none are named)
    block_types: tuple[type[nn.Module], ...] = ()
    # A known mixture of experts: its routed experts modules and routers, (name, module) in module order, found by the
    # names the family table gives them (`under_layers`); empty otherwise
    expert_modules: tuple[tuple[str, nn.Module], ...] = ()
    routers: tuple[tuple[str, nn.Module], ...] = ()

    @classmethod
    def of(cls, model: nn.Module, block_names: list[str] | None = None) -> Target:
        """`model` resolved: the adapter wrapper peeled (once), its family looked up, its block classes found
        (`block_names`: ``transformer_cls_names_to_wrap``; None: the model's ``_no_split_modules``; raises, naming the
        classes it has, where a name matches none)."""
        inner = adapter_free(model)
        model_type = getattr(getattr(inner, "config", None), "model_type", None)
        experts = experts_of(model_type)
        found = {} if experts is None else {"expert_modules": tuple(under_layers(model, experts.modules)),
                                            "routers": tuple(under_layers(model, experts.router))}
        return cls(inner, model_type, FAMILIES.get(model_type), experts,
                   block_types=tuple(block_classes(model, block_names)), **found)

    def blocks_in(self, module: nn.Module) -> list[nn.Module]:
        """The transformer blocks under `module` (the model, or a pipeline stage cut from it), in module order."""
        return blocks_of(module, list(self.block_types))

    def experts_in(self, module: nn.Module) -> list[nn.Module]:
        """The routed experts modules under `module` (the model, or a pipeline stage cut from it), in module order."""
        under = {id(m) for m in module.modules()}
        return [m for _, m in self.expert_modules if id(m) in under]

    @property
    def config(self) -> Any:
        """The inner model's config (None where it has none)."""
        return getattr(self.inner, "config", None)


def under_layers(model: nn.Module, suffix: str) -> list[tuple[str, nn.Module]]:
    """Modules named ``...layers.<i>.<suffix>`` (the decoder layers that have one), in module order."""
    pattern = re.compile(r"(?:.*\.)?layers\.\d+\." + re.escape(suffix))
    return [(name, module) for name, module in model.named_modules() if pattern.fullmatch(name)]


def target_of(model: nn.Module, options: Any) -> Target:
    """The target `parallelize` resolved (``options.target``), or `model`'s own for a step called on its own."""
    target = getattr(options, "target", None)
    if target is not None:
        return target
    plugin = getattr(options, "fsdp_plugin", None)
    return Target.of(model, plugin.transformer_cls_names_to_wrap if plugin is not None else None)
