"""The Hugging Face ``Trainer`` (and TRL's trainers, which derive from it) on ndparallel's N-D layouts.

When. A Trainer is taken over when it is asked for a layout: the script runs under ``ndparallel launch`` with sizes
(the ``NDPARALLEL_*`` variables), or its ``TrainingArguments(parallelism_config=...)`` is an
``ndparallel.ParallelismConfig`` (any launcher). Otherwise it is left exactly as transformers made it.

What changes, each for a reason (the rest of the training loop is the Trainer's own):

1. Its Accelerator (`create_accelerator_and_postprocess`) is ndparallel's, built from the Trainer's own arguments
   (Accelerate's plugin objects converted field by field; sizes left unset come from the launch). The Trainer
   accumulates gradients itself (its Accelerator gets one micro-step per window) and normalises the loss itself,
   so ndparallel's `backward` adds no weighting of its own (``loss_weighting="mean"``: a factor of one). The
   Trainer trains and evaluates the model `prepare` returned (`_wrap_model`), which keeps its place on record across
   the Trainer's ``free_memory()`` at every ``train()``. Accelerate's ``PartialState``, which the Trainer's arguments
   read, is configured again if a Trainer subclass reset it to have the Accelerator configure it (Axolotl's does:
   `_configure_accelerate_state`), and ``accelerator.state`` keeps what is written to its ``_shared_state``; its
   ``fsdp_plugin`` is the Accelerator's once built (`_TrainerView`). A Trainer method hooked here that another library
   replaces on ``Trainer`` afterwards is refused by name (`check_support`).
2. The loss's token count (`_get_num_items_in_batch`). The Trainer divides each micro-batch's summed token loss by
   a count X and, with ``average_tokens_across_devices``, multiplies it by M = processes / tp (DDP averages
   gradients over processes); its own X counts tokens over every process and divides by tp * cp * sp. ndparallel
   averages gradients over the W ranks of the ``loss`` view (batch x cp x sp) and counts each sample's tokens once
   (`ndparallel.training.loss.count_loss_tokens` on the full rows, summed over ``batch``), giving N, the tokens of the
   whole optimizer step. X = N * M / W makes every rank's loss S * W / N, so the averaged gradient is the one process's
   grad(sum S / N) and the logged loss (the Trainer's mean over processes) its sum S / N -- with
   ``average_tokens_across_devices`` on (M = W without pipeline stages) and off (M = 1), and whatever the -100 labels
   over ranks and micro-batches.
3. Context and sequence parallelism (`_prepare_context_parallel_inputs`): ``shift_labels`` made before sharding,
   ``position_ids`` added, then every sequence tensor of the batch sharded by `Accelerator.maybe_context_parallel`
   (cp and sp alike; padded and packed rows included: ndparallel keeps their masks). TRL's padding-free fields
   (``cu_seq_lens_*``, ``max_length_*``) are dropped after a check that they describe the rows ``position_ids``
   restarts at: ndparallel reads the documents from ``position_ids``. The Trainer's batches per epoch are the loader's
   length under sp too (`set_initial_training_values`: transformers counts sp_size times as many, for Accelerate's
   DeepSpeed-Ulysses adapter, which cuts each batch into sp_size; ndparallel's loader does not). The Trainer draws a whole accumulation
   window of batches before its first micro-step; each micro-step shards with what the data loader said of its own
   batch (`TrainerAccelerator._start_batch`). When the Trainer counts no tokens (a model that
   takes no ``num_items_in_batch``: ``model_accepts_loss_kwargs`` False), each rank's loss is its model's mean over
   its shard of the rows; the model's loss is then weighted (a forward hook while the batch is sharded: a subclass's
   own ``compute_loss`` keeps it) by the shard's share of the rows' loss tokens, n_r * G / n over the G ranks of
   cp x sp, so the ranks' average is the rows' mean, as in one process. Evaluation and prediction run whole rows on
   every rank of cp x sp (the logits ``compute_metrics`` reads are whole, as in one process; the loss's count for
   them divides over the ``batch`` ranks, whose losses the Trainer averages).
4. Saving and resuming. `save_model` gathers the full weights on every rank (collective) and the main process writes
   them, as ``save_pretrained`` does; a checkpoint's optimizer and model go into ``<checkpoint>/ndparallel/`` as a
   sharded ndparallel checkpoint, which loads under any other layout (`_save_optimizer_and_scheduler` /
   `_load_optimizer_and_scheduler`; ``load_best_model_at_end`` reads the best one's, `_load_best_model`); resuming
   skips the consumed batches of ndparallel's data loader (`skip_first_batches`). The LR scheduler and the Trainer's
   state are the Trainer's files.
5. Under ``ndparallel launch --fault-tolerant``: ``train`` and ``_save_checkpoint`` (installed always, acting only
   there) let a restarted replica group resume at the live step and one group write the checkpoints
   (`trainer_faults`).

Versions (`TESTED_TRANSFORMERS`: the oldest supported minor and the newest tested one). Every minor from 5.16 (what
Axolotl 0.19 pins) through 5.25 was read and tested: their Trainers have the methods replaced here (`HOOKS`) with the
same signatures and the same calls to them (where they differ, the replacements do not call the Trainer's own). One
difference matters: the factor M by which ``compute_loss`` multiplies the loss (item 2) divides the processes by
``get_tp_size()`` from 5.19 on, by its Accelerator's ``parallelism_config.tp_size`` before (`_loss_multiplier`).
Tested with transformers 5.25.0, TRL 1.16.0, PEFT 0.21.2, Accelerate 1.16.0, and with 5.16.1, TRL 1.9.2, PEFT 0.20.0,
Accelerate 1.13.0 (``.ci/run``'s oldest-versions environment); ``.ci/newest.sh`` runs the integration's tests on the
newest releases of each as CI runs. The policy, when a Trainer would be taken over (`check_support`):

- older than 5.16: refused, with the floor;
- newer than the newest tested minor: it runs, with one warning on the main process naming the tested range --
  provided every hook is there as written for (next point); a release is not refused for its number alone;
- whatever the version: a hooked method that is gone, whose parameters changed, or that the Trainer's subclass (TRL's
  trainers, Axolotl's) overrides without calling the Trainer's own, is refused by name, with what was expected.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import checkpoint
from ..configuration import plugins
from ..distributed.agreement import monitored_barrier
from ..accelerator import Accelerator
from ..configuration.parallelism import ParallelismConfig
from ..training.data import PreparedDataLoader
from ..training.loss import IGNORE_INDEX, count_loss_tokens
from ..training.prepared import PreparedObjects
from ..launch.worker import launch_sizes
from . import trainer_faults
from .trainer_versions import (HOOK_MARK, TESTED_TRANSFORMERS, check_support, check_version,  # noqa: F401
                               hook_problems, warn_once)

CHECKPOINT_SUBDIR = "ndparallel"  # inside the Trainer's checkpoint-<step> folder
_BUILDING: list[Any] = []  # the Trainer whose Accelerator is being built (create_accelerator_and_postprocess)


# ---- when ---------------------------------------------------------------------------------------------------------
def wanted(trainer: Any) -> bool:
    """Whether `trainer` is asked for an N-D layout (see the module docstring)."""
    return (isinstance(getattr(trainer.args, "parallelism_config", None), ParallelismConfig)
            or any(size != 1 for size in launch_sizes().values()))


def taken_over(trainer: Any) -> bool:
    return isinstance(getattr(trainer, "accelerator", None), Accelerator)


# ---- the Accelerator --------------------------------------------------------------------------------------------
def _converted(value: Any, kind: type) -> Any:
    """An Accelerate settings object as ndparallel's class of the same name (the fields both have)."""
    if value is None or isinstance(value, kind):
        return value
    names = {f.name for f in dataclasses.fields(kind) if f.init}
    return kind(**{name: getattr(value, name) for name in names if hasattr(value, name)})


