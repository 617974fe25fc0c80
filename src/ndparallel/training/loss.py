"""Making the loss right across ranks and gradient-accumulation steps: the one place that knows which tokens count.

When tokens are weighted (`is_causal_lm`). Token weighting applies where the loss really is a mean over shifted LM
tokens: every prepared model is a causal language model (or the user says so: ``Accelerator(loss_weighting=
"tokens")``). Any other loss -- sequence or token classification, regression, a plain module's own loss -- keeps
Accelerate's meaning: each rank's loss weighs the same, divided over the accumulation steps (exact when every rank's
micro-batch holds the same number of samples and the loss is a mean over them).

Which tokens count (`loss_labels`, `count_loss_tokens`). A causal LM predicts token t+1 at position t, so the label
of position t is ``labels[t+1]``: the batch's ``shift_labels`` when it has them (already shifted, as context
parallelism needs), else its ``labels`` shifted the way Hugging Face models shift them (``labels[..., 1:]``, -100 at
the end). Positions labelled -100 do not count. Under context/sequence parallelism a rank's loss averages over its
shard of the positions only; `count_loss_tokens(batch, shard=...)` counts those (the shard comes from
`ndparallel.parallel.sequence.SequenceSharding`, which knows the geometry). Nothing else in the library counts loss
tokens.

The gradient. The target is the gradient a single process would get from the mean token loss over the *global*
batch of one optimizer step: every token of every micro-batch of every rank of the ``loss`` view, each weighted
equally.

    L = (1 / N) * sum_{steps a} sum_{ranks r} S_{a,r}

where S_{a,r} is the sum of token losses of rank r's micro-batch at accumulation step a, and N = sum n_{a,r} is
the number of counted tokens over the whole optimizer step.

What each rank has is its own mean, l_{a,r} = S_{a,r} / n_{a,r} (what Hugging Face models and
``F.cross_entropy(..., ignore_index=-100)`` return). The data-parallel wrapper *averages* gradients over the W
ranks of the ``loss`` view, and accumulation *adds* the micro-steps' gradients. So `backward` scales each
rank's loss by

    f_{a,r} = n_{a,r} * W / N

and the gradient that results is (1/W) * sum_r sum_a f_{a,r} * grad(l_{a,r}) = (1/N) * sum grad(S_{a,r}) = grad(L).

The prepared data loader supplies the counts: it reads one accumulation window of batches ahead, counts each
batch's tokens, and all-reduces the window's total over ``batch`` (ranks with distinct samples; context- and
sequence-parallel peers share samples, so summing over them would count tokens twice). The all-reduce starts when
the window is drawn and is waited for at the first `loss_factor` (`TokenTotal`), so it overlaps the first forward;
the factor is then computed on the device from N (the host never reads N: no host-device sync).
When the counts are unknown (no labels in the batch, or a data loader that was not prepared), the factor falls back
to Accelerate's 1 / gradient_accumulation_steps -- also in a short last window, as Accelerate divides -- which is
exact when every micro-batch has the same number of tokens and the window is whole.

The logged loss (`GradientState.log_loss`, behind ``Accelerator.reduce_loss``). Each rank adds S_{a,r} = l_{a,r} *
n_{a,r} and n_{a,r} of every micro-step of a window; summed over the ``loss`` ranks, their ratio is the token mean of
the step so far, and L itself on the micro-step that ends the window. Without counts each loss weighs 1: the plain
mean over ranks and micro-steps.

Which loader counts. Loaders register as active while they are iterated, innermost last (as Accelerate's
GradientState keeps a stack of active loaders): the loss factor, the accumulation window and the logged loss follow
the innermost active loader, so an evaluation loader iterated inside a training step never feeds the training loss.
Outside any loop they follow the loader that yielded last.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .singletons import current

IGNORE_INDEX = -100
LOSS_WEIGHTINGS = ("auto", "tokens", "mean")


def is_causal_lm(model: nn.Module) -> bool:
    """Whether `model` (unwrapped) computes a mean over shifted LM tokens: a Hugging Face causal language model."""
    loss_type = getattr(model, "loss_type", None)
    if loss_type is not None:
        return loss_type == "ForCausalLM"
    if getattr(model, "config", None) is None:
        return False
    try:  # models whose class name transformers' loss registry does not recognise (GPT2LMHeadModel...)
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    # The class or one it derives from: FSDP2 replaces a model's class by a subclass (FSDPGPT2LMHeadModel).
    names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return any(cls.__name__ in names for cls in type(model).__mro__)


def loss_labels(batch: Any) -> torch.Tensor | None:
    """The label of every position of `batch` under a causal-LM loss, aligned with the positions (see the module
    docstring), or None when the batch has neither ``shift_labels`` nor ``labels``."""
    if not isinstance(batch, Mapping):
        return None
    shifted = batch.get("shift_labels")
    if isinstance(shifted, torch.Tensor):
        return shifted
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor) and labels.dim() >= 1:
        return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    return None


def count_loss_tokens(batch: Any,
                      shard: Callable[[torch.Tensor], torch.Tensor | None] | None = None) -> int | None:
    """Tokens that contribute to the loss of `batch` (labels other than -100), or None when it cannot tell.

    `shard` takes the aligned labels (sequence on the last dimension) to this rank's part of them, for a rank that
    sees only part of each sequence; it returns None when the length cannot be split (then so does this).
    """
    labels = loss_labels(batch)
    if labels is not None and shard is not None:
        labels = shard(labels)
    if labels is None:
        return None
    return int((labels != IGNORE_INDEX).sum())


class TokenTotal:
    """N of a window, summed over the batch view by an all-reduce that the data loader starts when it draws the
    window's batches. The factor is computed from it on its device (`factor`): the host never reads N, so a GPU's
    queue never drains for it; waiting for the all-reduce (at the first backward) makes the device's stream wait
    for it on NCCL, and the round trip overlaps the forward. `value` reads N on the host (a sync on a GPU)."""

    def __init__(self, total: torch.Tensor, work: Any) -> None:
        self._total, self._work, self._inverse, self._value = total, work, None, None

    def _wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None

    def factor(self, numerator: int) -> torch.Tensor:
        """``numerator / N`` as a 0-dim fp64 tensor on N's device (the loss rounds it once to its own dtype), 0 when
        N is 0 (then every numerator is 0 too)."""
        if self._inverse is None:
            self._wait()
            self._inverse = self._total.reshape(()).clamp(min=1).double().reciprocal()
        return self._inverse * numerator

    def value(self) -> int:
        if self._value is None:
            self._wait()
            self._value = int(self._total.item())
        return self._value


@dataclass
class BatchInfo:
    """What the prepared data loader knows about the batch it just yielded."""

    local_tokens: int | None  # n_{a,r}
    window_tokens: int | TokenTotal | None  # N, over the batch view and the accumulation window
    window_batches: int  # micro-batches in this accumulation window (the last one may be short)
    ends_window: bool  # last micro-batch before an optimizer step
    end_of_dataloader: bool
    # Accelerate's meaning: the real samples of a final global batch that is not whole (0 when it is whole). The
    # samples repeated to even it out across ranks come after them in rank order, so gathering, then keeping the
    # first `remainder` rows, keeps every sample once.
    remainder: int = 0
    sequence_shards: Any = None  # the cp x sp shards chosen for this batch (a document-balanced one), None: default


def loss_factor(info: BatchInfo | None, loss_world_size: int, accumulation_steps: int,
                token_weighted: bool = True) -> float | torch.Tensor:
    """f = n * W / N for the micro-batch `info` describes (see the module docstring), else Accelerate's
    1 / accumulation steps. A 0-dim tensor on the device when N is summed over ranks (`TokenTotal.factor`: nothing
    is read on the host), else a float."""
    if info is None:
        return 1.0 / accumulation_steps
    if not token_weighted or info.local_tokens is None or info.window_tokens is None:
        return 1.0 / accumulation_steps
    if isinstance(info.window_tokens, TokenTotal):
        return info.window_tokens.factor(info.local_tokens * loss_world_size)
    if info.window_tokens == 0:
        return 0.0
    return info.local_tokens * loss_world_size / info.window_tokens


class GradientState:
    """Accumulation bookkeeping: when gradients synchronise, which data loader's batch the step is on, and the
    running sums of the logged loss."""

    def __new__(cls, accumulation_steps: int | None = None, loss_world_size: int | None = None) -> GradientState:
        if accumulation_steps is None and loss_world_size is None:  # Accelerate's singleton: the newest Accelerator's
            return current(GradientState, "GradientState")
        return super().__new__(cls)

    def __getnewargs__(self) -> tuple[int, int]:
        return (self.accumulation_steps, self.loss_world_size)  # pickle makes a new object, not the current one

    def __init__(self, accumulation_steps: int | None = None, loss_world_size: int | None = None) -> None:
        if accumulation_steps is None and loss_world_size is None:  # the current one, returned by __new__
            return
        GradientState._latest = weakref.ref(self)
        self.accumulation_steps = accumulation_steps
        self.loss_world_size = loss_world_size
        self.token_weighted = True  # the loss is a mean over LM tokens (the Accelerator decides; `is_causal_lm`)
        self.sync_gradients = True
        self.step = 0
        self.optimizer_steps = 0  # optimizer steps (synchronising micro-steps) begun, kept by checkpoints
        self._active: list[Hashable] = []  # loaders being iterated, innermost last
        self._last: Hashable | None = None  # the loader that yielded last
        self._batches: dict[Hashable, BatchInfo] = {}
        self._fresh: set[Hashable] = set()  # loaders whose latest batch no micro-step has started on yet
        self._logged: dict[Hashable, tuple[torch.Tensor, BatchInfo | None, bool]] = {}  # log_loss's running sums
        self.plugin_kwargs: dict[str, Any] = {"num_steps": accumulation_steps}  # Accelerate's: the plugin's settings

    @staticmethod
    def _reset_state() -> None:
        """Accelerate's: forget the process's shared gradient state. Each Accelerator has its own here (a new one
        starts afresh), so only ``GradientState()``'s answer is forgotten."""
        GradientState._latest = None

    # ---- data loaders ------------------------------------------------------------------------------------------
    def enter(self, loader: Hashable) -> None:
        """`loader` starts a pass: its batches feed the step until it ends (`leave`)."""
        self._active.append(loader)

    def leave(self, loader: Hashable) -> None:
        if loader in self._active:
            del self._active[len(self._active) - 1 - self._active[::-1].index(loader)]

    def on_batch(self, loader: Hashable, info: BatchInfo) -> None:
        self._batches[loader] = info
        self._fresh.add(loader)
        self._last = loader

    def _current(self) -> Hashable | None:
        return self._active[-1] if self._active else self._last

    @property
    def batch(self) -> BatchInfo | None:
        """What the current data loader (innermost active, else the last to yield) said of its latest batch."""
        return self._batches.get(self._current())

    @property
    def remainder(self) -> int:
        """On the current loader's final batch, when it is not a whole global batch, its number of real samples
        (`gather_for_metrics` keeps that many rows); 0 otherwise. Accelerate's meaning."""
        info = self.batch
        return info.remainder if info is not None and info.end_of_dataloader else 0

    @property
    def num_steps(self) -> int:
        """Accelerate's name: micro-steps per optimizer step (the optimizer steps done are `optimizer_steps`)."""
        return self.accumulation_steps

    @property
    def active_dataloader(self) -> Hashable | None:
        """The innermost prepared data loader being iterated (Accelerate's name), or None."""
        return self._active[-1] if self._active else None

    @property
    def in_dataloader(self) -> bool:
        """Whether a prepared data loader is being iterated."""
        return bool(self._active)

    @property
    def end_of_dataloader(self) -> bool:
        info = self.batch
        return info is not None and info.end_of_dataloader

    # ---- micro-steps -------------------------------------------------------------------------------------------
    def advance(self) -> bool:
        """Called when a micro-step starts (``accumulate``); returns whether this step synchronises."""
        key = self._current()
        if key in self._fresh:
            # The prepared data loader knows where the windows end, including a short last one.
            self._fresh.discard(key)
            self.sync_gradients = self._batches[key].ends_window
            self.step = 0 if self.sync_gradients else self.step + 1
        else:
            self.step += 1
            self.sync_gradients = self.step % self.accumulation_steps == 0
            if self.sync_gradients:
                self.step = 0
        self.optimizer_steps += self.sync_gradients
        return self.sync_gradients

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        """Accelerate's setter for a loop that runs its own accumulation windows (the Hugging Face Trainer does):
        whether the coming micro-step ends one (its optimizer step then happens)."""
        self.sync_gradients = bool(sync_gradients)
        self.optimizer_steps += self.sync_gradients

    def loss_factor(self) -> float | torch.Tensor:
        """The factor `backward` scales the current micro-batch's loss by (`loss_factor`)."""
        return loss_factor(self.batch, self.loss_world_size, self.accumulation_steps, self.token_weighted)

    def log_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Add this micro-step's mean loss to its window's running sums; return this rank's ``[sum of token losses,
        tokens]`` so far in fp64 (see the module docstring). Summed over the ``loss`` ranks, their ratio is the
        global token mean of the step so far."""
        if loss.numel() != 1:
            raise ValueError(f"reduce_loss expects this rank's mean loss (one element), got shape {tuple(loss.shape)}")
        key, info = self._current(), self.batch
        sums, last_info, window_ended = self._logged.get(key, (None, None, True))
        if info is not None and info is last_info:
            raise ValueError("reduce_loss was called twice for one micro-batch; call it once per micro-step with that "
                             "micro-step's loss")
        if window_ended or sums is None:
            sums = torch.zeros(2, dtype=torch.float64, device=loss.device)
        tokens = info.local_tokens if info is not None and self.token_weighted else None
        value = loss.detach().reshape(()).to(torch.float64)
        if tokens is None:  # unknown counts: every loss weighs one
            sums = sums + torch.stack([value, value.new_ones(())])
        elif tokens:  # a rank without loss tokens adds nothing (its mean over zero tokens may be NaN)
            sums = sums + torch.stack([value * tokens, value.new_tensor(float(tokens))])
        ends = info.ends_window if info is not None else self.sync_gradients
        self._logged[key] = (sums, info, ends)
        return sums

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int | bool]:
        """The counters a checkpoint keeps (accumulated gradients themselves are not saved)."""
        return {"step": self.step, "num_steps": self.optimizer_steps, "sync_gradients": self.sync_gradients}

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        self.step, self.optimizer_steps = int(state["step"]), int(state["num_steps"])
        self.sync_gradients = bool(state["sync_gradients"])
        self._batches.clear()
        self._fresh.clear()
        self._logged.clear()
