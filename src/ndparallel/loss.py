"""Making the loss right across ranks and gradient-accumulation steps.

The target is the gradient a single process would get from the mean token loss over the *global* batch of one
optimizer step: every token of every micro-batch of every rank of the ``loss`` view, each weighted equally.

    L = (1 / N) * sum_{steps a} sum_{ranks r} S_{a,r}

where S_{a,r} is the sum of token losses of rank r's micro-batch at accumulation step a, and N = sum n_{a,r} is
the number of counted tokens (labels != -100) over the whole optimizer step.

What each rank has is its own mean, l_{a,r} = S_{a,r} / n_{a,r} (what Hugging Face models and
``F.cross_entropy(..., ignore_index=-100)`` return). The data-parallel wrapper *averages* gradients over the W
ranks of the ``loss`` view, and accumulation *adds* the micro-steps' gradients. So `backward` scales each
rank's loss by

    f_{a,r} = n_{a,r} * W / N

and the gradient that results is (1/W) * sum_r sum_a f_{a,r} * grad(l_{a,r}) = (1/N) * sum grad(S_{a,r}) = grad(L).

The prepared data loader supplies the counts: it reads one accumulation window of batches ahead, counts each
batch's tokens, and all-reduces the window's total over ``batch`` (ranks with distinct samples; context- and
sequence-parallel peers share samples, so summing over them would count tokens twice). When the counts are
unknown (no ``labels`` in the batch, or a data loader that was not prepared), the factor falls back to
1 / (micro-batches in the window) -- Accelerate's 1 / gradient_accumulation_steps -- which is exact when every
micro-batch has the same number of tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

IGNORE_INDEX = -100


def count_loss_tokens(batch: Any) -> int | None:
    """Number of tokens that contribute to a causal-LM loss of `batch`, or None when it cannot tell.

    ``shift_labels`` (already shifted, as context parallelism needs) counts every position; ``labels`` (the
    Hugging Face convention: the model shifts them) counts positions 1..L-1. -100 is ignored.
    """
    if not isinstance(batch, Mapping):
        return None
    if isinstance(batch.get("shift_labels"), torch.Tensor):
        return int((batch["shift_labels"] != IGNORE_INDEX).sum())
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor) and labels.dim() >= 1:
        return int((labels[..., 1:] != IGNORE_INDEX).sum())
    return None


@dataclass
class BatchInfo:
    """What the prepared data loader knows about the batch it just yielded."""

    local_tokens: int | None  # n_{a,r}
    window_tokens: int | None  # N, over the batch view and the accumulation window
    window_batches: int  # micro-batches in this accumulation window (the last one may be short)
    ends_window: bool  # last micro-batch before an optimizer step
    end_of_dataloader: bool
    padding: int = 0  # samples repeated at the end of this (final) batch to even it out across ranks


class GradientState:
    """Accumulation bookkeeping: when gradients synchronise, and the loss factor of the current micro-batch."""

    def __init__(self, accumulation_steps: int, loss_world_size: int) -> None:
        self.accumulation_steps = accumulation_steps
        self.loss_world_size = loss_world_size
        self.sync_gradients = True
        self.step = 0
        self.num_steps = 0  # optimizer steps (synchronising micro-steps) begun, for checkpoints
        self.batch: BatchInfo | None = None
        self._batch_is_new = False
        self.remainder = 0  # padding of the last batch, for gather_for_metrics

    def on_batch(self, info: BatchInfo) -> None:
        self.batch = info
        self._batch_is_new = True
        self.remainder = info.padding if info.end_of_dataloader else 0

    def advance(self) -> bool:
        """Called when a micro-step starts (``accumulate``); returns whether this step synchronises."""
        if self._batch_is_new and self.batch is not None:
            # The prepared data loader knows where the windows end, including a short last one.
            self._batch_is_new = False
            self.sync_gradients = self.batch.ends_window
            self.step = 0 if self.sync_gradients else self.step + 1
        else:
            self.step += 1
            self.sync_gradients = self.step % self.accumulation_steps == 0
            if self.sync_gradients:
                self.step = 0
        self.num_steps += self.sync_gradients
        return self.sync_gradients

    def state_dict(self) -> dict[str, int | bool]:
        """The counters a checkpoint keeps (accumulated gradients themselves are not saved)."""
        return {"step": self.step, "num_steps": self.num_steps, "sync_gradients": self.sync_gradients}

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        self.step, self.num_steps = int(state["step"]), int(state["num_steps"])
        self.sync_gradients = bool(state["sync_gradients"])
        self.batch, self._batch_is_new, self.remainder = None, False, 0

    def loss_factor(self) -> float:
        """f = n * W / N for the current micro-batch (see the module docstring), else 1 / accumulation steps."""
        info = self.batch
        if info is None:
            return 1.0 / self.accumulation_steps
        if info.local_tokens is None or info.window_tokens is None:
            return 1.0 / info.window_batches
        if info.window_tokens == 0:
            return 0.0
        return info.local_tokens * self.loss_world_size / info.window_tokens
