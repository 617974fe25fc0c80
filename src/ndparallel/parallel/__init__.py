"""Applying parallelisms to one model, in a fixed order.

Each step is a function ``apply_x(model, mesh, options) -> model`` in its own module (a no-op when its axis has one
rank or its option is off), preceded where it can fail on user input by ``check_x(model, mesh, options)``;
`parallelize` only calls them in order. ``options`` is a `PrepareOptions`: every setting comes from it, the mesh
gives sizes, coordinates and groups.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ..distributed.mesh import ParallelMesh
from .activation_checkpointing import apply_activation_checkpointing
from .compile import apply_model_compilation, apply_regional_compilation, check_compilation
from .fp8 import apply_fp8, check_fp8
from .data_parallel import apply_data_parallel, broadcast_module_states, uses_fsdp
from .experts import apply_expert_parallel, check_expert_parallel
from .interface import PreparedModel, interface, state_module, unwrap
from .memory.apply import apply_memory_features
from .moe import apply_global_load_balancing
from .options import PrepareOptions
from .pipeline import PipelineModel, apply_pipeline, cut_to_rank, plan_pipeline
from .precision import apply_autocast, apply_master_weights
from .quantized import check_quantized
from .sequence import apply_sequence_parallel, check_sequence_parallel
from .target import target_of
from .tensor import apply_tensor_parallel, check_tensor_parallel, gather_presharded, resolve_tensor_parallel


def parallelize(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> nn.Module:
    """Apply every configured parallelism to `model` and return the module to train."""
    # A model transformers already tensor-parallelised (from_pretrained(tp_plan="auto")), on a mesh of its own, is
    # gathered back to full weights: the layout below applies to it as to any model (`tensor.presharded`).
    model = gather_presharded(model)
    # The model resolved once, for every step below (`target.Target`): the adapter wrapper peeled, its family, its
    # transformer block classes, and at tp > 1 the plan resolved over the whole model (raising, on every rank, where
    # a block class named does not exist or the plan cannot split the model).
    target = target_of(model, options)
    options = dataclasses.replace(options, target=resolve_tensor_parallel(model, mesh, options, target))
    # Checks only, on every rank, before the first collective: a plan or model the layout cannot split raises here.
    stages = plan_pipeline(model, mesh, options)  # None without pipeline stages
    check_tensor_parallel(model, mesh, options)
    check_sequence_parallel(model, mesh, options)
    check_compilation(model, mesh, options)
    check_fp8(model, mesh, options)
    check_expert_parallel(model, mesh, options)
    check_quantized(model, mesh, options)
    # 1. Pipeline stages: this rank keeps only what its stages run (names unchanged); the rest of the layout applies
    # to that part. Before the move to the device, so nothing else is ever placed there.
    if stages is not None:
        # Each stage is split as the whole model would be: the whole model's resolved plan (`options.target`; ties
        # completed: a cut stage no longer sees its embedding tied to the last stage's head) applies to its modules.
        model = cut_to_rank(model, stages, mesh.rank("pp"), target.inner)
    # To this rank's device; tensors on the meta device (weights loaded after parallelisation, see
    # ndparallel.checkpoint.load_pretrained) stay there.
    model._apply(lambda t: t if t.is_meta else t.to(options.device))
    # Every rank starts from its stage's first rank's weights (rank 0's without stages), so ranks that were
    # initialised differently still train one model (each tensor-parallel rank then slices its own shard of the
    # same full weights, without communicating).
    within = mesh.within_stage() if stages is not None else None
    if stages is None or within is not None:
        broadcast_module_states(model, within.get_group() if within is not None else None)
    # 0. Mixed precision keeps fp32 master weights: low-precision trainable parameters are upcast before sharding.
    model = apply_master_weights(model, mesh, options)
    # 0b. FP8: the eligible linear layers become torchao's float8 layers (names unchanged).
    model = apply_fp8(model, mesh, options)
    # 2. Tensor parallel over ``tp``, from the plan (parameters it covers become DTensors sharded over tp).
    model = apply_tensor_parallel(model, mesh, options)
    # 3. Context / Ulysses sequence parallel: attention over sequences sharded on ``cp x sp``.
    model = apply_sequence_parallel(model, mesh, options)
    # 3b. Mixture-of-experts models: the load-balancing loss over the tokens of every rank of ``loss``, not each rank's.
    model = apply_global_load_balancing(model, mesh, options)
    # 3c. Long sequences in less memory: the LM head and its loss over chunks of tokens (after TP, whose hooks lay out
    # the head's input), decoder MLPs over tiles of the sequence (mixtures of experts stay untiled).
    model = apply_memory_features(model, mesh, options)
    # 3d. Expert parallelism over ``ep``: each rank keeps its experts; tokens travel to them all-to-all.
    model = apply_expert_parallel(model, mesh, options)
    # 4. Activation checkpointing of the transformer blocks (activations offloaded to host memory when asked).
    model = apply_activation_checkpointing(model, mesh, options)
    # 5. Regional compilation: each block compiled in place, before FSDP2 wraps it.
    model = apply_regional_compilation(model, mesh, options)
    if stages is not None:
        # 6-7 per stage: each stage module is its own autocast and FSDP2 / DDP root; the pipeline runs them.
        return apply_pipeline(model, stages, mesh, options, lambda stage: apply_data_parallel(
            apply_autocast(stage, mesh, options), mesh, options))
    # 6. Mixed precision outside FSDP2 is autocast; FSDP2 casts through its MixedPrecisionPolicy instead.
    model = apply_autocast(model, mesh, options)
    # 7. Data parallel, outermost (split experts first, over the ranks that hold the same experts).
    model = apply_data_parallel(model, mesh, options)
    # 8. Whole-model compilation, last (when not regional).
    return apply_model_compilation(model, mesh, options)


__all__ = ["PipelineModel", "PrepareOptions", "PreparedModel", "interface", "parallelize", "state_module", "unwrap",
           "uses_fsdp"]
