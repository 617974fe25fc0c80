"""Models that transformers already sharded: ``from_pretrained(..., tp_plan="auto")`` (Accelerate's example loads its
model that way, passing ``device_mesh=accelerator.torch_device_mesh``).

transformers >= 5 builds a tensor-parallel mesh of its own for such a model (it does not take the Accelerator's),
makes its parameters DTensors on it, and replaces the ``forward`` of the modules it split. Layouts need all
parallelisms on one mesh (FSDP2 shards TP's DTensors over the mesh they live on), so `gather_presharded` turns such a
model back into an ordinary one: every DTensor parameter gathered to its full value, every replaced ``forward``
removed, and what records transformers' split (``_tp_size``, ``config.distributed_config``...) cleared: the model then
saves as an ordinary one (transformers' ``save_pretrained`` ends in a barrier of every rank while its config holds a
``distributed_config``). `ndparallel.parallel.parallelize` then applies the layout as to any model -- the same plan
(the model's own, which transformers used too), on the Accelerator's mesh. It costs one gather of the weights at
``prepare``.
Any other DTensor parameter (a model ndparallel or another library parallelised) is left alone and refused by the
tensor-parallel check.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

_TRANSFORMERS_FORWARD = "tp_forward"  # the name of the forward transformers installs on the modules it splits


def is_transformers_sharded(model: nn.Module) -> bool:
    """Whether `model` was tensor-parallelised by transformers' ``from_pretrained(tp_plan=...)``."""
    return getattr(model, "_tp_size", None) is not None and any(
        isinstance(p, DTensor) for p in model.parameters())


@torch.no_grad()
def gather_presharded(model: nn.Module) -> nn.Module:
    """Undo transformers' tensor parallelism on `model` (see the module docstring); other models are returned as they
    are. Collective over transformers' mesh: every rank calls it on the same model."""
    if not is_transformers_sharded(model):
        return model
    gathered: dict[int, nn.Parameter] = {}  # id(DTensor parameter) -> its gathered parameter: ties stay tied
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                if id(param) not in gathered:
                    gathered[id(param)] = nn.Parameter(param.full_tensor(), requires_grad=param.requires_grad)
                module._parameters[name] = gathered[id(param)]
        for name, buffer in list(module.named_buffers(recurse=False)):
            if isinstance(buffer, DTensor):
                module._buffers[name] = buffer.full_tensor()
        forward = module.__dict__.get("forward")
        if forward is not None and getattr(forward, "__name__", "") == _TRANSFORMERS_FORWARD:
            del module.forward  # the class's own forward again
    model._tp_size = None
    model._device_mesh = None
    # What else says "transformers split this model" (transformers >= 5.2x): its config's DistributedConfig, which
    # makes save_pretrained end in a barrier on every rank (a hang when only the main process saves, as the Trainer
    # does), and the flag the Trainer reads to skip its Accelerator's prepare. Both are false of the model now.
    if getattr(getattr(model, "config", None), "distributed_config", None) is not None:
        model.config.distributed_config = None
    if "_is_distributed_loading_by_transformers" in vars(model):
        model._is_distributed_loading_by_transformers = False
    if "_mesh_manager" in vars(model):
        model._mesh_manager = None
    return model