def build_accelerator(trainer: Any, kwargs: dict[str, Any]) -> Any:
    """ndparallel's Accelerator from what the Trainer would give Accelerate's."""
    kwargs = dict(kwargs)
    kinds = {"dataloader_config": plugins.DataLoaderConfiguration,
             "gradient_accumulation_plugin": plugins.GradientAccumulationPlugin}
    for name, kind in kinds.items():
        kwargs[name] = _converted(kwargs.get(name), kind)
    if kwargs.get("fsdp_plugin") is not None:  # from what the user wrote (fsdp_config), not Accelerate's enums
        kwargs["fsdp_plugin"] = plugins.FullyShardedDataParallelPlugin(**(trainer.args.fsdp_plugin_args or {}))
    handlers = []
    for handler in kwargs.pop("kwargs_handlers", None) or []:
        mine = getattr(plugins, type(handler).__name__, None)
        handlers.append(_converted(handler, mine) if mine is not None else handler)
    kwargs["kwargs_handlers"] = handlers
    dynamo = kwargs.pop("dynamo_plugin", None)
    if dynamo is not None and str(getattr(dynamo.backend, "value", dynamo.backend)).lower() not in ("no", "none"):
        kwargs["dynamo_plugin"] = _converted(dynamo, plugins.TorchDynamoPlugin)
    config = kwargs.get("parallelism_config")
    if config is not None and not isinstance(config, ParallelismConfig):  # Accelerate's: its sizes
        kwargs["parallelism_config"] = ParallelismConfig(**{
            name: getattr(config, name) for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size",
                                                     "sp_size") if getattr(config, name, None) is not None})
    if kwargs.pop("deepspeed_plugin", None) is not None:
        raise ValueError("the Trainer was given a DeepSpeed config, but this run is ndparallel's (launched with "
                         "sizes, or an ndparallel ParallelismConfig): drop --deepspeed; FSDP2 (dp_shard_size) shards "
                         "parameters, gradients and optimizer states as ZeRO-3 does")
    return TrainerAccelerator(**kwargs, loss_weighting="mean")


