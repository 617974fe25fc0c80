"""The Accelerator a Hugging Face Trainer gets when `ndparallel.integrations.trainer` takes it over (that module's
docstring, item 1): when a Trainer is taken over (`wanted`, `taken_over`); ndparallel's Accelerator built from the
Trainer's own arguments (`build_accelerator`: Accelerate's plugin objects converted field by field) and as the Trainer
meets it (`TrainerAccelerator`, whose ``state`` the Trainer reads through `_TrainerView`); and the Trainer's methods
that build it (`create_accelerator_and_postprocess`, which has ``transformers.trainer.Accelerator`` build ndparallel's:
`_accelerator_factory`) and hand the Trainer the model `prepare` returned (`wrap_model`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..accelerator import Accelerator
from ..configuration import plugins
from ..configuration.parallelism import ParallelismConfig
from ..launch.worker import launch_sizes
from . import trainer_faults
from .trainer_versions import check_support, warn_once

_BUILDING: list[Any] = []  # the Trainer whose Accelerator is being built (create_accelerator_and_postprocess)


# ---- when ---------------------------------------------------------------------------------------------------------
def wanted(trainer: Any) -> bool:
    """Whether `trainer` is asked for an N-D layout (see `ndparallel.integrations.trainer`'s docstring)."""
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


def wrap_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        if not taken_over(self):
            return original(self, model, training, dataloader)
        # ndparallel's prepare wraps and shards the model (in place, or in a DDP or pipeline wrapper); the Trainer
        # wraps nothing more, and trains and evaluates the prepared model (self.model until one is prepared).
        return self.model_wrapped
    return wrapper
