"""Accelerate's plugin and settings objects: `FullyShardedDataParallelPlugin`, `GradientAccumulationPlugin`,
`DataLoaderConfiguration` and the kwargs handlers (`InitProcessGroupKwargs`, `DistributedDataParallelKwargs`,
`GradScalerKwargs`, `AutocastKwargs`), with Accelerate's field names.

As Accelerate's, the FSDP plugin's constructor fills the fields it is not given from the ``FSDP_*`` variables
``accelerate launch`` exports; `FullyShardedDataParallelPlugin.from_env` does the same from a mapping given explicitly.
Fields that mean nothing for FSDP2 (``sharding_strategy``, ``backward_prefetch``, ``use_orig_params``, ...) are
accepted and ignored with one warning, as Accelerate does.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import logging
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp.fully_sharded_data_parallel import (
    BackwardPrefetch,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)

from .dtypes import parse_dtype
from .plugin_fields import (  # noqa: F401 - importable from here too, as before
    FALSE_STRINGS,
    TRUE_STRINGS,
    ActivationCheckpointing,
    parse_activation_checkpointing,
    parse_bool,
)

AUTO_WRAP_POLICIES = ("transformer_based_wrap", "size_based_wrap", "no_wrap")
STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
# Accelerate's names of a plugin's mixed precision (`mixed_precision_policy="bf16"`): fp8 keeps its weights in bf16.
PLUGIN_PRECISIONS = {"fp8": torch.bfloat16, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# Accelerate's FSDP1 fields: accepted, warned about once, then ignored (FSDP2 has no such setting).
FSDP1_ONLY = ("sharding_strategy", "backward_prefetch", "state_dict_config", "optim_state_dict_config",
              "limit_all_gathers", "use_orig_params", "param_init_fn", "sync_module_states", "forward_prefetch")
FSDP_ENV_PREFIX = "FSDP_"
def _enum_name(value: Any) -> Any:
    """``StateDictType.FULL_STATE_DICT`` -> "FULL_STATE_DICT"; anything else unchanged."""
    return value.name if isinstance(value, enum.Enum) else value


def _parse_enum(value: Any, kind: type[enum.Enum], what: str) -> enum.Enum:
    """A member of torch's FSDP enum `kind` from the member, its name (any case) or its number (also as a string),
    as Accelerate takes them."""
    if isinstance(value, kind):
        return value
    try:
        if isinstance(value, int) and not isinstance(value, bool) or isinstance(value, str) and value.isdigit():
            return kind(int(value))
        if isinstance(value, str):
            return kind[value.strip().upper()]
    except (KeyError, ValueError):
        pass
    raise ValueError(f"{what}={value!r} is not one of {[m.name for m in kind]} (or their numbers "
                     f"{[m.value for m in kind]})")


@dataclass
class FullyShardedDataParallelPlugin:
    """Settings of FSDP2 (`torch.distributed.fsdp.fully_shard`), with every field of Accelerate's plugin. FSDP1's
    settings (`FSDP1_ONLY`) are accepted and ignored with one warning.

    Attributes:
        fsdp_version: 2 (FSDP1 is refused).
        auto_wrap_policy: "transformer_based_wrap" (default: each transformer block, then the root),
            "size_based_wrap" (every module holding at least `min_num_params` parameters not already wrapped,
            bottom-up), "no_wrap" (the root only), or a callable ``policy(module=, recurse=False, nonwrapped_numel=)``
            as torch's FSDP1 wrap policies take. Accelerate's upper-case spellings work.
        transformer_cls_names_to_wrap: block class names (a list or a comma-separated string); default: the model's
            ``_no_split_modules``.
        min_num_params: for "size_based_wrap" (0 means no wrapping, as in Accelerate).
        reshard_after_forward: free the gathered parameters after forward (ZeRO-3) or keep them (ZeRO-2); a bool or
            "true"/"false". It applies to the wrapped blocks; the root module keeps its parameters until the backward
            that starts with them either way (torch's choice for the root, `ndparallel.parallel.data_parallel`).
        mixed_precision_policy: a ``MixedPrecisionPolicy``, a dict of its fields (dtypes may be "bf16"...), a dtype
            name, or None to derive it from the Accelerator's ``mixed_precision`` (compute in it, reduce in fp32).
        cpu_offload: keep sharded parameters, gradients and optimizer state on the CPU; a bool, "true"/"false",
            ``CPUOffloadPolicy`` (on) or ``OffloadPolicy()`` (off).
        activation_checkpointing: recompute blocks' activations in backward: True (every block), or which blocks and
            what to keep -- "selective" (keep matmul and attention outputs), an int k (every k-th block), a dict or
            an `ActivationCheckpointing` (`parse_activation_checkpointing`).
        ignored_modules: modules (or a regex over module names) whose parameters FSDP leaves alone.
        state_dict_type: how `save_state` writes models and optimizers: "SHARDED_STATE_DICT" (each rank its shards,
            with torch.distributed.checkpoint) or "FULL_STATE_DICT" (rank 0 gathers and writes one file each);
            torch's ``StateDictType`` enum works too.
        cpu_ram_efficient_loading: accept models whose parameters are on the meta device in ``prepare`` and load
            their weights after sharding (see `ndparallel.checkpoint.load_pretrained`).
    """

    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: bool | str | None = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: str | Callable[..., bool] | None = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool | None = None
    use_orig_params: bool | None = None
    param_init_fn: Callable[[torch.nn.Module], None] | None = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool | str | int | dict | ActivationCheckpointing | None = None
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: list[str] | str | None = None
    min_num_params: int | None = None
    # Fields left unset (None) when the plugin was built: their defaults, or what `from_env` reads for them.
    unset: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.unset = frozenset(f.name for f in dataclasses.fields(self) if f.init and getattr(self, f.name) is None)
        self._apply_env(os.environ)

    def _apply_env(self, environ: Mapping[str, str]) -> None:
        """Fill the fields the caller left unset from ``FSDP_<FIELD>`` in `environ`, then parse and check them all."""
        given = [name for name in FSDP1_ONLY if name not in self.unset]  # explicitly: warned about below
        for name, var in _FSDP_ENV.items():
            raw = environ.get(FSDP_ENV_PREFIX + var, "")
            if name in self.unset and raw != "":
                setattr(self, name, raw)
        if self.fsdp_version is None:
            self.fsdp_version = 2
        if isinstance(self.fsdp_version, str) and self.fsdp_version.isdigit():
            self.fsdp_version = int(self.fsdp_version)
        if self.fsdp_version != 2:
            raise ValueError(
                f"fsdp_version={self.fsdp_version!r} is not supported: ndparallel uses FSDP2 (fully_shard) only; "
                "set fsdp_version=2"
            )
        if self.sharding_strategy is not None:  # FSDP1's; kept as torch's enum (from the launcher: silently)
            self.sharding_strategy = _parse_enum(self.sharding_strategy, ShardingStrategy, "sharding_strategy")
        if self.backward_prefetch is not None:  # FSDP1's: as Accelerate under FSDP2, warned about and dropped
            if str(_enum_name(self.backward_prefetch)).strip().upper() != "NO_PREFETCH":
                _parse_enum(self.backward_prefetch, BackwardPrefetch, "backward_prefetch")
                given = [n for n in FSDP1_ONLY if n in given or n == "backward_prefetch"]
                _log_as_accelerate("backward_prefetch is not supported in FSDP2. Setting backward prefetch to None.")
            else:
                given = [n for n in given if n != "backward_prefetch"]
            self.backward_prefetch = None
        if given:
            warnings.warn(f"FullyShardedDataParallelPlugin: {', '.join(given)} mean(s) nothing for FSDP2 and are "
                          "ignored", stacklevel=4)
        self.reshard_after_forward = parse_bool(
            True if self.reshard_after_forward is None else self.reshard_after_forward, "reshard_after_forward")
        self.auto_wrap_policy = self._parse_wrap_policy(self.auto_wrap_policy)
        if isinstance(self.transformer_cls_names_to_wrap, str):
            self.transformer_cls_names_to_wrap = [
                name.strip() for name in self.transformer_cls_names_to_wrap.split(",") if name.strip()
            ]
        if self.min_num_params is not None:
            if isinstance(self.min_num_params, str) and self.min_num_params.isdigit():
                self.min_num_params = int(self.min_num_params)
            if isinstance(self.min_num_params, bool) or not isinstance(self.min_num_params, int) \
                    or self.min_num_params < 0:
                raise ValueError(f"min_num_params must be an int >= 0, got {self.min_num_params!r}")
        if self.auto_wrap_policy == "size_based_wrap" and not self.min_num_params:
            self.auto_wrap_policy = "no_wrap"  # Accelerate: a size-based policy with min_num_params 0 wraps nothing
        self.cpu_offload = self._parse_offload(self.cpu_offload)
        self.activation_checkpointing = parse_activation_checkpointing(self.activation_checkpointing)
        self.cpu_ram_efficient_loading = parse_bool(False if self.cpu_ram_efficient_loading is None
                                                    else self.cpu_ram_efficient_loading, "cpu_ram_efficient_loading")
        self.set_state_dict_type(self.state_dict_type)
        if isinstance(self.ignored_modules, str):
            try:
                re.compile(self.ignored_modules)
            except re.error as exc:
                raise ValueError(f"ignored_modules={self.ignored_modules!r} is not a valid regex: {exc}") from None
        elif self.ignored_modules is not None:
            self.ignored_modules = self._module_list(self.ignored_modules)
        self.mixed_precision_policy = self._parse_mp_policy(self.mixed_precision_policy)

    # ---- Accelerate's methods -----------------------------------------------------------------------------------
    def set_state_dict_type(self, state_dict_type: Any = None) -> None:
        """Change how `save_state` writes models and optimizers (e.g. train sharded, save the last one full): a
        ``StateDictType`` or its name; None keeps the current one (default ``SHARDED_STATE_DICT``). The FSDP1
        ``state_dict_config`` / ``optim_state_dict_config`` the plugin was not given describe that choice:
        gathered on rank 0 and offloaded to the CPU for the full one."""
        value = state_dict_type if state_dict_type is not None else self.state_dict_type
        name = _enum_name(value) if value is not None else "SHARDED_STATE_DICT"
        name = name.strip().upper() if isinstance(name, str) and not name.isdigit() else name
        try:
            parsed = _parse_enum(name, StateDictType, "state_dict_type")
        except ValueError:
            parsed = None
        if parsed is None or parsed.name not in STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type={parsed.name if parsed else name!r} is not one of "
                             f"{list(STATE_DICT_TYPES)} (FSDP2 has no LOCAL_STATE_DICT)")
        self.state_dict_type = parsed
        full = parsed == StateDictType.FULL_STATE_DICT
        if "state_dict_config" in self.unset:
            self.state_dict_config = (FullStateDictConfig(offload_to_cpu=True, rank0_only=True) if full
                                      else ShardedStateDictConfig())
        if "optim_state_dict_config" in self.unset:
            self.optim_state_dict_config = (FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True) if full
                                            else ShardedOptimStateDictConfig())

    def set_auto_wrap_policy(self, model: torch.nn.Module) -> None:
        """Turn the policy into the callable Accelerate's method makes for `model`: torch's
        ``transformer_auto_wrap_policy`` over the block classes (`transformer_cls_names_to_wrap`, else the model's
        ``_no_split_modules``; a name the model lacks raises), ``size_based_auto_wrap_policy`` with
        `min_num_params`, or None for "no_wrap". `prepare` wraps by the result as it would by the name."""
        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

        if self.auto_wrap_policy == "transformer_based_wrap":
            names = self.transformer_cls_names_to_wrap
            if names is None:
                names = self.transformer_cls_names_to_wrap = list(getattr(model, "_no_split_modules", None) or [])
            present = {type(m).__name__: type(m) for m in model.modules()}
            for name in names:
                if name not in present:
                    raise ValueError(f"Could not find the transformer layer class {name} in the model. Its module "
                                     f"classes are: {sorted(present)}")
            self.auto_wrap_policy = functools.partial(transformer_auto_wrap_policy,
                                                      transformer_layer_cls={present[n] for n in names})
        elif self.auto_wrap_policy == "size_based_wrap":
            self.auto_wrap_policy = functools.partial(size_based_auto_wrap_policy, min_num_params=self.min_num_params)
        elif self.auto_wrap_policy == "no_wrap":
            self.auto_wrap_policy = None

    @property
    def offloads_to_cpu(self) -> bool:
        """Whether `cpu_offload` keeps parameters on the CPU (``CPUOffloadPolicy``; ``OffloadPolicy()`` is off)."""
        return isinstance(self.cpu_offload, CPUOffloadPolicy)

    @classmethod
    def from_env(cls, plugin: FullyShardedDataParallelPlugin | None = None,
                 environ: Mapping[str, str] | None = None) -> FullyShardedDataParallelPlugin:
        """A copy of `plugin` (default: every field unset) whose unset fields are read from ``FSDP_<FIELD>`` in
        `environ` (default: ``os.environ``) as ``accelerate launch`` exports them (``FSDP_VERSION``,
        ``FSDP_AUTO_WRAP_POLICY``, ``FSDP_OFFLOAD_PARAMS``, ``FSDP_TRANSFORMER_CLS_TO_WRAP``...), rather than from
        the environment it was built in."""
        if plugin is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plugin = cls(fsdp_version=2)  # its fields are all reset and read from `environ` below
            plugin.unset = frozenset(f.name for f in dataclasses.fields(cls) if f.init)
            quiet = False
        else:
            quiet = True  # the plugin warned already about what it was given
        out = copy.copy(plugin)
        for name in plugin.unset:
            setattr(out, name, None)
        with warnings.catch_warnings():
            if quiet:
                warnings.simplefilter("ignore")
            out._apply_env(os.environ if environ is None else environ)
        return out

    def set_mixed_precision(self, mixed_precision: str, buffer_autocast: bool = False,
                            override: bool = False) -> None:
        """Accelerate's: where the plugin sets no `mixed_precision_policy` (or with `override`), the Accelerator's
        `mixed_precision` ("bf16", "fp16", "fp8"; "no" sets none) gives it -- `derived_policy`: compute in that dtype,
        reduce gradients in fp32 (Accelerate: in that dtype; README, "Differences from Accelerate"). The Accelerator
        calls it on its copy of the plugin, so what was derived is there to read (``state.fsdp_plugin``).
        `buffer_autocast` is accepted for Accelerate's sake (FSDP1's buffers)."""
        if self.mixed_precision_policy is None or override:
            self.mixed_precision_policy = derived_policy(PLUGIN_PRECISIONS.get(str(mixed_precision).lower()))

    # ---- parsing ------------------------------------------------------------------------------------------------
    @staticmethod
    def _parse_wrap_policy(policy: Any) -> str | Callable[..., bool]:
        if policy is None:
            return "transformer_based_wrap"
        if callable(policy):
            return policy
        if isinstance(policy, str) and policy.lower() in AUTO_WRAP_POLICIES:
            return policy.lower()
        raise ValueError(f"auto_wrap_policy={policy!r} is not supported; use one of {list(AUTO_WRAP_POLICIES)} or a "
                         "callable policy(module=, recurse=, nonwrapped_numel=)")

    @staticmethod
    def _parse_offload(value: Any) -> OffloadPolicy:
        """As Accelerate's: ``CPUOffloadPolicy()`` (on) or ``OffloadPolicy()`` (off), from a bool, "true"/"false",
        FSDP1's ``CPUOffload`` or one of those policies (kept as given)."""
        if isinstance(value, OffloadPolicy):  # CPUOffloadPolicy subclasses OffloadPolicy, which means "no offload"
            return value
        if hasattr(value, "offload_params"):  # FSDP1's CPUOffload
            value = bool(value.offload_params)
        on = False if value is None else parse_bool(value, "cpu_offload")
        return CPUOffloadPolicy() if on else OffloadPolicy()

    @staticmethod
    def _module_list(value: Any) -> list[torch.nn.Module]:
        usage = "ignored_modules must be a regex over module names (a str) or an iterable of nn.Module objects"
        if isinstance(value, torch.nn.Module):
            return [value]
        try:
            modules = list(value)
        except TypeError:
            raise TypeError(f"{usage}, got {type(value).__name__} {value!r}") from None
        bad = [m for m in modules if not isinstance(m, torch.nn.Module)]
        if bad:
            raise TypeError(f"{usage}; these are not modules: {bad!r} (to select by name, pass one regex string)")
        return modules

    @staticmethod
    def _parse_mp_policy(policy: Any) -> MixedPrecisionPolicy | None:
        """As Accelerate's (1.16): a name ("bf16", "fp16", "fp32", "fp8") or dtype computes and reduces in that dtype
        and leaves outputs as computed (Accelerate 1.15 also cast outputs to it: ``output_dtype``, which rounded a
        loss computed in fp32 inside the model); a dict gives ``MixedPrecisionPolicy``'s fields (dtypes by name too)."""
        if policy is None or isinstance(policy, MixedPrecisionPolicy):
            return policy
        if isinstance(policy, (str, torch.dtype)):
            if isinstance(policy, str) and policy.lower() in PLUGIN_PRECISIONS:
                dtype = PLUGIN_PRECISIONS[policy.lower()]
            else:
                dtype = parse_dtype(policy, "mixed_precision_policy")
            return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        if isinstance(policy, dict):
            valid = {f.name for f in dataclasses.fields(MixedPrecisionPolicy)}
            unknown = sorted(set(policy) - valid)
            if unknown:
                raise ValueError(f"mixed_precision_policy: unknown field(s) {unknown}; valid: {sorted(valid)}")
            kwargs = {k: (parse_dtype(v, f"mixed_precision_policy.{k}") if k.endswith("dtype") else v)
                      for k, v in policy.items()}
            return MixedPrecisionPolicy(**kwargs)
        raise TypeError(
            "mixed_precision_policy must be a MixedPrecisionPolicy, a dict of its fields, a dtype name or None; "
            f"got {type(policy).__name__}"
        )


