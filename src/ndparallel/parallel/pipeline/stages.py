"""The module each pipeline stage runs: a view of the (cut) model holding that stage's part.

A stage module shares its submodules with the model the user holds, under the same names, so FSDP2 can shard a
stage on its own (its root is the stage) while the model's ``named_parameters`` and state dict still show the
rank's parameters under their own names.

- A decoder stage is a shallow copy of the causal LM and of its inner model whose ``layers`` are the stage's, with
  the embedding only on the first stage and the final norm and LM head only on the last. It runs the inner model's
  own forward -- on token ids at the first stage, on the hidden states it is handed (``inputs_embeds``) after --
  so masks, rotary embeddings and per-layer attention types are computed as the model computes them; the last
  stage returns the logits.
- A sequential stage is an ``nn.Sequential`` of the stage's children, under their names.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch
from torch import nn

from ..adapted import adapter_free
from ..memory import chunked_loss_of
from ..sequence.packed import install as install_packed_check, known_positions
from .split import StageLayers, StagePlan


def _shallow(module: nn.Module) -> nn.Module:
    """A new module object sharing `module`'s submodules, parameters, buffers and attributes, whose own tables of
    them can be changed without touching `module`'s."""
    clone = module.__class__.__new__(module.__class__)
    clone.__dict__.update(module.__dict__)
    for table in ("_modules", "_parameters", "_buffers"):
        clone.__dict__[table] = dict(module.__dict__[table])
    for table in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                  "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
                  "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                  "_load_state_dict_post_hooks"):
        if table in module.__dict__:
            clone.__dict__[table] = copy.copy(module.__dict__[table])
    return clone


class DecoderStage(nn.Module):
    """One stage of a Hugging Face causal LM (see the module docstring)."""

    def __init__(self, model: nn.Module, layers: list[str], first: bool, last: bool) -> None:
        super().__init__()
        inner = model.model  # cut to this rank's stages (`split.cut_to_rank`)
        all_layers = inner.layers
        stage_inner = _shallow(inner)
        stage_inner.layers = StageLayers({i: all_layers[i] for i in layers})
        stage_inner.embed_tokens = inner.embed_tokens if first else None
        stage_inner.norm = inner.norm if last else nn.Identity()
        config = copy.copy(inner.config)
        if isinstance(getattr(config, "layer_types", None), (list, tuple)):  # attention type of each layer, by index
            config.layer_types = [inner.config.layer_types[int(i)] for i in layers]
        stage_inner.config = config
        self.model = stage_inner
        self.lm_head = model.lm_head if last else None
        self.first, self.last = first, last
        self.config = model.config
        self._no_split_modules = getattr(model, "_no_split_modules", None)
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        # The head and loss over chunks of tokens (`model`: the transformers model, under PEFT the one it adapts).
        self.chunked = chunked_loss_of(model, peeled=True) if last else None
        install_packed_check()

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, loss_labels: torch.Tensor | None = None) -> torch.Tensor:
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        # Without position_ids the model numbers each row 0..n-1 itself: transformers need not read them to find
        # packed documents (`sequence.packed`).
        with known_positions() if position_ids is None else nullcontext():
            hidden = self.model(**inputs, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=False).last_hidden_state
        out = hidden
        if self.last and loss_labels is not None and self.chunked is not None:
            # Training with the chunked loss (`memory.loss_head`): the micro-batch's summed token loss, no logits;
            # its transforms include the soft-capping.
            return self.chunked.head_loss(hidden, loss_labels)
        if self.last:
            out = self.lm_head(hidden)
            if self.softcap is not None:  # Gemma's final soft-capping, as its forward applies it
                out = torch.tanh(out / self.softcap) * self.softcap
        # Under TP a stage's output can be a view (of a DTensor's local tensor); the stage hands it to the schedule,
        # and FSDP2 warns, rightly, that an in-place op on a view would skip its backward hook.
        return out.clone() if out._is_view() else out


class SequentialStage(nn.Sequential):
    """One stage of an ``nn.Sequential`` model: its children of that stage, under their own names."""

    def __init__(self, model: nn.Sequential, names: list[str]) -> None:
        super().__init__()
        for name in names:
            self.add_module(name, model._modules[name])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # one input and one output between stages
        return super().forward(x)


def build_stage(model: nn.Module, plan: StagePlan, stage: int, inner: nn.Module | None = None) -> nn.Module:
    """Stage `stage`'s module. `inner`: `model` under its adapter wrapper, as `parallelize` peeled it."""
    units = list(plan.stage_units(stage))
    if plan.kind == "decoder":  # under PEFT, the transformers model it adapts (its layers hold the adapters)
        return DecoderStage(adapter_free(model) if inner is None else inner, units, first=stage == 0,
                            last=stage == plan.num_stages - 1)
    return SequentialStage(model, units)