class _TrainerView:
    """What the Trainer reads of ``accelerator.state``: ndparallel's state, with no DeepSpeed plugin, and no FSDP
    plugin while the Trainer builds its Accelerator (`create_accelerator_and_postprocess`), so that it takes none of
    its own FSDP routes (saving and resuming go through ndparallel here). Afterwards ``fsdp_plugin`` is the
    Accelerator's, as Accelerate's documentation has scripts use it before saving
    (``trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")``; Axolotl does): the Trainer
    itself reads it only behind ``is_fsdp_enabled``, which stays False.

    Accelerate's ``AcceleratorState`` keeps its attributes in the dict ``_shared_state`` (its ``__dict__``); so does
    the view: what a Trainer subclass writes there, or assigns, reads back from the view (Axolotl's mixin sets
    ``distributed_type`` both ways), and ndparallel's state underneath stays as it is."""

    deepspeed_plugin = None

    def __init__(self, state: Any) -> None:
        self._state = state
        self.fsdp_plugin = None  # the Accelerator's once the Trainer has built it

    @property
    def _shared_state(self) -> dict[str, Any]:
        return self.__dict__

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_state"], name)


def _configure_accelerate_state(device: torch.device) -> None:
    """Accelerate's ``PartialState`` configured, as an Accelerate Accelerator leaves it. The Trainer's arguments read
    the process's place from it (``args.distributed_state`` shares its state), and a Trainer subclass may have reset
    it just before the Accelerator is built so that Accelerate's configures it anew (Axolotl's ``AxolotlTrainer``
    does): then it is configured again here, on the process group that runs."""
    from accelerate.state import PartialState as AcceleratePartialState

    if AcceleratePartialState._shared_state:
        return
    backend = dist.get_backend() if dist.is_initialized() else None
    if backend is not None and (backend == "undefined" or ":" in backend):  # a group for several device types
        backend = dist.get_default_backend_for_device(device)
    AcceleratePartialState(cpu=device.type == "cpu", **({"backend": backend} if backend else {}))