def derived_policy(dtype: torch.dtype | None) -> MixedPrecisionPolicy | None:
    """The policy of an Accelerator's mixed precision (`dtype`: its compute dtype, None without): compute in it,
    reduce gradients in fp32, which sums many ranks' gradients without low-precision rounding."""
    return None if dtype is None else MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def _log_as_accelerate(message: str) -> None:
    """Also log `message` where Accelerate logs it (``accelerate.utils.dataclasses``, a warning) when something
    listens there: code that watches Accelerate's log (its tests, a script's handler on ``accelerate``) sees it as
    under Accelerate. It is warned about through `warnings` either way, as ndparallel warns about every setting
    it ignores; without a listener only that warning shows, not the same line twice."""
    names = ("accelerate.utils.dataclasses", "accelerate.utils", "accelerate")
    if any(logging.getLogger(name).handlers for name in names):
        logging.getLogger(names[0]).warning(message)


# Plugin field -> the FSDP_* variable `accelerate launch` exports for it. FSDP1's use_orig_params, sync_module_states and
# forward_prefetch are not read (Accelerate reads them for FSDP1 only); sharding_strategy is, silently (it always
# exports one).
_FSDP_ENV = {
    "fsdp_version": "VERSION", "reshard_after_forward": "RESHARD_AFTER_FORWARD",
    "sharding_strategy": "SHARDING_STRATEGY", "backward_prefetch": "BACKWARD_PREFETCH",
    "cpu_offload": "OFFLOAD_PARAMS", "state_dict_type": "STATE_DICT_TYPE", "auto_wrap_policy": "AUTO_WRAP_POLICY",
    "transformer_cls_names_to_wrap": "TRANSFORMER_CLS_TO_WRAP", "min_num_params": "MIN_NUM_PARAMS",
    "activation_checkpointing": "ACTIVATION_CHECKPOINTING",
    "ignored_modules": "IGNORED_MODULES", "cpu_ram_efficient_loading": "CPU_RAM_EFFICIENT_LOADING",
}


