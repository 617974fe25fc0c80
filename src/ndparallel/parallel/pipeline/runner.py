"""The prepared model under pipeline parallelism: one call runs the whole schedule.

The training loop stays the loop. ``outputs = model(**batch)`` in training mode (with gradients enabled) cuts the
rank's batch into micro-batches and runs the schedule -- every micro-batch's forward *and* backward -- through
torch's `torch.distributed.pipelining`; gradients are in the parameters when it returns. ``outputs.loss`` is this
data rank's mean loss over its whole batch (as ``model(**batch).loss`` is without stages), the same tensor on every
stage, so logging, ``accelerator.reduce_loss`` and ``accelerator.gather`` work unchanged. ``accelerator.backward``
knows the gradients are there (`consume_backward`) and does nothing more. Without gradients (``torch.no_grad()`` or ``model.eval()``)
the call runs a forward-only schedule and returns the loss (when labels are given) and the logits on every stage.

The loss is made right here, as `ndparallel.training.loss` makes it elsewhere. Each micro-batch j of the last stage
gives the sum S_j of its token losses (the model's own loss function, summed); what flows into backward is ``S_j * f /
n`` -- f the factor `backward` would have scaled this rank's mean loss by (`GradientState.loss_factor`, given at
construction), n the rank's loss tokens (`ndparallel.training.loss.count_loss_tokens`) -- so the gradients are exactly
those of ``f * (sum_j S_j) / n``, the rank's mean loss weighted as without stages, whatever the micro-batches' shares of
tokens. Given ``num_items_in_batch`` (as transformers' Trainer passes it), that count takes n's place, as it does in a
Hugging Face model's own loss. A model without a loss of its own (an nn.Sequential) uses
``PipelineParallelConfig(loss_fn=...)``, a mean over the micro-batch; its micro-batches weigh alike (``f / m`` each),
which is the rank's mean when micro-batches are equal in size, as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

from ...configuration.handlers import PP_SCHEDULES, PipelineParallelConfig
from ...training.loss import IGNORE_INDEX, count_loss_tokens, loss_labels
from ..adapted import adapter_free
from ..gathered import release_gathered
from ..interface import PreparedModel
from ..memory import chunked_loss_of
from ..memory.cross_entropy import aligned_labels
from ..sequence import active
from .balancing import BalancingTerm
from .split import StagePlan

# Batch keys a decoder stage takes besides the token ids and the labels.
_DECODER_INPUTS = ("attention_mask", "position_ids")
# With the chunked loss, training hands every stage the aligned labels too; the last one computes its loss from them.
_LOSS_LABELS = "loss_labels"


class PipelineModel(nn.Module, PreparedModel):
    """This rank's stages of a model and the schedule that runs them (see the module docstring). ``module`` is the
    model cut to this rank's stages, under its own parameter names (`unwrap` returns it). `loss_factor`: the
    Accelerator's `GradientState.loss_factor`; `sync_gradients`: whether the current micro-step ends the optimizer
    step."""

    holds_every_parameter = False  # the other stages' parameters live on the other ranks of the pipeline

    def __init__(self, module: nn.Module, stages: dict[int, nn.Module], plan: StagePlan,
                 handler: PipelineParallelConfig, group: dist.ProcessGroup, device: torch.device,
                 tie_group: dist.ProcessGroup | None = None, loss_factor: Callable[[], float] = lambda: 1.0,
                 sync_gradients: Callable[[], bool] = lambda: True, balancing: BalancingTerm | None = None,
                 adapted: nn.Module | None = None) -> None:
        super().__init__()
        self.module = module
        # The causal LM whose parts the stages run: the module itself, or under PEFT the transformers model it adapts
        # (an attribute, not a submodule: `module` holds it under its own names).
        object.__setattr__(self, "adapted", adapter_free(module) if adapted is None else adapted)
        self._stage_modules = stages  # stage index -> its module (FSDP2 / DDP roots); not registered twice
        self.plan = plan
        self.handler = handler
        self.group = group
        self.device = device
        self.microbatches = handler.microbatches or plan.num_stages
        self.loss_factor = loss_factor
        self.sync_gradients = sync_gradients
        self.tie_group = tie_group  # this rank's copy of a tied embedding / head and the other end's
        self._backward_ran = False  # the last call ran backward: accelerator.backward has nothing left to do
        self._schedules: dict[Any, Any] = {}
        self.balancing = balancing  # a mixture of experts' load-balancing term (`balancing`), else None
        self.config = getattr(module, "config", None)

    # ---- the prepared-model interface (`ndparallel.parallel.interface`) ----------------------------------------
    def state_module(self) -> nn.Module:
        """The model cut to this rank's stages: each rank holds its stages' part, and the parts make the model."""
        return self.module

    def unwrapped(self) -> nn.Module:
        return self.module

    def consume_backward(self) -> bool:
        ran, self._backward_ran = self._backward_ran, False
        return ran

    def release_gathered(self) -> dict[int, torch.Tensor]:
        """As a whole model's (`PreparedModel.release_gathered`), over the stage modules: each is an FSDP2 root of its
        own, and not a submodule of `module`."""
        released: dict[int, torch.Tensor] = {}
        for stage in self.stage_modules:
            released.update(release_gathered(stage))
        return released | release_gathered(self.module)

    def gather_parts(self, state: dict[str, Any]) -> dict[str, Any]:
        """Collective: every stage's `state` (full tensors), on rank 0 (an empty dict elsewhere). The first rank of
        each stage -- the pipeline group of rank 0 -- sends its stage's to rank 0 (which therefore holds the whole
        model in CPU memory once)."""
        members = dist.get_process_group_ranks(self.group)
        if 0 not in members:
            return {}
        parts: list[Any] | None = [None] * len(members) if dist.get_rank() == 0 else None
        dist.gather_object(state, parts, dst=0, group=self.group)
        return {name: t for part in parts for name, t in part.items()} if parts is not None else {}

    # ---- the stage modules ------------------------------------------------------------------------------------
    @property
    def stage_modules(self) -> list[nn.Module]:
        return [self._stage_modules[s] for s in sorted(self._stage_modules)]

    def train(self, mode: bool = True) -> PipelineModel:
        """Train / eval mode for the model and for the stage modules (views of it, not registered as children)."""
        super().train(mode)
        for stage in self._stage_modules.values():
            stage.train(mode)
        return self

    def _stage_rank(self, stage: int) -> int:
        """The global rank that holds `stage` in this rank's pipeline."""
        return dist.get_global_rank(self.group, self.plan.rank_of(stage))

    # ---- one call ----------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor | None = None, *args: Any, labels: torch.Tensor | None = None,
                **kwargs: Any) -> Any:
        if args:
            raise TypeError("a model with pipeline stages takes its inputs by name (model(**batch)), plus at most "
                            "the first stage's input positionally")
        check = getattr(self.module, "sequence_input_check", None)  # context / sequence parallelism in the stages
        if check is not None and active() is not None:
            input_ids, labels, kwargs = self._sequence_inputs(check, input_ids, labels, kwargs)
        shift_labels = kwargs.pop("shift_labels", None)
        items = kwargs.pop("num_items_in_batch", None)  # the loss's denominator, given by the Trainer
        decoder = self.plan.kind == "decoder"
        extra = sorted(k for k, v in kwargs.items() if v is not None and (not decoder or k not in _DECODER_INPUTS))
        if extra:
            accepted = "input_ids, labels, shift_labels, " + ", ".join(_DECODER_INPUTS) if decoder else \
                "the input (positionally or as input_ids) and labels"
            raise ValueError(f"pipeline stages: unexpected model input(s) {extra}; a model with pp_size > 1 takes "
                             f"{accepted}")
        if input_ids is None:
            raise ValueError("pipeline stages: the model needs input_ids (the first stage's input)")
        rows = input_ids.shape[0]
        if rows % self.microbatches:
            raise ValueError(
                f"pipeline stages: this rank's batch has {rows} rows, which do not split into "
                f"{self.microbatches} micro-batches; use a per-rank batch size that is a multiple of "
                f"{self.microbatches} or set PipelineParallelConfig(microbatches=...) to a divisor of it")
        inputs = {k: v for k, v in kwargs.items() if v is not None}
        if decoder and inputs.get("position_ids") is not None and inputs["position_ids"].shape[0] != rows:
            inputs["position_ids"] = inputs["position_ids"].expand(rows, -1)  # a shared row, for every micro-batch
        target = shift_labels if shift_labels is not None else labels
        train = self.training and torch.is_grad_enabled()
        if train and target is None:
            raise ValueError("pipeline stages: training runs the loss inside the schedule, so the batch needs labels "
                             "(or shift_labels)")
        if items is not None and not decoder:
            raise ValueError("pipeline stages: num_items_in_batch is for models with a token loss of their own")
        items = float(items) if items is not None and not torch.is_tensor(items) else items
        if train:
            return self._train(input_ids, inputs, target, shifted=shift_labels is not None, items=items)
        return self._evaluate(input_ids, inputs, target, shifted=shift_labels is not None, items=items)

    def _sequence_inputs(self, check: Callable, input_ids: torch.Tensor | None, labels: torch.Tensor | None,
                         kwargs: dict) -> tuple[torch.Tensor | None, torch.Tensor | None, dict]:
        """The model's context-parallel input check (`ndparallel.parallel.sequence.hooks`), as its forward would
        run it: global position_ids, shift_labels as the labels, the batch's documents described once."""
        _, checked = check(self.module, (), {"input_ids": input_ids, "labels": labels, **kwargs})
        if active().documents is not None:
            raise ValueError("pipeline stages with context/sequence parallelism take whole causal rows only: padded or "
                             "packed batches (attention_mask with padding, position_ids restarting) are not supported "
                             "with pp yet; use cp/sp without pp for them, or pp without cp/sp")
        checked.pop("use_cache", None)  # the stages run without a cache
        return checked.pop("input_ids"), checked.pop("labels", None), checked

    def _train(self, input_ids: torch.Tensor, inputs: dict, target: torch.Tensor, shifted: bool,
               items: float | torch.Tensor | None = None) -> Any:
        sums: list[torch.Tensor] = []
        chunked = chunked_loss_of(self.module) if self.plan.kind == "decoder" else None
        if chunked is not None:  # the last stage returns each micro-batch's summed token loss (`DecoderStage`)
            inputs = {**inputs, _LOSS_LABELS: target if shifted else aligned_labels(target, None)}
        if self.plan.kind == "decoder":
            # The rank's loss tokens, counted on the device (nothing read on the host); a micro-batch without any
            # sums to 0 whatever it is scaled by.
            tokens = items if items is not None else \
                (loss_labels({"shift_labels" if shifted else "labels": target}) != IGNORE_INDEX).sum()
            if torch.is_tensor(tokens):
                scale = self.loss_factor() / tokens.clamp(min=1)
            else:
                scale = self.loss_factor() / tokens if tokens else 0.0

            def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
                total = logits if chunked is not None else self._token_loss_sum(logits, labels, shifted)
                sums.append(total.detach())
                return total * (scale.to(total.dtype) if torch.is_tensor(scale) else scale)
        else:
            user_loss, scale = self._user_loss(), self.loss_factor() / self.microbatches

            def loss_fn(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
                loss = user_loss(output, labels)
                sums.append(loss.detach())
                return loss * scale
        aux = self._balancing_pass(input_ids, inputs) if self.balancing is not None else None
        schedule = self._schedule(input_ids, inputs, loss_fn, train=True)
        fresh = not getattr(schedule, "_ndparallel_stepped", False)
        with self.balancing.adding(fresh) if aux is not None else nullcontext():
            self._step(schedule, input_ids, target=target, return_outputs=False, **inputs)
        schedule._ndparallel_stepped = True
        if self.tie_group is not None and self.sync_gradients():
            self._sum_tied_gradients()
        self._backward_ran = True
        if sums:  # the last stage: this rank's mean loss over its batch
            # A new schedule's first step also runs the loss once while it learns the stages' shapes: the step's
            # own micro-batches are the last m calls.
            total = torch.stack(sums[-self.microbatches:]).sum()
            loss = total / tokens if self.plan.kind == "decoder" else total / self.microbatches
        else:
            loss = torch.zeros((), device=self.device)
        loss = self._broadcast(loss.float().reshape(1)).reshape(())
        if aux is not None:  # the load-balancing term of the global batch, as `ndparallel.parallel.moe` adds it
            loss = loss + self.balancing.coef * aux.to(loss.device, loss.dtype)
        return self._output(loss, None)

    def _balancing_pass(self, input_ids: torch.Tensor, inputs: dict) -> torch.Tensor:
        """The load-balancing term's first pass (`balancing`): a forward-only schedule recording every router, the RNG
        restored after it; returns G of the global batch and leaves the gradients the training schedule adds. The
        chunked loss's labels are left out: the last stage returns its logits, which the schedule can merge (a
        micro-batch's loss is a 0-dim tensor, which it cannot)."""
        inputs = {k: v for k, v in inputs.items() if k != _LOSS_LABELS}
        schedule = self._schedule(input_ids, inputs, None, train=False)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad(), self.balancing.recording() as records:
            self._step(schedule, input_ids, **inputs)
        return self.balancing.value(records, self.microbatches, inputs.get("attention_mask"),
                                    self.balancing.loss_group, factor=self.loss_factor())

    @torch.no_grad()
    def _evaluate(self, input_ids: torch.Tensor, inputs: dict, target: torch.Tensor | None, shifted: bool,
                  items: float | None = None) -> Any:
        schedule = self._schedule(input_ids, inputs, None, train=False)
        with self.balancing.recording() if self.balancing is not None else nullcontext() as records:
            logits = self._step(schedule, input_ids, **inputs)
        last = self._stage_rank(self.plan.num_stages - 1) == dist.get_rank()
        logits = self._broadcast_tensor(logits if last else None)
        loss = None
        if target is not None:
            if self.plan.kind == "decoder":
                tokens = items if items is not None else \
                    count_loss_tokens({"shift_labels" if shifted else "labels": target})
                loss = self._token_loss_sum(logits, target, shifted) / tokens if tokens else \
                    logits.new_tensor(float("nan"))
            else:
                loss = self._user_loss()(logits, target)
            if records is not None:  # this rank's own load-balancing term over its tokens, as without stages
                aux = self.balancing.value(records, self.microbatches, inputs.get("attention_mask"))
                loss = loss + self.balancing.coef * aux.to(loss.device, loss.dtype)
        return self._output(loss, logits)

    # ---- a tied embedding and LM head ------------------------------------------------------------------------------
    def tied_copies(self) -> list[nn.Parameter]:
        """This rank's copies of a tied embedding / LM head weight: the embedding's on the first stage, the head's on
        the last (their values stay equal: both get the sum of both gradients, and the same optimizer update)."""
        if not self.plan.tied:
            return []
        inner, head = self.adapted.model, self.adapted.lm_head
        return [m.weight for m in (getattr(inner, "embed_tokens", None), head) if m is not None]

    def _sum_tied_gradients(self) -> None:
        """One weight used at both ends of the pipeline: its gradient is the sum of the embedding's and the head's.
        Summed once per optimizer step, over the accumulated gradients (the copies are sharded alike inside their
        stages, so local shards meet local shards)."""
        for param in self.tied_copies():
            grad = param.grad
            if grad is None:
                grad = param.grad = torch.zeros_like(param)
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            dist.all_reduce(local, group=self.tie_group)

    def norm_duplicates(self) -> list[nn.Parameter]:
        """Parameters whose gradient another stage holds too (the head's copy of a tied weight): left out of the
        gradient norm so the weight counts once, as in one process."""
        return [self.adapted.lm_head.weight] if self.tied_copy_names() else []

    def tied_copy_names(self) -> dict[str, str]:
        """{name of this rank's second copy of a tied weight: the weight's first name} -- the head's copy on the last
        stage, ``{"lm_head.weight": "model.embed_tokens.weight"}``; empty elsewhere. An unsplit tied model's optimizer
        keeps the weight's state under the first name, and so do checkpoints written under stages."""
        if not self.plan.tied or self.adapted.lm_head is None:
            return {}
        prefix = next(f"{name}." for name, m in self.module.named_modules() if m is self.adapted).lstrip(".")
        return {f"{prefix}lm_head.weight": f"{prefix}model.embed_tokens.weight"}

    # ---- losses ---------------------------------------------------------------------------------------------------
    def _token_loss_sum(self, logits: torch.Tensor, labels: torch.Tensor, shifted: bool) -> torch.Tensor:
        """The sum of a micro-batch's token losses, by the model's own loss function (its mean times 1 item)."""
        model = self.adapted
        vocab = logits.shape[-1]
        one = torch.ones((), device=logits.device)
        if shifted:
            return model.loss_function(logits=logits, labels=None, shift_labels=labels, vocab_size=vocab,
                                       num_items_in_batch=one)
        return model.loss_function(logits=logits, labels=labels, vocab_size=vocab, num_items_in_batch=one)

    def _user_loss(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        if self.handler.loss_fn is None:
            raise ValueError("pipeline stages: this model computes no loss of its own; give "
                             "PipelineParallelConfig(loss_fn=lambda output, labels: ...) (a mean over the micro-batch)")
        return self.handler.loss_fn

    def _output(self, loss: torch.Tensor | None, logits: torch.Tensor | None) -> Any:
        if self.plan.kind != "decoder":
            return _Output(loss=loss, logits=logits)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=loss, logits=logits)

    # ---- between stages -------------------------------------------------------------------------------------------
    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last stage's `tensor` (same shape and dtype on every rank) on every rank of the pipeline."""
        tensor = tensor.to(self.device)
        dist.broadcast(tensor, src=self._stage_rank(self.plan.num_stages - 1), group=self.group)
        return tensor

    def _broadcast_tensor(self, tensor: torch.Tensor | None) -> torch.Tensor:
        """The last stage's `tensor`, whatever its shape and dtype, on every rank of the pipeline."""
        dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
        header = torch.zeros(9, dtype=torch.long, device=self.device)
        if tensor is not None:
            tensor = tensor.detach()
            header[0], header[1] = dtypes.index(tensor.dtype), tensor.dim()
            header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
        header = self._broadcast(header)
        shape = tuple(header[2:2 + int(header[1])].tolist())
        out = tensor.contiguous() if tensor is not None else torch.empty(shape, dtype=dtypes[int(header[0])],
                                                                           device=self.device)
        return self._broadcast(out)

    # ---- schedules -------------------------------------------------------------------------------------------------
    def _step(self, schedule: Any, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        """One step of torch's schedule. Only the rank holding the first stage hands it the token ids (torchtitan
        does the same): a later stage's inputs come from the stage before it, and torch 2.11's single-stage schedules
        refuse positional inputs there ("Can't supply input args for shape inference on non-first stage")."""
        return schedule.step(*((input_ids,) if 0 in self._stage_modules else ()), **kwargs)

    def _schedule(self, input_ids: torch.Tensor, inputs: dict, loss_fn: Callable | None, train: bool) -> Any:
        """torch's schedule over this rank's stages, built again when the micro-batches' shapes change (a stage
        learns the shapes it sends and receives on its first step)."""
        key = (train, tuple(input_ids.shape), tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(inputs.items())))
        schedule = self._schedules.get(key)
        if schedule is None:
            if len(self._schedules) >= 4:  # a few shapes at a time (training and evaluation, a last short batch)
                self._schedules.pop(next(iter(self._schedules)))
            schedule = self._schedules[key] = self._build()
        schedule._loss_fn = loss_fn  # per call: the scale depends on this batch's tokens
        schedule._has_backward = train
        return schedule

    def _build(self) -> Any:
        stages = [pipelining.PipelineStage(self._stage_modules[s], s, self.plan.num_stages, self.device,
                                           group=self.group) for s in sorted(self._stage_modules)]
        name = PP_SCHEDULES[self.handler.schedule][0]
        cls = getattr(pipelining.schedules, name)
        placeholder = _placeholder_loss  # replaced per call (`_schedule`); with a loss the schedule runs backward
        if len(stages) == 1:
            return cls(stages[0], self.microbatches, loss_fn=placeholder, scale_grads=False)
        return cls(stages, self.microbatches, loss_fn=placeholder, scale_grads=False)


def _placeholder_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("internal: the pipeline's loss function was not set for this step")


class _Output(dict):
    """``output.loss`` / ``output.logits`` of a model without outputs of its own (an nn.Sequential)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


# The zero-bubble schedules split each backward into input and weight gradients. torch 2.11's and 2.12.1's weight
# step fails on a custom autograd function in a stage, such as the chunked loss's ("Attribute '_input_metadata' is
# invalid for this instance of _C._FunctionBase"); torch 2.13 and 2.14.1 run them (tests/parallel/pipeline).
SPLIT_BACKWARD_TORCH = (2, 13)


def check_schedule(handler: PipelineParallelConfig, plan: StagePlan) -> None:
    """Raise, before any collective, for schedules this torch cannot run and micro-batch counts torch's schedules
    refuse."""
    if handler.schedule in ("zero_bubble", "zbv") and \
            torch.torch_version.TorchVersion(torch.__version__) < SPLIT_BACKWARD_TORCH:
        raise ValueError(f"schedule {handler.schedule!r} needs torch >= 2.13 (installed: torch {torch.__version__}): "
                         "older torch's split backward fails on a custom autograd function in a stage, such as the "
                         "chunked loss's; use '1f1b' or 'interleaved_1f1b', or upgrade torch")
    m = handler.microbatches or plan.num_stages
    if handler.schedule in ("1f1b", "zbv") and m < plan.num_stages:
        raise ValueError(f"schedule {handler.schedule!r} needs at least as many micro-batches as stages: "
                         f"microbatches={m} < {plan.num_stages} stages; raise microbatches or use 'gpipe'")
    if handler.schedule in ("interleaved_1f1b", "zero_bubble"):
        rounds = max(1, m // plan.pp)
        if m % rounds:
            raise ValueError(f"schedule {handler.schedule!r} needs micro-batches in whole rounds of pp_size="
                             f"{plan.pp}: microbatches={m}; use a multiple of {plan.pp}")
