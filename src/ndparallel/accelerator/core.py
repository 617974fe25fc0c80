"""The `Accelerator`: Hugging Face Accelerate's training API over one ND device mesh.

It only orchestrates: settings are resolved by `settings`, the process state kept by `ndparallel.state`, the mesh
built by `ndparallel.distributed.mesh`, models parallelised by `ndparallel.parallel`, data loaders sharded by
`ndparallel.training.data`, the loss made right by `ndparallel.training.loss`, sequences sharded by
`ndparallel.parallel.sequence`, clipping done by `ndparallel.training.clip`, metrics gathered by
`ndparallel.distributed.gather_reduce`, experiments logged by `ndparallel.tracking`; what it prepared is kept in one
`ndparallel.training.prepared.PreparedObjects`, which checkpoints read and write. The training step (`training_step`),
the process surface, collectives and checkpoints live in the mixins beside this module.

Differences from Accelerate, on purpose (README, "Differences from Accelerate"):
- a prepared LR scheduler steps once per data-parallel rank and optimizer step, as Accelerate's steps once per
  process, but tensor/context/sequence-parallel peers, which share their batches, do not count;
- `backward` weights a causal LM's loss by each rank's share of the optimizer step's loss tokens (see
  `ndparallel.training.loss`), so unequal numbers of -100 labels over ranks and micro-steps give the single-process
  gradient;
- `reduce` and `gather` run over the ranks that hold distinct data (the ``loss`` and ``batch`` views), never
  counting tensor-parallel copies twice; `reduce_loss` gives the exact global loss of a step.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ..distributed import agreement, failures
from .. import checkpoint, parallel
from ..training import metrics, run_metrics
from ..training.batch_size import release_memory
from ..checkpoint import ProjectConfiguration
from ..checkpoint.save_pretrained import install_save_pretrained
from ..configuration.parallelism import ParallelismConfig
from ..training.data import PreparedDataLoader
from ..training.loader_types import prepared_loader_class, shuffle_seed
from ..training.loss import GradientState, is_causal_lm
from ..distributed.mesh import ParallelMesh
from ..fault_tolerance import ReplicaGroups
from ..training.optim import AcceleratedOptimizer, AcceleratedScheduler, switch_parameters
from ..parallel.sequence import SequenceSharding
from ..configuration.plugins import DataLoaderConfiguration, FullyShardedDataParallelPlugin, GradientAccumulationPlugin
from ..training.prepared import PreparedObjects
from ..distributed.runtime import release_process_group
from ..distributed.state import AcceleratorState, PartialState
from ..tracking import GeneralTracker, Trackers, progress_bar
from . import settings as _settings
from .checkpointing import CheckpointingMixin
from .collectives import CollectivesMixin
from .processes import ProcessesMixin
from .training_step import TrainingStepMixin

_PREPARED_TYPES = (DistributedDataParallel, FSDPModule, parallel.PreparedModel, AcceleratedOptimizer, PreparedDataLoader,
                   AcceleratedScheduler)


def _setting(field: str, doc: str, settable: bool = False) -> property:
    """An Accelerator attribute that reads (and, where Accelerate lets scripts assign it, writes) the field `field`
    of its one `Settings`."""

    def get(self: Accelerator) -> Any:
        return getattr(self._settings, field)

    def set_(self: Accelerator, value: Any) -> None:
        setattr(self._settings, field, value)

    return property(get, set_ if settable else None, doc=doc)


def _storage_key(param: torch.Tensor) -> int:
    """A key of a parameter's storage that holds no reference to it: its local tensor's data pointer (a DTensor's
    shard's), or ``id()`` for a meta parameter (whose data pointers are all 0)."""
    if param.is_meta:
        return id(param)
    local = param.to_local() if isinstance(param, DTensor) else param
    inner = getattr(local, "_tensor", None)  # a wrapper subclass (torchao's float8 weight) has data pointer 0
    return inner.data_ptr() if isinstance(inner, torch.Tensor) and local.data_ptr() == 0 else local.data_ptr()


def _weak(obj: Any) -> Callable[[], Any]:
    """A weak reference to `obj`, or a strong one for the rare object that cannot be referenced weakly."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


class Accelerator(TrainingStepMixin, ProcessesMixin, CollectivesMixin, CheckpointingMixin):
    """Trains models with the parallelisms of a `ParallelismConfig` (plain DDP over every process without one).

    Its arguments are Accelerate's, in Accelerate's order, then ndparallel's own (keyword-only).

    Args:
        device_placement: move batches of prepared data loaders to this rank's device.
        split_batches: shorthand for ``dataloader_config=DataLoaderConfiguration(split_batches=...)``.
        mixed_precision: "no", "bf16", "fp16" or "fp8" (None: ``$NDPARALLEL_MIXED_PRECISION``, then
            ``$ACCELERATE_MIXED_PRECISION``, then "no"). Low-precision trainable parameters are upcast to fp32
            master weights when it is not "no". "fp8": torchao float8 linear layers (`AORecipeKwargs` in
            `kwargs_handlers`; `ndparallel.parallel.fp8`), bf16 elsewhere.
        gradient_accumulation_steps: micro-steps per optimizer step (None: the launchers' variables, then 1).
        cpu: train on the CPU with gloo even where CUDA is available.
        dataloader_config: a `DataLoaderConfiguration` (split_batches, even_batches, non_blocking, data_seed,
            dispatch_batches: refused for iterable datasets).
        deepspeed_plugin: refused when given.
        fsdp_plugin: FSDP2 settings (fields it leaves unset: from ``FSDP_*``). FSDP2 wraps the model when parameters
            are sharded (``dp_shard * cp * sp > 1``), when a plugin is given (or ``ACCELERATE_USE_FSDP`` is set)
            and there is more than one process -- on one process only for CPU offload, a mixed-precision policy or
            meta-device loading; otherwise its activation checkpointing and autocast apply to the plain model --, or
            when tensor parallelism meets data parallelism (torch's DDP takes no DTensor parameters, so replication
            is FSDP2 over a shard group of one).
        torch_tp_plugin: refused when given.
        megatron_lm_plugin: refused when given.
        rng_types: accepted and ignored (prepared loaders seed their samplers alike on every rank).
        log_with: trackers (`ndparallel.tracking`): names, `LoggerType`s, `GeneralTracker` objects, or "all".
        project_dir: where checkpoints and logs go (sets the directories of `project_config`).
        project_config: where checkpoints and logs go, and how checkpoints are named (`ProjectConfiguration`).
        gradient_accumulation_plugin: a `GradientAccumulationPlugin` (num_steps, sync_each_batch).
        step_scheduler_with_optimizer: True (default): the LR scheduler steps only when the optimizer stepped, then
            once per data-parallel rank (once with split_batches), as Accelerate's; False: every call to its
            ``step()`` steps it once.
        kwargs_handlers: `InitProcessGroupKwargs`, `DistributedDataParallelKwargs`, `GradScalerKwargs`,
            `AutocastKwargs`, `GradientAccumulationPlugin`.
        dynamo_backend: compilation (`ndparallel.parallel.compile`) with this backend: shorthand for
            ``dynamo_plugin=TorchDynamoPlugin(backend=...)``, not to be given with it.
        dynamo_plugin: compilation (`TorchDynamoPlugin`, `ndparallel.parallel.compile`); neither given: the
            environment's ``NDPARALLEL_DYNAMO_*`` / ``ACCELERATE_DYNAMO_*``.
        deepspeed_plugins: refused when given.
        parallelism_config: sizes of each parallelism; sizes it leaves unset are read from what the launcher passed
            (`ParallelismConfig.from_env`). All sizes 1 (or no config): DDP over every process.
        loss_weighting: ndparallel's own: "auto" (default: token-weighted for causal language models, see
            `ndparallel.training.loss`), "tokens" (the loss is a mean over shifted LM tokens whatever the model), or
            "mean" (Accelerate's meaning).
    """

    def __init__(self, device_placement: bool = True, split_batches: bool | None = None,
                 mixed_precision: str | None = None, gradient_accumulation_steps: int | None = None,
                 cpu: bool = False, dataloader_config: DataLoaderConfiguration | None = None,
                 deepspeed_plugin: Any = None, fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
                 torch_tp_plugin: Any = None, megatron_lm_plugin: Any = None, rng_types: Any = None,
                 log_with: Any = None, project_dir: str | os.PathLike | None = None,
                 project_config: ProjectConfiguration | None = None,
                 gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
                 step_scheduler_with_optimizer: bool = True, kwargs_handlers: list | None = None,
                 dynamo_backend: Any = None, dynamo_plugin: Any = None, deepspeed_plugins: Any = None,
                 parallelism_config: ParallelismConfig | None = None, *, loss_weighting: str = "auto") -> None:
        # Every check on user input comes before the first collective.
        s = _settings.resolve(
            parallelism_config=parallelism_config, fsdp_plugin=fsdp_plugin, mixed_precision=mixed_precision,
            gradient_accumulation_steps=gradient_accumulation_steps, cpu=cpu, device_placement=device_placement,
            project_dir=project_dir, project_config=project_config, dataloader_config=dataloader_config,
            split_batches=split_batches, gradient_accumulation_plugin=gradient_accumulation_plugin,
            kwargs_handlers=kwargs_handlers, log_with=log_with,
            step_scheduler_with_optimizer=step_scheduler_with_optimizer, loss_weighting=loss_weighting,
            rng_types=rng_types, dynamo_backend=dynamo_backend, dynamo_plugin=dynamo_plugin,
            foreign={"deepspeed_plugin": deepspeed_plugin, "deepspeed_plugins": deepspeed_plugins,
                     "megatron_lm_plugin": megatron_lm_plugin, "torch_tp_plugin": torch_tp_plugin})
        self._settings = s  # the one copy: the attributes below with Accelerate's names are properties over it
        partial = PartialState(s.cpu, **s.process_group)
        # Before the first collective that depends on these settings (the mesh's process groups): ranks whose
        # settings differ all raise the same error naming them, instead of hanging (ndparallel.distributed.agreement).
        # One
        # monitored barrier carrying a digest of the settings; the settings travel only when they differ.
        agreement.check_agreement(agreement.accelerator_fingerprint(
            s.parallelism, s.fsdp_plugin, s.mixed_precision, s.accumulation_steps, device=partial.device.type,
            dataloader=s.dataloader, loss_weighting=loss_weighting), "Accelerator(...)",
            timeout=partial.runtime.timeout)
        s.place(partial.num_processes)  # sizes resolved; whether FSDP2 wraps the models, decided once
        self.mesh = ParallelMesh(s.parallelism, partial.device.type, fsdp=s.fsdp)
        for config in (parallelism_config, s.parallelism):  # Accelerate's config.get_device_mesh()
            if config is not None:
                config.device_mesh = self.mesh.world
        self.state = AcceleratorState(partial, settings=s, device_mesh=self.mesh.world)
        self.gradient_state = GradientState(s.accumulation_steps, self.mesh.size("loss"))
        # This rank's part of every sequence under context/sequence parallelism (None without): the one geometry
        # the data loaders count loss tokens with and maybe_context_parallel shards with.
        self.sequence_sharding = SequenceSharding.from_mesh(self.mesh, s.parallelism.cp_handler)
        scaler = torch.amp.GradScaler(self.device.type, **s.scaler_kwargs) if s.mixed_precision == "fp16" else None
        self.prepared = PreparedObjects(self.gradient_state, scaler)  # what save_state / load_state cover
        # `ndparallel launch --fault-tolerant`: this process's replica group in torchft's (None otherwise)
        self.replica_groups = None if s.fault_tolerance is None else ReplicaGroups(
            s.fault_tolerance, self.prepared, self.device, partial.process_index, partial.num_processes)
        self.trackers = Trackers(s.log_with, s.project.logging_dir, self.is_main_process)
        # id(original parameter) -> (weak reference to it, the parameter that replaced it in prepare()).
        self._param_map: dict[int, tuple[weakref.ref, nn.Parameter]] = {}
        # The plain objects prepare() has taken, to refuse them a second time: id -> a weak reference (an id alone
        # could be reused by a new object once the old one is freed).
        self._taken: dict[int, Callable[[], Any]] = {}
        self._accumulating = 0  # accumulate() blocks entered and not left
        self._warned_outside_accumulate = False
        checkpoint.announce(s.fsdp_plugin)  # cpu_ram_efficient_loading: tell transformers, as Accelerate does

    # ---- settings as properties over the one copy (Accelerate's names; settable where Accelerate's are) -----------
    parallelism_config = _setting("parallelism", "The ParallelismConfig, its sizes resolved against the world size.")
    fsdp_plugin = _setting("fsdp_plugin", "The FSDP2 settings (None without a plugin).")
    mixed_precision = _setting("mixed_precision", 'One of "no", "bf16", "fp16", "fp8".')

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step. Settable between optimizer steps, as in Accelerate: the accumulation
        windows (`accumulate`, `sync_gradients`) and the prepared data loaders' token windows follow from then on."""
        return self._settings.accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be a positive integer, got {steps!r}")
        if self.gradient_state.step != 0:
            raise ValueError(f"gradient_accumulation_steps set to {steps} in the middle of an accumulation window "
                             f"({self.gradient_state.step} of its {self._settings.accumulation_steps} micro-steps "
                             "done): set it between optimizer steps")
        self._settings.accumulation_steps = steps
        self.gradient_state.accumulation_steps = steps
        self.gradient_state.plugin_kwargs["num_steps"] = steps
        for loader in self.prepared.dataloaders:  # each draws its next window at the new size
            loader.window = steps
    device_placement = _setting("device_placement", "Prepared data loaders move batches to this rank's device.",
                                settable=True)
    dataloader_config = _setting("dataloader", "The DataLoaderConfiguration.", settable=True)
    step_scheduler_with_optimizer = _setting("step_scheduler_with_optimizer", "The LR scheduler steps with each "
                                             "optimizer step (else with every call).", settable=True)
    project_configuration = _setting("project", "The ProjectConfiguration (directories, checkpoint naming).",
                                     settable=True)

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The gradient scaler of fp16 mixed precision (None otherwise)."""
        return self.prepared.scaler

    split_batches = property(lambda self: self.dataloader_config.split_batches)
    even_batches = property(lambda self: self.dataloader_config.even_batches,  # settable, as Accelerate's: for the
                            lambda self, value: setattr(self.dataloader_config, "even_batches", value))  # next prepare
    dispatch_batches = property(lambda self: self.dataloader_config.dispatch_batches)
    use_seedable_sampler = property(lambda self: True)  # every random sampler is seeded alike on all ranks
    non_blocking = property(lambda self: self.dataloader_config.non_blocking)
    use_stateful_dataloader = property(lambda self: self.dataloader_config.use_stateful_dataloader)

    @property
    def sync_gradients(self) -> bool:
        """True on the micro-step whose backward synchronises gradients and after which the optimizer steps.
        Settable, as in Accelerate (a loop that runs its own windows); `accumulate` sets it at each micro-step."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, sync: bool) -> None:
        self.gradient_state.sync_gradients = bool(sync)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (an accumulation micro-step, or fp16 found inf/nan)."""
        return any(opt.step_was_skipped for opt in self.prepared.optimizers)

    # Accelerate's private lists of what prepare() returned, which scripts and tests read: views of `prepared`.
    _models = property(lambda self: self.prepared.models)
    _optimizers = property(lambda self: self.prepared.optimizers)
    _schedulers = property(lambda self: self.prepared.schedulers)
    _dataloaders = property(lambda self: self.prepared.dataloaders)
    _custom_objects = property(lambda self: self.prepared.custom_objects)

    # ---- prepare -------------------------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: list[bool] | None = None,
                tp_plan: dict[str, str] | None = None) -> Any:
        """Prepare models, optimizers, data loaders and LR schedulers, in any order and number.

        Returns them in the order given (a single object when one was given); an object this or another Accelerator
        already prepared comes back as it is, and so does anything else (``None``, a list: as Accelerate does). Each
        prepared object gets ``_is_accelerate_prepared = True``. Models are prepared first, so an optimizer built from a model's
        parameters before `prepare` is pointed at the parameters that replace them. `tp_plan` (pattern -> style,
        see `ndparallel.parallel.tensor`) overrides the tensor-parallel plan of the models passed.
        """
        if device_placement is not None and len(device_placement) != len(args):
            raise ValueError(f"prepare(): device_placement has {len(device_placement)} entries for {len(args)} "
                             "objects")
        kinds = [None if isinstance(obj, _PREPARED_TYPES) else self._kind(i, obj) for i, obj in enumerate(args)]
        seen: set[int] = set()
        for i, obj in enumerate(args):  # the same plain object twice would be wrapped twice: refused
            taken = self._taken.get(id(obj))
            if kinds[i] is not None and ((taken is not None and taken() is obj) or id(obj) in seen):
                raise ValueError(f"prepare(): argument {i} (a {type(obj).__name__}) is already prepared; pass each "
                                 "plain object to prepare() once")
            seen.add(id(obj))
        # Every rank here, with the same objects, before prepare's first collective (DDP and FSDP broadcast or shard
        # parameters, the data loader's seed is broadcast): one monitored barrier carrying a digest of the objects;
        # a rank missing, or in another call, or with other objects raises the same error everywhere.
        plain = [obj for obj, kind in zip(args, kinds) if kind is not None]
        agreement.check_agreement(agreement.prepare_fingerprint(plain), "prepare()", timeout=self.state.runtime.timeout)
        out = list(args)
        for kind in ("model", "optimizer", "dataloader", "scheduler"):
            for i, obj in enumerate(args):
                if kinds[i] == kind:
                    extra: dict[str, Any] = {"tp_plan": tp_plan} if kind == "model" else {}
                    if kind in ("model", "dataloader") and device_placement is not None:
                        extra["device_placement"] = device_placement[i]
                    out[i] = getattr(self, f"prepare_{kind}")(obj, **extra)
                    out[i]._is_accelerate_prepared = True  # Accelerate's mark, which the Trainer and tests read
                    self._taken[id(obj)] = _weak(obj)  # only once prepared: a failed prepare() may be retried
        return out[0] if len(out) == 1 else tuple(out)

    @staticmethod
    def _kind(index: int, obj: Any) -> str | None:
        if isinstance(obj, nn.Module):
            return "model"
        if isinstance(obj, torch.optim.Optimizer):
            return "optimizer"
        if isinstance(obj, DataLoader):
            return "dataloader"
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            return "scheduler"
        if obj is not None:  # None is how scripts pass "no scheduler"; anything else may be a mistake: said once
            warnings.warn(f"prepare(): argument {index} is a {type(obj).__module__}.{type(obj).__name__}, which "
                          "prepare() does not change; it is returned as it is (prepare() takes torch.nn.Module, "
                          "torch.optim.Optimizer, torch.utils.data.DataLoader and torch.optim.lr_scheduler.LRScheduler "
                          "objects)", stacklevel=3)
        return None  # returned as it is, as Accelerate does

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False,
                      tp_plan: dict[str, str] | None = None) -> nn.Module:
        """Parallelise `model` over the mesh (`ndparallel.parallel.parallelize`). `evaluation_mode` is accepted for
        Accelerate's sake (the model is parallelised the same way)."""
        if isinstance(model, _PREPARED_TYPES) or any(model is m for m in self.prepared.models):
            return model
        old = dict(model.named_parameters(remove_duplicate=False))  # every name of a tied parameter
        config = self.parallelism_config
        options = parallel.PrepareOptions(self.device, self.fsdp_plugin, self.mixed_precision, tp_plan,
                                          fsdp=self._settings.fsdp, tp_handler=config.tp_handler,
                                          cp_handler=config.cp_handler, pp_handler=config.pp_handler,
                                          ddp_kwargs=self._settings.ddp_kwargs,
                                          autocast_kwargs=self._settings.autocast_kwargs,
                                          dynamo_plugin=self._settings.dynamo_plugin,
                                          fp8_recipe=self._settings.fp8_recipe, memory=self._settings.memory,
                                          loss_factor=self._loss_weight_inside_the_model,
                                          sync_gradients=self._syncs_gradients)
        # A model on the meta device (cpu_ram_efficient_loading) gets its weights after it is parallelised.
        prepared = checkpoint.parallelize_loading_weights(
            model, self.fsdp_plugin, self.device, lambda m: parallel.parallelize(m, self.mesh, options))
        new = dict(self.unwrap_model(prepared).named_parameters(remove_duplicate=False))
        kept = {id(param) for name, param in old.items() if name in new}  # under any of its names
        split = not parallel.interface(prepared).holds_every_parameter
        for name, param in old.items():
            if id(param) not in kept and split:  # owned by another rank (another pipeline stage's): dropped
                self._param_map[id(param)] = (weakref.ref(param), None)
            elif new.get(name) is not None and new[name] is not param:
                self._param_map[id(param)] = (weakref.ref(param), new[name])
        install_save_pretrained(prepared, self.unwrap_model(prepared))  # full weights from any layout (collective)
        if self.num_processes > 1:  # a collective of its forward that fails says where every rank was
            failures.watch_training_step(prepared, self.state.runtime.timeout)
        if self.replica_groups is not None:  # each step's quorum starts at its first training forward
            self.replica_groups.watch(prepared)
        self.prepared.models.append(prepared)
        for opt in self.prepared.optimizers:  # optimizers prepared before this model follow its new parameters too
            self._remap(opt.optimizer)
        self.gradient_state.token_weighted = self._token_weighted()
        return prepared

    def _syncs_gradients(self) -> bool:
        """Whether the current micro-step's backward reduces gradients (read by models that run backward in their
        call: pipeline stages sum a tied weight's two gradients then)."""
        return self.gradient_state.sync_gradients or self._settings.sync_each_batch

    def _token_weighted(self) -> bool:
        """Whether `backward` and `reduce_loss` weight by loss tokens (`ndparallel.training.loss`): the user said so, or
        every prepared model is a causal language model."""
        mode = self._settings.loss_weighting
        if mode != "auto":
            return mode == "tokens"
        models = [self.unwrap_model(m) for m in self.prepared.models]
        return bool(models) and all(is_causal_lm(m) for m in models)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        self._remap(optimizer)
        wrapped = AcceleratedOptimizer(optimizer, self.gradient_state, self.scaler,
                                       before_step=self.prepared.release_gathered)
        if self.replica_groups is not None:
            wrapped.commit = self.replica_groups.should_commit
        self.prepared.optimizers.append(wrapped)
        return wrapped

    def _remap(self, optimizer: torch.optim.Optimizer) -> None:
        """Point `optimizer` at the parameters that replaced the ones it was built with."""
        remapped = False
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                entry = self._param_map.get(id(p))
                if entry is not None and entry[0]() is p:
                    p, remapped = entry[1], True
                if p is not None:  # None: a parameter of a pipeline stage another rank holds
                    params.append(p)
            group["params"] = params
        if remapped and optimizer.state:
            raise ValueError(
                "prepare(): the optimizer already has state (it stepped before prepare), and its parameters were "
                "replaced by sharded ones; build the optimizer, prepare it, then train"
            )

    def parameters_by_name(self, *objects: Any, drop_refs: bool = False) -> dict[str, Any]:
        """The parameters of the models among `objects` (anything else is skipped), by name: each model as
        ``unwrap_model(model, keep_torch_compile=False)`` gives it, so a prepared or compiled model has its own
        names; with several models, each name starts with the model's position among them (``"0.weight"``).
        `drop_refs=True` gives, instead of each parameter, a key of its storage that holds no reference to it (the
        data pointer of its local tensor; ``id()`` of a meta parameter). Taken before the parameters are replaced,
        it is what `remap_optimizer_parameters` takes (Accelerate's private ``_get_named_parameters``)."""
        models = [obj for obj in objects if isinstance(obj, nn.Module)]
        named: dict[str, Any] = {}
        for index, model in enumerate(models):
            inner = self.unwrap_model(model, keep_torch_compile=False)
            for name, param in inner.named_parameters(prefix=str(index) if len(models) > 1 else ""):
                named[name] = _storage_key(param) if drop_refs else param
        return named

    _get_named_parameters = parameters_by_name

    def remap_optimizer_parameters(self, old_named_parameters: dict[str, torch.Tensor], *objects: Any) -> int:
        """Point the optimizers among `objects` at the parameters the models among `objects` hold now, by name.

        `old_named_parameters` is `parameters_by_name` of the same models taken before their parameters were
        replaced; each of those parameters that another one now stands for under its name is replaced in every
        param group of every optimizer given (prepared or not), its state moving with it where it fits
        (`ndparallel.training.optim.switch_parameters`). `prepare` does this itself for the optimizers it prepares,
        whenever their model is prepared; this is for what it cannot see: an optimizer it did not prepare, or
        parameters replaced after it (``model.to(...)`` under
        ``torch.__future__.set_overwrite_module_params_on_conversion(True)``). Returns how many parameters were
        replaced in the optimizers (0: nothing had changed). Accelerate's private ``_remap_optimizer_parameters``.
        """
        new = self.parameters_by_name(*objects)
        models = [obj for obj in objects if isinstance(obj, nn.Module)]
        split = any(not parallel.interface(m._orig_mod if isinstance(m, torch._dynamo.eval_frame.OptimizedModule)
                                           else m).holds_every_parameter for m in models)
        replaced: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        missing = []
        for name, old in old_named_parameters.items():
            if not isinstance(old, torch.Tensor):
                raise TypeError(f"remap_optimizer_parameters: {name!r} maps to a {type(old).__name__}, not a "
                                "parameter: take the names with parameters_by_name(model) (without drop_refs)")
            if name in new:
                if new[name] is not old:
                    replaced[id(old)] = (old, new[name])
            elif split:  # a pipeline stage another rank holds: dropped from this rank's optimizer, as prepare does
                replaced[id(old)] = (old, None)
            else:
                missing.append(name)
        if missing:
            raise ValueError(f"remap_optimizer_parameters: the models given have no parameter named {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''} (they have {sorted(new)[:5]} ...): pass the "
                             "models the names were taken from, in the same order")
        count = 0
        for obj in objects:
            if isinstance(obj, AcceleratedOptimizer):
                obj = obj.optimizer
            if isinstance(obj, torch.optim.Optimizer):
                count += switch_parameters(obj, replaced)
        return count

    _remap_optimizer_parameters = remap_optimizer_parameters

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> PreparedDataLoader:
        """Shard `data_loader` along the ``batch`` view (`ndparallel.training.data`)."""
        if isinstance(data_loader, PreparedDataLoader):
            return data_loader
        # One shuffling seed for every rank, rank 0's (`shuffle_seed`): ranks seeded differently (or not at all)
        # still draw one order.
        config = self.dataloader_config
        if config.dispatch_batches and isinstance(data_loader.dataset, torch.utils.data.IterableDataset):
            raise ValueError("prepare(): dispatch_batches=True with an iterable dataset is not supported: every rank "
                             "reads its own share, so the dataset must yield the same order on every rank (not "
                             "only on rank 0, which dispatching reads); make it so and set dispatch_batches=False")
        seed = shuffle_seed(data_loader, config.data_seed, self.device)
        sharding = self.sequence_sharding  # under CP/SP a rank's loss averages over its shard's tokens only
        prepared = prepared_loader_class(config.use_stateful_dataloader, bool(config.dispatch_batches))(
            data_loader, num_shards=self._batch_shards()[0], shard_index=self._batch_shards()[1],
            seed=seed, device=self.device,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            window=self.gradient_accumulation_steps,
            window_group=self.mesh.group("batch") if self.mesh.size("batch") > 1 else None,
            gradient_state=self.gradient_state,
            local_count=sharding.count_loss_tokens if sharding is not None else None,
            sequence_plan=sharding.plan if sharding is not None and sharding.balance_documents else None,
            split_batches=config.split_batches, even_batches=config.even_batches, non_blocking=config.non_blocking,
            lockstep=self._lockstep_reason(),
        )
        self.prepared.dataloaders.append(prepared)
        return prepared

    prepare_dataloader = prepare_data_loader

    def _batch_shards(self) -> tuple[int, int]:
        """How many ranks draw different samples, and which of them this rank is: the ``batch`` view, times the
        replica groups under fault tolerance (group g holds shards g*B .. g*B+B-1)."""
        size, rank = self.mesh.size("batch"), self.mesh.rank("batch")
        if self.replica_groups is None:
            return size, rank
        return size * self.replica_groups.settings.replicas, self.replica_groups.settings.replica_id * size + rank

    def _lockstep_reason(self) -> str:
        """Why every rank must run every step of a data loader (collectives in every forward), or "" under DDP (whose
        ranks can run uneven numbers of steps inside `join_uneven_inputs`) and on one process."""
        axes = (*self.mesh.config.non_dp_dim_names, "pp")  # the ranks that receive the same samples, and stages
        sizes = [f"{axis}_size={self.mesh.size(axis)}" for axis in axes if self.mesh.size(axis) > 1]
        reasons = [f"{' x '.join(sizes)} runs collectives in every forward"] if sizes else []
        if self._settings.fsdp and self.num_processes > 1:
            reasons.insert(0, "FSDP2 all-gathers the sharded parameters in every forward")
        return "; ".join(reasons)

    def prepare_scheduler(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> AcceleratedScheduler:
        if isinstance(scheduler, AcceleratedScheduler):
            return scheduler
        optimizers = [o for o in self.prepared.optimizers if scheduler.optimizer in (o, o.optimizer)]
        if not optimizers:
            raise ValueError(
                "prepare(): the LR scheduler's optimizer has not been prepared; pass the optimizer to prepare() "
                "in the same call or before the scheduler"
            )
        wrapped = AcceleratedScheduler(scheduler, optimizers, self.gradient_state,
                                       step_with_optimizer=self.step_scheduler_with_optimizer,
                                       steps_per_update=1 if self.split_batches else self._batch_shards()[0],
                                       adjust_scheduler=self._settings.adjust_scheduler)
        self.prepared.schedulers.append(wrapped)
        return wrapped

    def skip_first_batches(self, dataloader: PreparedDataLoader, num_batches: int = 0) -> PreparedDataLoader:
        """`dataloader` with its next pass starting `num_batches` batches later (resuming mid-epoch by hand)."""
        if not isinstance(dataloader, PreparedDataLoader):
            raise TypeError("skip_first_batches takes a data loader returned by prepare(); prepare it first")
        dataloader.skip_batches(num_batches)
        return dataloader

    # ---- trackers, progress, step metrics -----------------------------------------------------------------------
    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Start the trackers of ``log_with`` for `project_name`, storing `config` (main process only)."""
        self.trackers.init(project_name, config, init_kwargs)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Log `values` to every tracker (main process only)."""
        self.trackers.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> GeneralTracker | Any:
        return self.trackers.get(name, unwrap)

    def progress_bar(self, iterable: Any = None, **kwargs: Any):
        """A tqdm bar drawn by the main process only."""
        return progress_bar(iterable, main_process=self.is_main_process, **kwargs)

    def step_timer(self, model: nn.Module | None = None, seq_len: int | None = None,
                   peak_flops: float | None = None) -> metrics.StepTimer:
        """A `ndparallel.training.metrics.StepTimer` for this job: step time, tokens/s and MFU over all processes (FLOPs
        per token from ``model.config`` at `seq_len`; peak FLOP/s given, from a table, or estimated on CPU)."""
        timer = metrics.timer_for(self, model, seq_len, peak_flops)
        self._step_timer = timer  # its figures go to `ndparallel plan --measure` at end_training
        return timer

    # ---- models and the end ---------------------------------------------------------------------------------------
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> nn.Module:
        """The model without its DDP (or ``torch.nn.DataParallel``) wrapper; FSDP2 and checkpointing change no
        parameter names. A ``torch.compile``'d model is unwrapped inside: with `keep_torch_compile` the compiled
        wrapper is kept around the unwrapped model (its ``_orig_mod`` replaced, as Accelerate does), else the
        unwrapped model itself is returned."""
        compiled = model if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else None
        parallel.interface(model._orig_mod if compiled is not None else model).release_gathered()
        inner = parallel.unwrap(model._orig_mod if compiled is not None else model)
        while isinstance(inner, (DistributedDataParallel, nn.DataParallel)):
            inner = inner.module
        if compiled is not None and keep_torch_compile:
            compiled._orig_mod = inner
            return compiled
        return inner

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget every prepared object (and `objects`), collect garbage and release cached device memory. Returns a
        None for each object, to assign back (``model, optimizer = accelerator.free_memory(model, optimizer)``)."""
        for kept in (self.prepared.models, self.prepared.optimizers, self.prepared.schedulers,
                     self.prepared.dataloaders):
            kept.clear()
        self._param_map.clear()
        self._taken.clear()
        release_memory()
        return [None] * len(objects)

    clear = free_memory

    def end_training(self) -> None:
        """Close the trackers and release the process group (call once, at the end of the script). Under
        ``ndparallel plan --measure`` each rank first writes its step metrics and peak memory
        (`run_metrics.write_run_metrics`)."""
        run_metrics.write_run_metrics(getattr(self, "_step_timer", None), self.process_index, self.num_processes,
                                  self.device)
        self.trackers.finish()
        try:
            checkpoint.wait_for_saves()  # a background save commits before the process group goes
        finally:
            checkpoint.background.release()
        if dist.is_initialized():
            self.wait_for_everyone()
            release_process_group()
        PartialState._reset_state()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the identity records of prepare (weak references to this process's objects by id, which
        mean nothing elsewhere); process groups travel by name (`ndparallel.distributed.runtime.group_name`)."""
        state = dict(self.__dict__)
        state["_param_map"], state["_taken"] = {}, {}
        for hooks in ("_save_state_pre_hooks", "_load_state_pre_hooks"):  # functions of this process: not carried
            state.pop(hooks, None)
        return state

    def __repr__(self) -> str:
        return (f"Accelerator({self.mesh!r}, rank={self.process_index}/{self.num_processes}, "
                f"device={self.device}, mixed_precision={self.mixed_precision!r})")