# ---- the other settings objects -------------------------------------------------------------------------------------
class KwargsHandler:
    """Base of the objects passed in ``Accelerator(kwargs_handlers=[...])``: each configures one thing."""

    def to_kwargs(self) -> dict[str, Any]:
        """The fields that differ from their defaults."""
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)  # type: ignore[arg-type]
                if getattr(self, f.name) != getattr(default, f.name)}


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """How the process group is started: its ``timeout`` for collectives (a `timedelta` or seconds) and ``backend``
    (None: NCCL on GPUs, gloo on CPUs). ``init_method`` is accepted for Accelerate's sake; launchers set it."""

    backend: str | None = None
    init_method: str | None = None
    timeout: timedelta | float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.timeout, (int, float)) and not isinstance(self.timeout, bool):
            self.timeout = timedelta(seconds=self.timeout)
        if self.timeout is not None and not isinstance(self.timeout, timedelta):
            raise TypeError(f"InitProcessGroupKwargs.timeout must be a timedelta or seconds, got {self.timeout!r}")


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments of torch's `DistributedDataParallel`, where ndparallel wraps a model in it (plain data parallelism)."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments of the fp16 gradient scaler (`torch.amp.GradScaler`)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments of `torch.autocast` where mixed precision runs through it (outside FSDP2)."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """Accumulation settings: ``num_steps`` micro-steps per optimizer step; ``sync_with_dataloader``: the end of the
    data loader ends a window (always so here); ``sync_each_batch``: reduce gradients on every micro-step (less
    memory, more communication); ``adjust_scheduler``: on accumulation micro-steps the LR scheduler's step count
    moves (its learning rate does not), as in Accelerate."""

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        if self.num_steps is not None and (isinstance(self.num_steps, bool) or not isinstance(self.num_steps, int)
                                           or self.num_steps < 1):
            raise ValueError(f"GradientAccumulationPlugin.num_steps must be an int >= 1, got {self.num_steps!r}")
        if not self.sync_with_dataloader:
            raise ValueError("GradientAccumulationPlugin(sync_with_dataloader=False) is not supported: a window that "
                             "spans two passes over the data would mix epochs; leave it True")


@dataclass
class DataLoaderConfiguration:
    """How prepared data loaders split and deliver batches (Accelerate's fields).

    Attributes:
        split_batches: the loader's batch is the *global* batch, split over the ranks of ``batch`` (its size must
            divide); False (default): each rank draws batches of the loader's size.
        dispatch_batches: True is taken for map-style datasets, whose ranks each read the batch rank 0 would have
            sent them (every rank reads its own share; rank 0 does not read for all); refused at `prepare` for an
            iterable dataset, whose order only rank 0's reading would fix.
        even_batches: True (default) pads a partial last global batch with samples from the start, so every rank
            gets a batch (``gather_for_metrics`` drops the repeats); False gives the ranks what is left, unevenly.
        use_seedable_sampler: every random sampler draws from a generator seeded alike on all ranks (always so
            here).
        data_seed: fixes the seed of those generators.
        non_blocking: copy batches to the device asynchronously (with ``pin_memory=True`` loaders).
        use_stateful_dataloader: prepared loaders have ``state_dict`` / ``load_state_dict`` either way; with it (and
            torchdata installed) they are also torchdata's ``StatefulDataLoader`` by type, as Accelerate's are.
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


