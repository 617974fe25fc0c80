"""FLOPs of a decoder-only transformer per token, written once: the step timer's MFU (`ndparallel.training.metrics`) and
the planner's model and time estimates (`ndparallel.planner.model`, `ndparallel.planner.timing`) all count with these.

A token's forward pass multiplies each weight of a matrix multiply once (2 FLOPs per weight: a multiply and an add)
and, in each of the ``layers`` attention layers, its query against ``keys`` keys and the attention weights against as
many values: 2 x keys x (q_width + v_width) FLOPs, q_width = heads x head_dim, v_width = heads x v_head_dim (summed as
``attention_width``). Backward costs twice the forward (the gradients of the inputs and of the weights), so training
is 3 x forward:

    6 x N_matmul + 6 x layers x attention_width x keys

With ``keys`` = the sequence length this is the convention of MFU (PaLM's: the whole S x S score matrix, causal
masking not subtracted, so figures are comparable); the planner's hardware FLOPs pass the keys a query really sees.
The input embedding is a lookup, not a matrix multiply; norms are negligible and left out.
"""

from __future__ import annotations


def forward_flops(matmul_weights: float, layers: int = 0, attention_width: int = 0, keys: float = 0) -> float:
    """FLOPs of one token's forward pass (module docstring)."""
    return 2.0 * matmul_weights + 2.0 * layers * attention_width * keys


def training_flops(matmul_weights: float, layers: int = 0, attention_width: int = 0, keys: float = 0) -> float:
    """FLOPs of one token's forward and backward passes: 3 x `forward_flops`."""
    return 3.0 * forward_flops(matmul_weights, layers, attention_width, keys)