class TrainerAccelerator(Accelerator):
    """ndparallel's Accelerator as the Trainer meets it: the Trainer runs the accumulation windows
    (``gradient_state._set_sync_gradients``), lists prepared models as ``_models``, and reads ``state`` through
    `_TrainerView`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        _configure_accelerate_state(self.device)
        self.gradient_state.plugin_kwargs = {"num_steps": self.gradient_accumulation_steps,
                                             "sync_each_batch": self._settings.sync_each_batch}
        self.state = _TrainerView(self.state)
        self._unstarted: dict[Any, collections.deque] = {}  # see `_start_batch`
        recorded = self.gradient_state.on_batch

        def on_batch(loader: Any, info: Any) -> None:
            if self.sequence_sharding is not None:
                self._unstarted.setdefault(loader, collections.deque(maxlen=4 * self.gradient_accumulation_steps)
                                           ).append(info)
            recorded(loader, info)

        self.gradient_state.on_batch = on_batch
        # What the Trainer multiplies the loss a model returns by before `backward` (`_get_num_items_in_batch` sets
        # it for each accumulation window): a model that runs backward inside its call weighs its loss by it too.
        self.loss_scale_after_the_call = 1.0

    def _loss_weight_inside_the_model(self) -> float:
        return super()._loss_weight_inside_the_model() * self.loss_scale_after_the_call

    def _start_batch(self) -> None:
        """The Trainer draws a whole accumulation window of batches before its first micro-step
        (``get_batch_samples``), and ``gradient_state.batch`` is what the data loader said of the latest one drawn. A
        context-parallel micro-step needs what it said of the batch it runs on (this shard's loss tokens, the
        sequence layout): the micro-steps take the batches in the order they were drawn, so each takes the oldest
        not yet started (recorded per data loader as they are drawn, under context or sequence parallelism)."""
        queue = self._unstarted.get(self.gradient_state.active_dataloader)
        if queue:
            self.gradient_state._batches[self.gradient_state.active_dataloader] = queue.popleft()

    def free_memory(self, *objects: Any) -> list[None]:
        """The Trainer frees memory as every ``train()`` starts. Its model stays as `prepare` made it (sharded in
        place, or wrapped: `_wrap_model` hands the Trainer the prepared one), so it stays on record."""
        models = list(self.prepared.models)
        out = super().free_memory(*objects)
        self.prepared.models.extend(models)
        return out


def _accelerator_factory(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def Accelerator(**kwargs: Any) -> Any:  # noqa: N802 -- stands where transformers looks up `Accelerator`
        if not _BUILDING:
            return original(**kwargs)
        return build_accelerator(_BUILDING[-1], kwargs)

    return Accelerator


# ---- the Trainer's methods --------------------------------------------------------------------------------------
def create_accelerator_and_postprocess(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any) -> None:
        if not wanted(self):
            return original(self)
        warning = check_support(self)
        if trainer_faults.asked():  # ndparallel launch --fault-tolerant: every rank alike, before any collective
            import transformers.trainer

            trainer_faults.check(self, transformers.trainer)
        if getattr(self.args, "train_sampling_strategy", None) == "batch_rebalance":
            raise ValueError("train_sampling_strategy='batch_rebalance' deals batches to data-parallel ranks by "
                             "process index, which under ndparallel's layouts (tensor, context, sequence or pipeline "
                             "ranks share a batch) would drop or repeat samples; use 'random', 'sequential' or "
                             "'group_by_length'")
        _BUILDING.append(self)
        try:
            original(self)
        finally:
            _BUILDING.pop()
        warn_once(warning, self.accelerator.is_main_process)
        self.is_fsdp_enabled = False  # its FSDP routes for saving and resuming are Accelerate's; ndparallel's here
        self.accelerator.state.fsdp_plugin = self.accelerator.fsdp_plugin  # for the script's (see _TrainerView)
    return wrapper


def get_num_items_in_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, batch_samples: list, device: torch.device) -> torch.Tensor | int | None:
        if not taken_over(self):
            return original(self, batch_samples, device)
        acc = self.accelerator
        counts = [count_loss_tokens(batch) for batch in batch_samples]
        if (not batch_samples or any(count is None for count in counts)
                or not (self.model_accepts_loss_kwargs or self.compute_loss_func is not None)):
            # The Trainer then divides each micro-batch's mean loss by the micro-batches (Accelerate's meaning).
            if torch.is_grad_enabled():
                acc.loss_scale_after_the_call = 1.0 / max(1, len(batch_samples))
            return None
        total = torch.tensor([float(sum(counts))], dtype=torch.float64, device=acc.device)
        if acc.mesh.size("batch") > 1:
            dist.all_reduce(total, group=acc.mesh.group("batch"))
        multiplier = _loss_multiplier(self) if self.args.average_tokens_across_devices else 1
        if torch.is_grad_enabled():  # training: see the module docstring, item 2: X = N * M / W
            acc.loss_scale_after_the_call = float(multiplier)  # pipeline stages weigh their loss by it
            ranks = acc.mesh.size("loss")
        else:  # evaluation (item 3: whole rows): the Trainer averages each batch rank's loss, S * W_batch / N
            ranks = acc.mesh.size("batch")
        return (total * multiplier / ranks).to(torch.float32).squeeze(0)
    return wrapper


def _loss_multiplier(trainer: Any) -> int:
    """M of item 2: what ``compute_loss`` multiplies the loss by under ``average_tokens_across_devices`` -- the
    processes over the tensor-parallel size, which transformers reads from ``get_tp_size()`` since 5.19 and from its
    Accelerator's ``parallelism_config`` before."""
    import transformers
    from packaging.version import Version

    acc = trainer.accelerator
    if Version(transformers.__version__) >= Version("5.19"):
        return acc.num_processes // trainer.get_tp_size()
    return acc.num_processes // acc.parallelism_config.tp_size


