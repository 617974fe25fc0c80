"""Tensor parallelism through adapters: PEFT's LoRA layers are split as the plan splits the layer they wrap.

PEFT replaces a targeted layer L (an nn.Linear or transformers' Conv1D) with a wrapper that holds it as
``L.base_layer`` and, for each adapter k, two small layers ``L.lora_A[k]`` (in -> r) and ``L.lora_B[k]`` (r -> out):
``L(x) = base(x) + s * B(A(dropout(x)))``. The plan names L (its patterns match the wrapper's name); here it is
applied to L's parts so that each rank's output is exactly its part of the unsplit layer's:

- a column-wise L (output features split: ``colwise``, ``colwise_gather_output``, ``packed_colwise``): the base as
  planned, B split like it along its outputs, A whole (``replicate``: its input is the replicated activation). In
  backward, B's input gradient is summed over tp on its way into A (torch's column-wise input layout), so A's
  gradient is whole, and the same, on every rank;
- a row-wise L (input features split: ``rowwise``, ``rowwise_split_input``): the base as planned, A split like it
  along its inputs (its r outputs summed over tp: an all-reduce of r features per token, or a reduce-scatter along
  the sequence under Megatron SP), B whole (``replicate``; ``replicate_dtensor_output`` under Megatron SP, whose
  row-wise outputs stay DTensors).

Dropout and scaling are PEFT's own, unchanged. Refused, naming the layer, before any collective: adapters other
than LoRA's A/B layers in a module the plan splits, DoRA there (its magnitude normalises the combined weight across
the split), and LoRA on an embedding the plan splits or that runs under Megatron SP.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import nn

from ..adapted import is_adapter_wrapper

COLUMN_STYLES = ("colwise", "colwise_gather_output", "packed_colwise")
ROW_STYLES = ("rowwise", "rowwise_split_input")
_PART = re.compile(r"\.(?:base_layer|lora_[AB]\.[^.]+)$")


def layer_of(name: str) -> str:
    """The name of the layer a plan entry concerns: an adapter's part (``q_proj.base_layer``, ``q_proj.lora_B.default``)
    is its wrapper's (``q_proj``); any other name is itself."""
    return _PART.sub("", name)


def _is_lora(module: nn.Module) -> bool:
    return isinstance(getattr(module, "lora_A", None), nn.ModuleDict) and \
        isinstance(getattr(module, "lora_B", None), nn.ModuleDict)


def expand_adapters(model: nn.Module, resolved: Mapping[str, str], sequence_parallel: bool) -> dict[str, str]:
    """`resolved` (module name -> style) with every PEFT-wrapped layer's entry replaced by entries for its parts (see
    the module docstring); raises, naming the layer, for adapters that cannot be split exactly."""
    modules = dict(model.named_modules())
    out: dict[str, str] = {}
    for name, style in resolved.items():
        module = modules[name]
        if not is_adapter_wrapper(module):
            out[name] = style
            continue
        where = f"{name!r} ({type(module).__name__}, PEFT)"
        if not _is_lora(module):
            raise ValueError(f"tensor parallelism: the plan splits {where}, an adapter ndparallel cannot split; "
                             "ndparallel splits LoRA adapters (lora_A / lora_B layers): use LoRA there, or leave "
                             "the layer out of the adapter's target_modules")
        if any(len(getattr(module, attr, {})) for attr in ("lora_embedding_A", "lora_embedding_B")) or \
                isinstance(module.base_layer, nn.Embedding):
            raise ValueError(f"tensor parallelism: the plan splits {where}, a LoRA adapter on an embedding, which "
                             "ndparallel does not split; leave the embedding out of target_modules (or out of the "
                             "plan)")
        if len(getattr(module, "lora_magnitude_vector", {})):
            raise ValueError(f"tensor parallelism: {where} is a DoRA adapter (use_dora=True), whose magnitude "
                             "normalises the combined weight across the split; use plain LoRA under tp_size > 1")
        whole = "replicate_dtensor_output" if sequence_parallel else "replicate"
        out[f"{name}.base_layer"] = style
        for key in module.lora_A:
            if style in COLUMN_STYLES:
                out[f"{name}.lora_A.{key}"], out[f"{name}.lora_B.{key}"] = "replicate", style
            elif style in ROW_STYLES:
                out[f"{name}.lora_A.{key}"], out[f"{name}.lora_B.{key}"] = style, whole
            else:
                raise ValueError(f"tensor parallelism: {where} has the style {style!r}; a LoRA layer is split only "
                                 f"as a column-wise {COLUMN_STYLES} or row-wise {ROW_STYLES} layer")
    if sequence_parallel:
        for name, module in modules.items():
            if is_adapter_wrapper(module) and isinstance(module.base_layer, nn.Embedding) and _is_lora(module):
                raise ValueError(f"TorchTensorParallelConfig(sequence_parallel=True): {name!r} is a LoRA adapter on "
                                 "an embedding, whose output would not be split along the sequence with the "
                                 "embedding's; leave it out of target_modules, or use sequence_parallel=False")
    return out