__all__ = [
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
]


@dataclass
class TorchDynamoPlugin(KwargsHandler):
    """Compile the prepared model with ``torch.compile`` (Accelerate's plugin: same fields and meaning).

    Attributes:
        backend: a Dynamo backend ("inductor", "aot_eager", ... `torch._dynamo.list_backends()`), or "no" (no
            compilation, the default); Accelerate's upper-case enum names work too.
        mode: ``torch.compile``'s.
        fullgraph: ``torch.compile``'s.
        dynamic: ``torch.compile``'s.
        options: ``torch.compile``'s.
        disable: compile nothing (for tests).
        use_regional_compilation: compile each transformer block (the classes the FSDP wrap policy uses: the model's
            ``_no_split_modules`` or ``transformer_cls_names_to_wrap``) on its own, before FSDP wraps it -- the
            blocks share one compiled graph, so the cold start compiles one block instead of the whole model; the
            rest of the model runs eagerly. Otherwise the whole prepared model is compiled.
    """

    backend: Any = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        backend = str("no" if self.backend is None else _enum_name(self.backend)).lower()  # Accelerate's enum: upper
        if backend != "no":
            import torch._dynamo

            known = torch._dynamo.list_backends(exclude_tags=())
            if backend not in known:
                raise ValueError(f"TorchDynamoPlugin: unknown dynamo backend {self.backend!r}; known: {known} (or "
                                 "'no' for no compilation)")
        self.backend = backend
        self.mode = self.mode or "default"
        self.fullgraph = parse_bool(False if self.fullgraph is None else self.fullgraph, "fullgraph")
        self.disable = parse_bool(self.disable, "disable")
        self.use_regional_compilation = parse_bool(
            False if self.use_regional_compilation is None else self.use_regional_compilation,
            "use_regional_compilation")

    @property
    def enabled(self) -> bool:
        return self.backend != "no" and not self.disable

    def to_compile_kwargs(self) -> dict[str, Any]:
        """``torch.compile``'s keyword arguments."""
        kwargs: dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if self.options:  # torch.compile takes mode or options, not both
            kwargs["options"] = self.options
        else:
            kwargs["mode"] = self.mode
        return kwargs


@dataclass
class AORecipeKwargs(KwargsHandler):
    """FP8 training through torchao (``mixed_precision="fp8"``), Accelerate's handler: `config` is a torchao
    ``Float8LinearConfig`` (default: dynamic tensorwise scaling; under FSDP2 the float8 all-gather of weights);
    `module_filter_func(module, fqn) -> bool` picks the linear layers to convert (default: every ``nn.Linear``
    whose dimensions are multiples of 16, but the model's first and last, which stay in high precision)."""

    config: Any = None
    module_filter_func: Callable[[torch.nn.Module, str], bool] | None = None


@dataclass
class TERecipeKwargs(KwargsHandler):
    """Accelerate's handler for FP8 through NVIDIA Transformer Engine. ndparallel does not drive Transformer Engine:
    passing it is refused with what to use instead (`AORecipeKwargs`, torchao)."""

    use_autocast_during_eval: bool | None = None
    margin: int | None = None
    interval: int | None = None
    fp8_format: str | None = None
    amax_history_len: int | None = None
    amax_compute_algo: str | None = None
    override_linear_precision: Any = None
    use_mxfp8_block_scaling: bool | None = None
