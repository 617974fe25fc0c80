"""``model.save_pretrained(dir)`` on a prepared Hugging Face model: full weights, whatever the layout.

transformers' own ``save_pretrained`` reads the parameters of this process, which are shards (DTensors) under FSDP2
or TP, or one pipeline stage's: it fails, or would write a part. `prepare` replaces it on such a model with one that
first gathers the full weights (`export.get_state_dict`: collective, the full state on the main process) and hands
them to transformers' writer (``state_dict=``, ``is_main_process=``), so config.json, the safetensors shards and
their index are what transformers writes and ``from_pretrained`` loads. Like `Accelerator.save_model` it is
collective: call it on every process, as Accelerate's example does (only the main process writes). Called on the
main process only (``if accelerator.is_main_process:``), it raises on every rank, naming the call, as soon as the
other ranks reach the library's next collective call (``wait_for_everyone``, ``save_state``, ``end_training``...);
if they train on instead, after the collective timeout. A ``state_dict`` given by the caller
(Accelerate's idiom: ``state_dict=accelerator.get_state_dict(model)``) is written as it is.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..distributed.agreement import monitored_barrier
from ..parallel import interface
from .adapters import adapter_state_dict, is_peft_model
from .export import get_state_dict


def install_save_pretrained(model: nn.Module, unwrapped: nn.Module) -> None:
    """Give `unwrapped` (a Hugging Face model whose parameters `model` shards) a collective ``save_pretrained``."""
    original = getattr(unwrapped, "save_pretrained", None)
    split = not interface(model).holds_every_parameter  # e.g. this rank's pipeline stages: the rest is elsewhere
    if original is None or not (split or any(isinstance(p, DTensor) for p in unwrapped.parameters())):
        return

    @functools.wraps(original)
    def save_pretrained(save_directory: Any, *args: Any, state_dict: dict | None = None, **kwargs: Any) -> Any:
        if state_dict is None:
            # Collective: the full state on the main process, {} elsewhere (of a PEFT model, the adapter's only).
            # Called on the main process only, it fails naming save_pretrained once another rank reaches the
            # library's next collective call.
            if is_peft_model(unwrapped):
                monitored_barrier("save_pretrained")
                state_dict = adapter_state_dict(model)
            else:
                state_dict = get_state_dict(model, call="save_pretrained")
            kwargs["is_main_process"] = not dist.is_initialized() or dist.get_rank() == 0
        return original(save_directory, *args, state_dict=state_dict, **kwargs)

    unwrapped.save_pretrained = save_pretrained
