"""The chunked loss installed on a Hugging Face causal LM: its training forward holds at most one chunk of logits.

Three hooks, nothing in the model's code changes:

- a forward pre-hook on the causal LM *arms* the head when the call trains with labels (training mode, gradients
  enabled, ``labels`` given: the calls where the model computes its loss);
- the LM head's ``forward``, when armed, keeps its input (the last hidden states, after any tensor-parallel input
  layout) and its weight, and returns a placeholder of shape ``(..., 0)`` instead of the logits;
- the model's ``loss_function`` (transformers' ``ForCausalLMLoss``, replaced by `ChunkedLoss`), handed that
  placeholder, computes the loss from the kept hidden states and weight in chunks
  (`cross_entropy.linear_cross_entropy`) with the arguments the model passes -- ``labels`` / ``shift_labels``,
  ``num_items_in_batch``, ``ignore_index`` -- so it returns what ``ForCausalLMLoss`` returns: this rank's mean over
  its loss tokens, or their sum over ``num_items_in_batch``. `ndparallel.training.loss` weights it as before.

Then ``outputs.logits`` is None (the forward post-hook replaces the placeholder). Every other call (evaluation,
no labels, ``torch.no_grad()``) runs the head and the loss as the model always did. What the model does to its
logits between head and loss (Gemma's soft-capping, a scale) is read from its source (`head_source`) and applied to
each chunk; anything else makes the model ineligible.

When it is on (`MemoryKwargs.chunked_loss`): "auto" (the default) turns it on for causal LMs whose loss is
transformers' ``ForCausalLMLoss`` (not one a user set), whose output embedding is a plain ``nn.Linear`` (no
adapter on it) and whose forward `head_source` can read; True requires it (and refuses, saying why, where it cannot
be); False leaves the model as it is. ``chunked_loss_status(model)`` says which and why.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from ...training.loss import is_causal_lm
from ..adapted import adapter_free, is_adapter_wrapper
from .config import MemoryKwargs
from .cross_entropy import IGNORE_INDEX, Transform, aligned_labels, linear_cross_entropy
from .head_source import Ineligible, head_transforms

STATUS_ATTR = "_ndparallel_chunked_loss"  # on the transformers model: the `ChunkedLoss`, or the reason it is off
KEEP_IN_ROOT_ATTR = "_ndparallel_keep_in_root"  # on the head: FSDP2 must not make it a unit of its own


def _model_loss(model: nn.Module) -> tuple[Callable | None, Callable | None]:
    """(the loss function `model` computes with, transformers' ``ForCausalLMLoss``), without reading the
    ``loss_function`` property (which warns about models with no ``loss_type``)."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return None, None
    if "_loss_function" in vars(model):  # set by the user (or by us: prepared twice)
        return vars(model)["_loss_function"], ForCausalLMLoss
    loss_type = getattr(model, "loss_type", None)
    return LOSS_MAPPING.get(loss_type if loss_type in LOSS_MAPPING else "ForCausalLM"), ForCausalLMLoss


def eligibility(model: nn.Module, inner: nn.Module | None = None) -> tuple[nn.Module, nn.Module, tuple[Transform, ...]]:
    """(the transformers model, its LM head, the transforms between head and loss), or raise `Ineligible`. `inner`:
    `model` under its adapter wrapper, as `parallelize` peeled it (peeled here when not given)."""
    inner = adapter_free(model) if inner is None else inner
    name = type(inner).__name__
    loss, reference = _model_loss(inner)
    if reference is None or not is_causal_lm(inner):
        raise Ineligible(f"{name} is not a transformers causal LM")
    if getattr(loss, "__func__", loss) is not reference:
        raise Ineligible(f"{name}'s loss_function is {getattr(loss, '__name__', loss)!r}, not transformers' "
                         "ForCausalLMLoss")
    get_head = getattr(inner, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None:
        raise Ineligible(f"{name} has no output embedding (under pipeline stages: this rank's stages hold no LM "
                         "head)")
    if is_adapter_wrapper(head):
        raise Ineligible(f"{name}'s LM head carries a PEFT adapter")
    if type(head) is not nn.Linear:
        raise Ineligible(f"{name}'s LM head is a {type(head).__name__}, not an nn.Linear")
    head_name = next((n for n, m in inner.named_children() if m is head), None)
    if head_name is None:
        raise Ineligible(f"{name}'s LM head is not one of its direct children")
    return inner, head, head_transforms(inner, head_name)


class ChunkedLoss:
    """The hooks of one model (module docstring); also its ``loss_function``."""

    def __init__(self, model: nn.Module, head: nn.Module, transforms: tuple[Transform, ...],
                 chunk: int | None, original: Callable) -> None:
        self.head, self.transforms, self.chunk, self.original = head, transforms, chunk, original
        self.armed = False
        self.kept: tuple[Any, Any, Any] | None = None  # (hidden states, weight, bias) of the armed head call
        self.calls = 0  # losses computed in chunks (tests read it)
        parameters = list(inspect.signature(type(model).forward).parameters)[1:]
        self.labels_position = parameters.index("labels") if "labels" in parameters else None
        self.head_forward = head.forward

    def __repr__(self) -> str:
        return f"ChunkedLoss(transforms={self.transforms}, chunk={self.chunk})"

    # ---- hooks ----------------------------------------------------------------------------------------------------
    def arm(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        labels = kwargs.get("labels")
        if labels is None and self.labels_position is not None and len(args) > self.labels_position:
            labels = args[self.labels_position]
        self.armed = labels is not None and module.training and torch.is_grad_enabled()
        self.kept = None

    def disarm(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        self.armed, self.kept = False, None
        logits = output.get("logits") if isinstance(output, dict) else None
        if logits is not None and logits.shape[-1] == 0:
            output["logits"] = None
        return output

    @torch.compiler.disable
    def forward_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's forward: the logits, or while armed the placeholder (module docstring)."""
        if not self.armed:
            return self.head_forward(hidden)
        self.armed = False
        weight, bias = self.head.weight, self.head.bias
        self.kept = (hidden, weight, bias)
        if isinstance(hidden, DTensor):
            local = hidden.to_local()
            empty = local.new_empty((*local.shape[:-1], 0)).to(weight.dtype)
            return DTensor.from_local(empty, hidden.device_mesh, [Replicate()] * hidden.device_mesh.ndim,
                                      run_check=False)
        return hidden.new_empty((*hidden.shape[:-1], 0)).to(weight.dtype)

    @torch.compiler.disable
    def __call__(self, logits: Any = None, labels: Any = None, vocab_size: Any = None, num_items_in_batch: Any = None,
                 ignore_index: int = IGNORE_INDEX, shift_labels: Any = None, **kwargs: Any) -> torch.Tensor:
        kept, self.kept = self.kept, None
        if kept is None:  # an ordinary call (evaluation, the pipeline's own loss): the model's own loss
            return self.original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                 ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        if logits is None or logits.shape[-1] != 0:
            raise RuntimeError("chunked loss: the loss function did not receive the head's placeholder; this model's "
                               "forward does something to its logits ndparallel did not read from its source. Turn the "
                               "chunked loss off: Accelerator(kwargs_handlers=[MemoryKwargs(chunked_loss=False)])")
        hidden, weight, bias = kept
        self.calls += 1
        return self.compute(hidden, weight, bias, aligned_labels(labels, shift_labels, ignore_index),
                            ignore_index=ignore_index, num_items_in_batch=num_items_in_batch)

    def head_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The sum of the token losses of `hidden` against aligned `labels` through the head (its hooks included), in
        chunks: what a pipeline's last stage computes instead of its logits."""
        self.armed = True
        try:
            self.head(hidden)
        finally:
            self.armed = False
        (hidden, weight, bias), self.kept = self.kept, None
        self.calls += 1
        return self.compute(hidden, weight, bias, labels, num_items_in_batch=torch.ones((), device=labels.device))

    def compute(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                ignore_index: int = IGNORE_INDEX, num_items_in_batch: Any = None) -> torch.Tensor:
        return linear_cross_entropy(hidden, weight, bias, labels, ignore_index=ignore_index,
                                    num_items_in_batch=num_items_in_batch, transforms=self.transforms,
                                    chunk=self.chunk)


def install(model: nn.Module, settings: MemoryKwargs, inner: nn.Module | None = None) -> ChunkedLoss | None:
    """Put the chunked loss on `model` as `settings` ask ("auto": where eligible); returns it, or None when off.
    Raises ValueError when ``chunked_loss=True`` and the model is not eligible. `inner`: as for `eligibility`."""
    inner = adapter_free(model) if inner is None else inner
    if settings.chunked_loss is False:
        setattr(inner, STATUS_ATTR, "off: MemoryKwargs(chunked_loss=False)")
        return None
    try:
        inner, head, transforms = eligibility(model, inner)
    except Ineligible as exc:
        if settings.chunked_loss is True:
            raise ValueError(f"MemoryKwargs(chunked_loss=True): {exc}; leave it 'auto' (the model's own loss then "
                             "runs) or set chunked_loss=False") from None
        if isinstance(inner, nn.Module):
            object.__setattr__(inner, STATUS_ATTR, f"off: {exc}")
        return None
    existing = getattr(inner, STATUS_ATTR, None)
    if isinstance(existing, ChunkedLoss):  # prepared twice (the same model object): keep the first
        return existing
    chunked = ChunkedLoss(inner, head, transforms, settings.loss_chunk_size, _model_loss(inner)[0])
    inner.register_forward_pre_hook(chunked.arm, with_kwargs=True)
    inner.register_forward_hook(chunked.disarm, with_kwargs=True, always_call=True)
    head.forward = chunked.forward_head
    inner.loss_function = chunked
    setattr(head, KEEP_IN_ROOT_ATTR, True)
    object.__setattr__(inner, STATUS_ATTR, chunked)
    return chunked


def chunked_loss_of(model: nn.Module, peeled: bool = False) -> ChunkedLoss | None:
    """The chunked loss installed on `model` (or the transformers model inside it), or None. `peeled`: `model` is
    already the transformers model (no adapter wrapper to look through)."""
    status = getattr(model if peeled else adapter_free(model), STATUS_ATTR, None)
    return status if isinstance(status, ChunkedLoss) else None


def chunked_loss_status(model: nn.Module) -> str:
    """"on" (with the transforms it applies), or "off: <why>", for a prepared model."""
    from ..interface import unwrap

    inner = adapter_free(unwrap(model))
    status = getattr(inner, STATUS_ATTR, None)
    if isinstance(status, ChunkedLoss):
        return "on" + (f" (logits transformed: {', '.join(t.op for t in status.transforms)})" if status.transforms
                       else "")
    return status if isinstance(status, str) else "off: not prepared by ndparallel"