def prepare_context_parallel_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, model: Any, inputs: dict[str, Any]) -> tuple[Callable[[], Any], dict[str, Any]]:
        if not taken_over(self):
            return original(self, model, inputs)
        acc = self.accelerator
        if acc.sequence_sharding is None or not torch.is_grad_enabled():
            return contextlib.nullcontext, inputs  # evaluation runs whole rows: see the module docstring, item 3
        acc._start_batch()
        inputs = dict(inputs)
        ids = inputs.get("input_ids")
        if not isinstance(ids, torch.Tensor):
            raise ValueError("context/sequence parallelism with the Trainer needs input_ids in every batch")
        if "shift_labels" not in inputs and isinstance(inputs.get("labels"), torch.Tensor):
            # Shifted before sharding: the last token of one shard predicts the first of the next.
            inputs["shift_labels"] = F.pad(inputs["labels"][..., 1:], (0, 1), value=IGNORE_INDEX)
        if inputs.get("position_ids") is None:
            inputs["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        _drop_flash_attention_fields(inputs)
        _pad_to_split(inputs, acc.sequence_sharding.fitting_length(ids.shape[1]))
        ids, length = inputs["input_ids"], inputs["input_ids"].shape[1]
        buffers = [value for key, value in inputs.items() if isinstance(value, torch.Tensor) and value.dim() >= 2
                   and value.shape[1] == length and value.shape[0] == ids.shape[0]]
        return functools.partial(_sequence_sharded, acc, model, buffers, inputs.get("shift_labels")), inputs
    return wrapper


@contextlib.contextmanager
def _sequence_sharded(acc: Any, model: nn.Module, buffers: list[torch.Tensor], labels: torch.Tensor | None) -> Any:
    """`Accelerator.maybe_context_parallel` over the batch's sequence tensors; and, for a forward of `model` given no
    ``num_items_in_batch`` (the Trainer counts no tokens: a model that takes none), its loss -- the mean over this
    rank's shard of the rows -- weighted by the shard's share of the rows' loss tokens, n_r * G / n over the G ranks of
    cp x sp, so that the ranks' average is the rows' mean (item 3). Device tensors: nothing is read on the host."""
    whole = (labels != IGNORE_INDEX).sum() if isinstance(labels, torch.Tensor) else None
    with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                    no_restore_buffers=set(buffers)):
        handle = None
        if whole is not None and acc.mesh.size("pp") == 1:  # pipeline stages weigh their loss inside the model
            ranks = acc.mesh.layout.seq_split  # cp x sp: the ranks that hold a share of these rows
            share = (labels != IGNORE_INDEX).sum().double() * ranks / whole.clamp(min=1).double()  # labels: the shard
            handle = model.register_forward_hook(functools.partial(_weigh_mean_loss, share), with_kwargs=True)
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()


def _weigh_mean_loss(share: torch.Tensor, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
    if kwargs.get("num_items_in_batch") is not None:  # a summed loss over the Trainer's count: exact as it is
        return None
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        output["loss"] = output["loss"] * share.to(output["loss"].dtype)
        return output
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor) and output[0].dim() == 0:
        return (output[0] * share.to(output[0].dtype), *output[1:])
    return None


_FLASH_FIELDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _drop_flash_attention_fields(inputs: dict[str, Any]) -> None:
    """TRL's padding-free collator adds flash-attention's document boundaries beside ``position_ids``; ndparallel reads
    the documents from ``position_ids``, so the fields are dropped -- after checking they say the same."""
    given = [name for name in _FLASH_FIELDS if name in inputs]
    if not given:
        return
    positions = inputs["position_ids"]
    starts = torch.nonzero(positions.reshape(-1) == 0).reshape(-1)
    expected = torch.cat([starts, starts.new_tensor([positions.numel()])]).to(torch.int64)
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        value = inputs.get(name)
        if value is not None and (positions.shape[0] != 1 or not torch.equal(value.to(torch.int64).cpu(),
                                                                              expected.cpu())):
            raise ValueError(f"{name} does not match the documents position_ids describes (it restarts at 0 at "
                             f"{starts.tolist()}): context/sequence parallelism reads the documents from position_ids")
    for name in given:
        del inputs[name]


