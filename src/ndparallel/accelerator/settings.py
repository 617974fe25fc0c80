"""The Accelerator's settings, resolved once from its arguments and the environment, before any collective.

`Settings` is the Accelerator's one copy of them: its Accelerate-named attributes (``mixed_precision``,
``gradient_accumulation_steps``...) and its `AcceleratorState` read this object, and `prepare` passes what the
parallelisms need down in `PrepareOptions`.

Arguments win; a setting left unset is read from what a launcher exported: ``ndparallel launch``'s ``NDPARALLEL_*``
first, then ``accelerate launch``'s (``ACCELERATE_MIXED_PRECISION``, ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``,
``ACCELERATE_USE_CPU``, ``ACCELERATE_USE_FSDP`` with the ``FSDP_*`` plugin fields, ``PARALLELISM_CONFIG_*``). Every
check on user input happens here and raises on every rank alike, so nothing reaches a collective with bad input.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ..checkpoint import ProjectConfiguration
from ..configuration.environment import ACCUMULATION_ENV, MIXED_PRECISION_ENV, size_env_var
from ..configuration.dtypes import MIXED_PRECISION
from ..configuration.parallelism import SIZE_FIELDS, ParallelismConfig
from ..training.loss import LOSS_WEIGHTINGS
from ..parallel import uses_fsdp
from ..parallel.memory import MemoryKwargs
from ..fault_tolerance.settings import FaultToleranceKwargs, replica_group_config
from ..configuration.plugins import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    AORecipeKwargs,
    KwargsHandler,
    TERecipeKwargs,
    TorchDynamoPlugin,
    parse_bool,
)
from ..distributed.runtime import CPU_ENV, env_flag

HANDLERS = (InitProcessGroupKwargs, DistributedDataParallelKwargs, GradScalerKwargs, AutocastKwargs,
            GradientAccumulationPlugin, AORecipeKwargs, TERecipeKwargs, MemoryKwargs, FaultToleranceKwargs)
# Accelerate's arguments for engines ndparallel does not use: refused when given, with what to use instead.
FOREIGN_PLUGINS = {
    "deepspeed_plugin": "DeepSpeed is not used: ZeRO-3 is FSDP2 (dp_shard_size), Ulysses is sp_size",
    "deepspeed_plugins": "DeepSpeed is not used: ZeRO-3 is FSDP2 (dp_shard_size), Ulysses is sp_size",
    "megatron_lm_plugin": "Megatron-LM is not used: tensor parallelism is tp_size (ParallelismConfig)",
    "torch_tp_plugin": "tensor parallelism is ParallelismConfig(tp_size=..., tp_handler=TorchTensorParallelConfig())",
}


@dataclass
class Settings:
    parallelism: ParallelismConfig  # sizes may hold one -1 until `place` resolves them against the world size
    fsdp_plugin: FullyShardedDataParallelPlugin | None
    mixed_precision: str
    accumulation_steps: int
    sync_each_batch: bool
    adjust_scheduler: bool  # GradientAccumulationPlugin's: torch's step count moves on accumulation micro-steps
    cpu: bool
    device_placement: bool
    project: ProjectConfiguration
    dataloader: DataLoaderConfiguration
    step_scheduler_with_optimizer: bool
    loss_weighting: str
    log_with: Any
    process_group: dict[str, Any] = field(default_factory=dict)  # timeout / backend for torch.distributed
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    scaler_kwargs: dict[str, Any] = field(default_factory=dict)
    autocast_kwargs: dict[str, Any] = field(default_factory=dict)
    dynamo_plugin: TorchDynamoPlugin | None = None
    fp8_recipe: AORecipeKwargs | None = None  # mixed_precision="fp8": how torchao converts the linear layers
    memory: MemoryKwargs = field(default_factory=MemoryKwargs)  # chunked loss, tiled MLPs (+ NDPARALLEL_* variables)
    fault_tolerance: FaultToleranceKwargs | None = None  # replica groups on torchft (`ndparallel.fault_tolerance`)
    fsdp: bool = False  # FSDP2 wraps the models (`ndparallel.parallel.uses_fsdp`): decided once, by `place`

    def place(self, world_size: int) -> None:
        """Once the processes have started: resolve the sizes against `world_size` and decide whether FSDP2 wraps
        the models -- the mesh, the parallelisms (`PrepareOptions.fsdp`) and `AcceleratorState` read this decision."""
        if self.fault_tolerance is not None:  # this process's world is its replica group: dp_replicate is torchft's
            self.parallelism = replica_group_config(self.parallelism, self.fault_tolerance.replicas)
        self.parallelism = self.parallelism.resolve(world_size)
        self.fsdp = uses_fsdp(self.parallelism, self.fsdp_plugin)
        if self.fsdp and self.fsdp_plugin is not None:  # the policy FSDP2 casts with, there to read
            self.fsdp_plugin.set_mixed_precision(self.mixed_precision)


def _dynamo_plugin(backend: Any, plugin: Any, environ: Mapping[str, str]) -> TorchDynamoPlugin | None:
    """The compilation settings: a `TorchDynamoPlugin`, a backend name, or (neither given) the environment's
    ``NDPARALLEL_DYNAMO_*`` / ``ACCELERATE_DYNAMO_*`` (what ``accelerate launch`` exports); None: no compilation."""
    if plugin is not None and backend is not None:
        raise ValueError("Accelerator: pass dynamo_plugin or dynamo_backend, not both")
    _typed("dynamo_plugin", plugin, TorchDynamoPlugin)
    if plugin is None and backend is not None:
        plugin = TorchDynamoPlugin(backend=backend)
    if plugin is None:
        fields = {"backend": "BACKEND", "mode": "MODE", "fullgraph": "USE_FULLGRAPH", "dynamic": "USE_DYNAMIC",
                  "use_regional_compilation": "USE_REGIONAL_COMPILATION"}
        given = {}
        for name, suffix in fields.items():
            value, _ = _env_choice(environ, f"NDPARALLEL_DYNAMO_{suffix}", f"ACCELERATE_DYNAMO_{suffix}")
            if value is not None:
                given[name] = parse_bool(value, name) if name == "dynamic" else value
        plugin = TorchDynamoPlugin(**given) if given else None
    return plugin if plugin is not None and plugin.enabled else None


def _fp8_recipe(mixed_precision: Any, handlers: Mapping[type, KwargsHandler],
                environ: Mapping[str, str]) -> AORecipeKwargs | None:
    """The torchao recipe of ``mixed_precision="fp8"`` (None otherwise); refuses Transformer Engine and a missing
    torchao with what to do."""
    if TERecipeKwargs in handlers:
        raise ValueError("kwargs_handlers: TERecipeKwargs (Transformer Engine) is not supported by ndparallel; FP8 "
                         "training runs through torchao: pass AORecipeKwargs() (pip install torchao)")
    if mixed_precision is None:
        mixed_precision = environ.get(MIXED_PRECISION_ENV) or environ.get("ACCELERATE_MIXED_PRECISION")
    if str(getattr(mixed_precision, "value", mixed_precision)).lower() != "fp8":
        if AORecipeKwargs in handlers:
            raise ValueError("kwargs_handlers: AORecipeKwargs configures FP8 training; it needs mixed_precision='fp8'")
        return None
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ImportError("mixed_precision='fp8' trains the linear layers in FP8 through torchao, which is not "
                          "installed: pip install torchao") from None
    recipe = handlers.get(AORecipeKwargs)
    return recipe if isinstance(recipe, AORecipeKwargs) else AORecipeKwargs()


def _typed(name: str, value: Any, kind: type) -> Any:
    if value is not None and not isinstance(value, kind):
        raise TypeError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _env_choice(environ: Mapping[str, str], *names: str) -> tuple[str | None, str]:
    for name in names:
        if environ.get(name, "") != "":
            return environ[name], f"${name}"
    return None, ""


def resolve(*, parallelism_config: Any, fsdp_plugin: Any, mixed_precision: Any, gradient_accumulation_steps: Any,
            cpu: bool, device_placement: bool, project_dir: Any, project_config: Any, dataloader_config: Any,
            split_batches: Any, gradient_accumulation_plugin: Any, kwargs_handlers: Any, log_with: Any,
            step_scheduler_with_optimizer: bool, loss_weighting: str, rng_types: Any, dynamo_backend: Any,
            dynamo_plugin: Any, foreign: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Settings:
    """Every argument of `Accelerator.__init__` checked and combined with the environment (see the module doc)."""
    environ = os.environ if environ is None else environ
    _check_arguments(foreign, rng_types, loss_weighting, parallelism_config=parallelism_config,
                     fsdp_plugin=fsdp_plugin, project_config=project_config, dataloader_config=dataloader_config,
                     gradient_accumulation_plugin=gradient_accumulation_plugin)
    dynamo = _dynamo_plugin(dynamo_backend, dynamo_plugin, environ)
    handlers = _handlers(kwargs_handlers)
    fp8_recipe = _fp8_recipe(mixed_precision, handlers, environ)
    if gradient_accumulation_plugin is not None:
        if GradientAccumulationPlugin in handlers:
            raise ValueError("pass the GradientAccumulationPlugin once: as gradient_accumulation_plugin= or in "
                             "kwargs_handlers, not both")
        handlers[GradientAccumulationPlugin] = gradient_accumulation_plugin
    plugin = handlers.get(GradientAccumulationPlugin)
    mixed_precision = _mixed_precision(mixed_precision, environ)
    steps = _accumulation_steps(gradient_accumulation_steps, plugin, environ)
    cpu = bool(cpu) or env_flag(CPU_ENV) or env_flag("ACCELERATE_USE_CPU")
    if fsdp_plugin is not None or parse_bool(environ.get("ACCELERATE_USE_FSDP", "false"), "$ACCELERATE_USE_FSDP"):
        fsdp_plugin = FullyShardedDataParallelPlugin.from_env(fsdp_plugin, environ)
    parallelism = _parallelism(parallelism_config, fsdp_plugin, environ)
    dataloader = _dataloader(dataloader_config, split_batches)
    project = _project(project_config, project_dir)
    def handler_kwargs(kind: type) -> dict[str, Any]:
        return handlers[kind].to_kwargs() if kind in handlers else {}

    return Settings(
        parallelism=parallelism, fsdp_plugin=fsdp_plugin, mixed_precision=mixed_precision, accumulation_steps=steps,
        sync_each_batch=bool(plugin and plugin.sync_each_batch),
        adjust_scheduler=bool(plugin.adjust_scheduler) if plugin is not None else True, cpu=cpu,
        device_placement=bool(device_placement), project=project, dataloader=dataloader,
        step_scheduler_with_optimizer=bool(step_scheduler_with_optimizer), loss_weighting=loss_weighting,
        log_with=log_with, process_group=_process_group(handlers.get(InitProcessGroupKwargs)),
        ddp_kwargs=handler_kwargs(DistributedDataParallelKwargs), scaler_kwargs=handler_kwargs(GradScalerKwargs),
        autocast_kwargs=handler_kwargs(AutocastKwargs), dynamo_plugin=dynamo, fp8_recipe=fp8_recipe,
        memory=MemoryKwargs.from_env(handlers.get(MemoryKwargs), environ),
        fault_tolerance=FaultToleranceKwargs.from_env(handlers.get(FaultToleranceKwargs), environ),
    )


def _check_arguments(foreign: Mapping[str, Any], rng_types: Any, loss_weighting: str, **typed: Any) -> None:
    """Arguments refused outright, warned about, or of the wrong type."""
    for name, value in foreign.items():
        if value is not None:
            raise ValueError(f"Accelerator({name}=...) is not supported: {FOREIGN_PLUGINS[name]}")
    if rng_types is not None:
        warnings.warn("Accelerator(rng_types=...) is ignored: prepared data loaders seed every random sampler alike "
                      "on all ranks at each pass, and other generators stay per rank", stacklevel=5)
    if loss_weighting not in LOSS_WEIGHTINGS:
        raise ValueError(f"loss_weighting must be one of {list(LOSS_WEIGHTINGS)}, got {loss_weighting!r}")
    kinds = {"parallelism_config": ParallelismConfig, "fsdp_plugin": FullyShardedDataParallelPlugin,
             "project_config": ProjectConfiguration, "dataloader_config": DataLoaderConfiguration,
             "gradient_accumulation_plugin": GradientAccumulationPlugin}
    for name, value in typed.items():
        _typed(name, value, kinds[name])


def _handlers(kwargs_handlers: Any) -> dict[type, KwargsHandler]:
    """The kwargs handlers by kind: at most one of each."""
    handlers: dict[type, KwargsHandler] = {}
    for handler in kwargs_handlers or ():
        kind = next((k for k in HANDLERS if isinstance(handler, k)), None)
        if kind is None:
            raise TypeError(f"kwargs_handlers: unsupported handler {type(handler).__name__}; ndparallel takes "
                            f"{[k.__name__ for k in HANDLERS]}")
        if kind in handlers:
            raise ValueError(f"kwargs_handlers: more than one {kind.__name__}")
        handlers[kind] = handler
    return handlers


def _mixed_precision(mixed_precision: Any, environ: Mapping[str, str]) -> str:
    """The argument, else the launcher's variable, else "no"; Accelerate's PrecisionType taken by its value."""
    where = "mixed_precision"
    if mixed_precision is None:
        mixed_precision, where = _env_choice(environ, MIXED_PRECISION_ENV, "ACCELERATE_MIXED_PRECISION")
        mixed_precision = mixed_precision or "no"
    mixed_precision = str(getattr(mixed_precision, "value", mixed_precision)).lower()
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"{where} must be one of {list(MIXED_PRECISION)}, got {mixed_precision!r}")
    return mixed_precision


def _accumulation_steps(steps: Any, plugin: GradientAccumulationPlugin | None, environ: Mapping[str, str]) -> int:
    """The argument or the plugin's num_steps (which must agree), else the launcher's variable, else 1."""
    where = "gradient_accumulation_steps"
    if plugin is not None and plugin.num_steps is not None:
        if steps not in (None, 1, plugin.num_steps):
            raise ValueError(f"gradient_accumulation_steps={steps} and GradientAccumulationPlugin(num_steps="
                             f"{plugin.num_steps}) disagree; set one of them")
        steps, where = plugin.num_steps, "GradientAccumulationPlugin.num_steps"
    if steps is None:
        raw, where = _env_choice(environ, ACCUMULATION_ENV, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
        try:
            steps = int(raw) if raw is not None else 1
        except ValueError:
            raise ValueError(f"{where} must be an int >= 1, got {raw!r}") from None
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"{where} must be an int >= 1, got {steps!r}")
    if steps < 1:
        raise ValueError(f"{where} must be an int >= 1, got {steps!r}")
    return steps


def _parallelism(config: ParallelismConfig | None, fsdp_plugin: Any, environ: Mapping[str, str]) -> ParallelismConfig:
    """The layout: the argument completed from the environment. As Accelerate: none at all is FSDP sharding over every
    process when an FSDP plugin is on, else DDP; all sizes 1 is DDP over every process."""
    if config is None:
        launched = any(environ.get(var) for f in SIZE_FIELDS
                       for var in (size_env_var(f), "PARALLELISM_CONFIG_" + f.upper()))
        config = (ParallelismConfig() if launched else ParallelismConfig(dp_shard_size=-1)
                  if fsdp_plugin is not None else ParallelismConfig(dp_replicate_size=-1))
    parallelism = ParallelismConfig.from_env(config, environ)
    if all(size == 1 for size in parallelism.sizes().values()):
        parallelism = ParallelismConfig.from_env(ParallelismConfig(
            dp_replicate_size=-1, tp_handler=parallelism.tp_handler, cp_handler=parallelism.cp_handler), {})
    return parallelism


def _dataloader(config: DataLoaderConfiguration | None, split_batches: Any) -> DataLoaderConfiguration:
    dataloader = config or DataLoaderConfiguration()
    if split_batches is not None:
        if config is not None and config.split_batches != split_batches:
            raise ValueError("split_batches= and dataloader_config.split_batches disagree; set one of them")
        dataloader = DataLoaderConfiguration(**{**dataloader.__dict__, "split_batches": bool(split_batches)})
    return dataloader


def _project(config: ProjectConfiguration | None, project_dir: Any) -> ProjectConfiguration:
    project = config or ProjectConfiguration()
    if project_dir is not None:
        project.set_directories(project_dir)
    if project.automatic_checkpoint_naming and project.project_dir is None:  # checked here, as Accelerate does:
        # the directory may come with the Accelerator rather than the configuration
        raise ValueError("automatic_checkpoint_naming needs a project_dir: pass Accelerator(project_dir=...) or "
                         "ProjectConfiguration(project_dir=...)")
    return project


def _process_group(init: InitProcessGroupKwargs | None) -> dict[str, Any]:
    """``init_process_group`` keyword arguments from InitProcessGroupKwargs."""
    out: dict[str, Any] = {}
    if init is not None and init.timeout is not None:
        out["timeout"] = init.timeout if isinstance(init.timeout, timedelta) else timedelta(seconds=init.timeout)
    if init is not None and init.backend is not None:
        out["backend"] = init.backend
    return out
