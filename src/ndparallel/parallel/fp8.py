"""FP8 training (``mixed_precision="fp8"``): the eligible linear layers compute their matmuls in float8 through
torchao (``convert_to_float8_training``), the rest of the model in bf16, master weights in fp32 -- Accelerate's
``AORecipeKwargs`` meaning.

Eligible by default: every ``nn.Linear`` whose input and output sizes are multiples of 16 (float8 matmuls need
them), except the model's first and last linear layers, which stay in high precision as Accelerate keeps them (the
LM head's logits are sensitive to it); `AORecipeKwargs.module_filter_func` chooses otherwise. Under FSDP2 the
default recipe all-gathers the weights in float8 (half the bytes of bf16). Layers are swapped in place, so
parameter names and checkpoints stay the model's own. Under tensor parallelism the float8 layers' colwise and
rowwise styles are torchao's float8 ones (`tensor.styles.build_style`); with Megatron-style sequence parallelism
they all-gather float8 activations, which gloo cannot send: refused on CPU.

Speed needs compilation: eagerly, torchao's scaling and casts run as separate kernels around every matmul. On one
H100 (Llama, hidden 2048, 8 layers, 4,096 tokens per step; docs/gpu.md) fp8 ran at 0.44x bf16's tokens/s eagerly,
and at 0.90x compiled bf16's with regional inductor compilation (1.15x eager bf16). A CUDA run without a compiling
`TorchDynamoPlugin` is warned about once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from ..distributed.mesh import ParallelMesh
from .options import PrepareOptions


def default_filter(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """Accelerate's rule: linear layers with both dimensions multiples of 16, except the first and the last."""
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    ends = {linears[0], linears[-1]} if linears else set()

    def eligible(module: nn.Module, fqn: str) -> bool:
        return (isinstance(module, nn.Linear) and fqn not in ends and module.in_features % 16 == 0
                and module.out_features % 16 == 0)

    return eligible


def _filter(model: nn.Module, options: PrepareOptions) -> Callable[[nn.Module, str], bool]:
    """The recipe's `module_filter_func`, else `default_filter`."""
    recipe = options.fp8_recipe
    return recipe.module_filter_func if recipe is not None and recipe.module_filter_func else default_filter(model)


def check_fp8(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> None:
    """Refuse what FP8 cannot run here, before any collective."""
    if options.mixed_precision != "fp8":
        return
    if mesh.size("tp") > 1 and options.tp_handler.sequence_parallel and options.device.type == "cpu":
        raise ValueError("mixed_precision='fp8' with tensor parallelism's sequence_parallel all-gathers float8 "
                         "activations, which gloo (the CPU backend) cannot send; use sequence_parallel=False on CPU, "
                         "or NCCL on GPUs")
    keep = _filter(model, options)
    if not any(keep(m, name) for name, m in model.named_modules() if isinstance(m, nn.Linear)):
        raise ValueError(f"mixed_precision='fp8': no linear layer of {type(model).__name__} is eligible for float8 "
                         "(input and output sizes multiples of 16; the first and last linear layers stay in high "
                         "precision); use mixed_precision='bf16', or pass AORecipeKwargs(module_filter_func=...)")


def apply_fp8(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> nn.Module:
    """Swap the eligible linear layers for torchao's float8 ones (a no-op unless mixed_precision is fp8)."""
    if options.mixed_precision != "fp8":
        return model
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # optional dependency

    recipe = options.fp8_recipe
    config = recipe.config if recipe is not None and recipe.config is not None else Float8LinearConfig(
        enable_fsdp_float8_all_gather=options.fsdp)
    convert_to_float8_training(model, config=config, module_filter_fn=_filter(model, options))
    compiled = options.dynamo_plugin is not None and options.dynamo_plugin.enabled
    if options.device.type == "cuda" and not compiled and (not dist.is_initialized() or dist.get_rank() == 0):
        warnings.warn("mixed_precision='fp8' without torch.compile: torchao's float8 casts run as separate kernels, "
                      "measured 0.44x bf16's tokens/s on an H100 (docs/gpu.md); compile the blocks with "
                      "Accelerator(dynamo_plugin=TorchDynamoPlugin(backend='inductor', use_regional_compilation=True))",
                      stacklevel=4)
    return model