def _pad_to_split(inputs: dict[str, Any], length: int) -> None:
    """Pad every sequence tensor of the batch at the end to `length`, which splits over cp x sp. The pad positions
    are a document of their own (``position_ids`` from 0; masked where the batch has an ``attention_mask``) with -100
    labels: no real token attends to them or is scored on them, so the loss and gradients stay exact."""
    ids = inputs["input_ids"]
    extra = length - ids.shape[1]
    if extra == 0:
        return
    rows, width = ids.shape[0], ids.shape[1]
    for key, value in list(inputs.items()):
        if not (isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == width
                and value.shape[0] in (rows, 1)):
            continue
        if key == "position_ids":
            tail = torch.arange(extra, device=value.device, dtype=value.dtype).expand(value.shape[0], -1)
            inputs[key] = torch.cat([value, tail], dim=1)
        else:
            fill = IGNORE_INDEX if key in ("labels", "shift_labels") else 0
            inputs[key] = F.pad(value, (0, 0) * (value.dim() - 2) + (0, extra), value=fill)


def save_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not taken_over(self):
            return original(self, output_dir, _internal_call)
        groups = self.accelerator.replica_groups
        if groups is not None and not groups.writes_checkpoints():
            return None  # fault tolerance: another replica group writes it (the same weights); every rank alike
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if checkpoint.is_peft_model(self.accelerator.unwrap_model(self.model_wrapped)):
            monitored_barrier("save_model")  # the adapter only, as PEFT saves it (collective: every rank, here)
            state_dict = checkpoint.adapter_state_dict(self.model_wrapped)
        else:
            state_dict = self.accelerator.get_state_dict(self.model_wrapped)  # collective: every rank, here
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
    return wrapper


def _checkpointed(trainer: Any) -> PreparedObjects:
    """The model and optimizer a Trainer checkpoint keeps in ndparallel's format."""
    acc = trainer.accelerator
    return PreparedObjects(acc.gradient_state, acc.scaler, models=[trainer.model_wrapped],
                           optimizers=[trainer.optimizer])


def save_optimizer_and_scheduler(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, output_dir: str) -> None:
        if not taken_over(self):
            return original(self, output_dir)
        acc = self.accelerator
        # Sharded whatever the FSDP plugin's state_dict_type says (a script may set FULL_STATE_DICT for its final
        # save_model): the Trainer's checkpoints load into any layout as they are.
        settings = dataclasses.replace(acc._run_settings(), state_dict_type=checkpoint.SHARDED)
        checkpoint.save_state(_checkpointed(self), settings, checkpoint.ProjectConfiguration(),
                              os.path.join(output_dir, CHECKPOINT_SUBDIR))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))
    return wrapper


def load_optimizer_and_scheduler(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, resume: str | None) -> None:
        if not taken_over(self) or resume is None:
            return original(self, resume)
        live = trainer_faults.live_of(self)
        if live is not None and live.resuming(resume):  # optimizer and weights are live already, the schedule not
            return live.load_scheduler()
        directory = os.path.join(resume, CHECKPOINT_SUBDIR)
        if not os.path.isdir(directory):
            raise ValueError(f"resume_from_checkpoint={resume!r} has no {CHECKPOINT_SUBDIR}/ folder: it was not "
                             "written by a Trainer on ndparallel, whose optimizer states are sharded there")
        checkpoint.load_state(_checkpointed(self), checkpoint.ProjectConfiguration(), directory,
                              parallelism=self.accelerator.state.parallelism_config)
        scheduler = os.path.join(resume, "scheduler.pt")
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
    return wrapper


def load_from_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, resume: str, model: Any = None) -> None:
        # The model's weights come back with its optimizer (`load_optimizer_and_scheduler`), sharded as they are now;
        # resuming from the live state (fault tolerance) they are in place already.
        live = trainer_faults.live_of(self)
        if taken_over(self) and (os.path.isdir(os.path.join(resume, CHECKPOINT_SUBDIR))
                                 or (live is not None and live.resuming(resume))):
            return None
        return original(self, resume, model)
    return wrapper


def prepare_input(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, data: Any) -> Any:
        # The Trainer moves each input with `.to(args.device)`; on the CPU that device is "cpu:0", which torch takes
        # for another device than a tensor's "cpu" and copies every input -- after context parallelism has sharded
        # them in place, so the model would get copies whose whole rows nobody knows. A tensor already there stays.
        if (isinstance(data, torch.Tensor) and taken_over(self) and data.device.type == self.args.device.type
                and data.device.index in (None, self.args.device.index)):
            return data
        return original(self, data)
    return wrapper


def wrap_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        if not taken_over(self):
            return original(self, model, training, dataloader)
        # ndparallel's prepare wraps and shards the model (in place, or in a DDP or pipeline wrapper); the Trainer
        # wraps nothing more, and trains and evaluates the prepared model (self.model until one is prepared).
        return self.model_wrapped
    return wrapper


def load_best_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any) -> None:
        if not taken_over(self):
            return original(self)
        directory = os.path.join(self.state.best_model_checkpoint, CHECKPOINT_SUBDIR)
        checkpoint.load_state(_checkpointed(self), checkpoint.ProjectConfiguration(), directory,
                              parallelism=self.accelerator.state.parallelism_config)
        return None
    return wrapper


def set_initial_training_values(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, args: Any, dataloader: Any) -> tuple:
        if not taken_over(self) or self.get_sp_size() == 1:
            return original(self, args, dataloader)
        # The Trainer counts sp_size times the data loader's batches per epoch: Accelerate's sequence parallelism
        # (DeepSpeed's Ulysses) cuts each batch into sp_size batches of their own. ndparallel's shards each batch
        # inside the model, and its loader yields what its length says; counted sp_size times over, the epochs, a
        # max_steps run's number of epochs (it stopped early) and the LR schedule of an epoch-based one were wrong.
        # The data-parallel size (the global batch) stays world / (tp x cp x sp).
        total = self.get_total_train_batch_size(args)
        self.get_sp_size, self.get_total_train_batch_size = (lambda: 1), (lambda _args: total)
        try:
            return original(self, args, dataloader)
        finally:
            del self.get_sp_size, self.get_total_train_batch_size
    return wrapper


def skip_first_batches(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(dataloader: Any, num_batches: int = 0) -> Any:
        if isinstance(dataloader, PreparedDataLoader):
            return dataloader.skip_batches(num_batches) or dataloader
        return original(dataloader, num_batches)
    return wrapper


# The Trainer's methods replaced here (their parameters: `trainer_versions.EXPECTED_PARAMETERS`).
HOOKS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "create_accelerator_and_postprocess": create_accelerator_and_postprocess,
    "_get_num_items_in_batch": get_num_items_in_batch,
    "_prepare_context_parallel_inputs": prepare_context_parallel_inputs,
    "save_model": save_model,
    "_save_optimizer_and_scheduler": save_optimizer_and_scheduler,
    "_load_optimizer_and_scheduler": load_optimizer_and_scheduler,
    "_load_from_checkpoint": load_from_checkpoint,
    "_load_best_model": load_best_model,
    "_wrap_model": wrap_model,
    "_prepare_input": prepare_input,
    "set_initial_training_values": set_initial_training_values,
}


def install(module: ModuleType) -> None:
    """Attach the integration to ``transformers.trainer`` (`module`), once. Where a hook does not fit (another
    transformers than the one this was written for) nothing is replaced but ``create_accelerator_and_postprocess``,
    which refuses, naming what does not fit, when a Trainer would be taken over."""
    trainer = module.Trainer
    if getattr(trainer, "_ndparallel_integration", False):
        return
    if hook_problems(module):
        def refuse(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def wrapper(self: Any) -> None:
                if wanted(self):
                    check_support(self, module)  # raises, naming what does not fit
                return original(self)
            return wrapper
        trainer.create_accelerator_and_postprocess = refuse(trainer.create_accelerator_and_postprocess)
        trainer._ndparallel_refusing = True
    else:
        for name, wrap in HOOKS.items():
            hook = wrap(getattr(trainer, name))
            setattr(hook, HOOK_MARK, name)
            setattr(trainer, name, hook)
        trainer_faults.install(trainer)  # train / _save_checkpoint: act only under fault tolerance
        module.Accelerator = _accelerator_factory(module.Accelerator)
        module.skip_first_batches = skip_first_batches(module.skip_first_batches)
    trainer._ndparallel_integration = True
