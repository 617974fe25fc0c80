"""Configuration objects: which parallelisms to use and how.

`ParallelismConfig` keeps Hugging Face Accelerate's field names so a script written for Accelerate's
ND-parallel API runs with only its imports changed. Every size defaults to 1; at most one may be -1,
meaning "the ranks that are left". A size left unset (``None``) is 1, unless the Accelerator reads it from the
environment variable ``NDPARALLEL_<FIELD>`` (``NDPARALLEL_DP_SHARD_SIZE``...), which ``ndparallel launch`` sets:
`ParallelismConfig.from_env`, the only place that reads them. So a launched script that builds
``ParallelismConfig()`` with no arguments runs with the launch's sizes.

Validation happens twice: when the object is built (types, -1 at most once) and in `resolve`, against the
world size, with errors that show every factor.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# Mesh axes, outermost first. TP is innermost: it needs the fastest links.
AXES: tuple[str, ...] = ("dp_replicate", "dp_shard", "cp", "sp", "tp")
SIZE_FIELDS: tuple[str, ...] = tuple(f"{axis}_size" for axis in AXES)
ENV_PREFIX = "NDPARALLEL_"
# Settings `ndparallel launch` passes to the Accelerator of every rank (used when the script leaves them unset).
MIXED_PRECISION_ENV = ENV_PREFIX + "MIXED_PRECISION"
ACCUMULATION_ENV = ENV_PREFIX + "GRADIENT_ACCUMULATION_STEPS"

# Floating-point dtypes by the names settings use. Mixed precision is one of MIXED_PRECISION: "no" computes in the
# parameters' own dtype, the others in that dtype (`compute_dtype`).
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                                  "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
MIXED_PRECISION = ("no", "bf16", "fp16")


def compute_dtype(mixed_precision: str) -> torch.dtype | None:
    """The dtype a `mixed_precision` setting computes in; None for "no"."""
    return None if mixed_precision == "no" else DTYPES[mixed_precision]


def parse_dtype(value: Any, what: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower() in DTYPES:
        return DTYPES[value.lower()]
    raise ValueError(f"{what}: unknown dtype {value!r}; use one of {sorted(DTYPES)} or a torch.dtype")


def size_env_var(field_name: str) -> str:
    """Environment variable through which the launcher passes one size, e.g. ``NDPARALLEL_TP_SIZE``."""
    return ENV_PREFIX + field_name.upper()


def _check_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (>= 1, or -1 for 'the ranks that are left'), got {value!r}")
    if value == 0 or value < -1:
        raise ValueError(f"{name} must be >= 1, or -1 for 'the ranks that are left'; got {value}")
    return value


@dataclass
class TorchTensorParallelConfig:
    """How tensor parallelism is applied.

    plan: a dict from module-name pattern to style (see `ndparallel.parallel.tensor`); None means the model's
        own or a built-in plan.
    sequence_parallel: Megatron-style sequence parallelism of norms and dropout between TP regions.
    loss_parallel: keep the LM head's logits split over the vocabulary and compute the cross-entropy on the
        shards (torch's ``loss_parallel``): no rank ever holds the full (batch, seq, vocab) logits. The model's
        ``logits`` output is then a DTensor sharded on its last dimension.
    """

    plan: dict[str, str] | None = None
    sequence_parallel: bool = False
    loss_parallel: bool = False

    def __post_init__(self) -> None:
        if self.plan is not None and not isinstance(self.plan, dict):
            raise TypeError(f"TorchTensorParallelConfig.plan must be a dict of pattern -> style, got {type(self.plan).__name__}")


CP_STRATEGIES = ("allgather", "ring")


@dataclass
class TorchContextParallelConfig:
    """How context parallelism (cp_size > 1) shards sequences and computes attention over them.

    cp_comm_strategy: "allgather" (all-gather K/V over cp; their gradients are reduce-scattered back) or "ring"
        (pass K/V blocks around the ring with point-to-point sends, merge partial results by log-sum-exp; memory
        stays 1/cp of the sequence). Both are exact; see `ndparallel.parallel.sequence`.
    load_balance: rank r holds chunks r and 2*cp-1-r of 2*cp equal chunks, so causal attention costs every rank
        the same (sequence length must be a multiple of 2*cp); False: rank r holds chunk r of cp (a multiple of cp).
    """

    cp_comm_strategy: str = "allgather"
    load_balance: bool = True

    def __post_init__(self) -> None:
        if self.cp_comm_strategy not in CP_STRATEGIES:
            raise ValueError(
                f"cp_comm_strategy must be one of {list(CP_STRATEGIES)}, got {self.cp_comm_strategy!r}"
            )
        if not isinstance(self.load_balance, bool):
            raise TypeError(f"load_balance must be a bool, got {self.load_balance!r}")


@dataclass
class ParallelismConfig:
    """Sizes of each parallelism; their product must equal the world size.

    Mesh axes, outermost first: dp_replicate, dp_shard, cp, sp, tp.
    - dp_replicate_size: replicas that each hold full (or HSDP-sharded) parameters (DDP / the replicate
      dimension of HSDP).
    - dp_shard_size: ranks across which FSDP2 shards parameters and which see different samples.
    - cp_size / sp_size: context parallel (ring / all-gather attention) and Ulysses sequence parallel.
    - tp_size: tensor parallel.
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    sp_size: int | None = None
    tp_handler: TorchTensorParallelConfig | None = None
    cp_handler: TorchContextParallelConfig | None = None
    # Size fields left unset (None): 1, or what `from_env` reads for them.
    unset: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.unset = frozenset(name for name in SIZE_FIELDS if getattr(self, name) is None)
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            setattr(self, name, _check_size(name, 1 if value is None else value))
        unknown = [name for name in SIZE_FIELDS if getattr(self, name) == -1]
        if len(unknown) > 1:
            raise ValueError(
                f"at most one size may be -1 ('the ranks that are left'); got -1 for {', '.join(unknown)}"
            )
        if self.tp_handler is not None and not isinstance(self.tp_handler, TorchTensorParallelConfig):
            raise TypeError(f"tp_handler must be a TorchTensorParallelConfig, got {type(self.tp_handler).__name__}")
        if self.cp_handler is not None and not isinstance(self.cp_handler, TorchContextParallelConfig):
            raise TypeError(f"cp_handler must be a TorchContextParallelConfig, got {type(self.cp_handler).__name__}")
        if self.tp_handler is None:
            self.tp_handler = TorchTensorParallelConfig()
        if self.cp_handler is None:
            self.cp_handler = TorchContextParallelConfig()

    @classmethod
    def from_env(cls, config: ParallelismConfig | None = None,
                 environ: Mapping[str, str] | None = None) -> ParallelismConfig:
        """`config` (default: all sizes unset) with each size it left unset read from ``NDPARALLEL_<FIELD>``
        (`size_env_var`), which ``ndparallel launch`` sets; 1 where that is unset or empty too."""
        config = cls() if config is None else config
        environ = os.environ if environ is None else environ
        sizes = {}
        for name in config.unset:
            raw = environ.get(size_env_var(name), "")
            if raw == "":
                continue
            try:
                sizes[name] = int(raw)
            except ValueError:
                raise ValueError(f"environment variable {size_env_var(name)}={raw!r} is not an integer") from None
        return dataclasses.replace(config, **{**{n: getattr(config, n) for n in SIZE_FIELDS}, **sizes})

    # ---- sizes --------------------------------------------------------------------------------------
    def sizes(self) -> dict[str, int]:
        """Axis name -> size, outermost first (may contain one -1 before `resolve`)."""
        return {axis: getattr(self, f"{axis}_size") for axis in AXES}

    def formula(self) -> str:
        """The sizes other than 1 as a product, e.g. ``dp_shard(2) * tp(2)`` ("1" when all are 1)."""
        return " * ".join(f"{axis}({size})" for axis, size in self.sizes().items() if size != 1) or "1"

    def resolve(self, world_size: int) -> ParallelismConfig:
        """Return a copy whose -1 is filled in and whose sizes multiply to `world_size`, or raise."""
        sizes = self.sizes()
        known = math.prod(s for s in sizes.values() if s != -1)
        free = [axis for axis, s in sizes.items() if s == -1]
        if free:
            if world_size % known:
                raise ValueError(
                    f"cannot fill {free[0]}_size=-1: world size {world_size} is not divisible by "
                    f"{' * '.join(f'{a}({s})' for a, s in sizes.items() if s not in (1, -1)) or '1'} = {known}"
                )
            sizes[free[0]] = world_size // known
        resolved = dataclasses.replace(self, **{f"{a}_size": s for a, s in sizes.items()})
        total = math.prod(sizes.values())
        if total != world_size:
            hint = (
                " Set one size to -1 to give it the ranks that are left, or launch with "
                f"{total} processes in all."
            )
            raise ValueError(f"{resolved.formula()} = {total} != world size {world_size}.{hint}")
        return resolved

    @property
    def total_size(self) -> int:
        if any(s == -1 for s in self.sizes().values()):
            raise ValueError("total_size is unknown until a -1 size is resolved against the world size")
        return math.prod(self.sizes().values())

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different samples: dp_replicate * dp_shard."""
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def non_data_parallel_size(self) -> int:
        return self.cp_size * self.sp_size * self.tp_size

    dp_replicate_enabled = property(lambda self: self.dp_replicate_size > 1)
    dp_shard_enabled = property(lambda self: self.dp_shard_size > 1)
    tp_enabled = property(lambda self: self.tp_size > 1)
    cp_enabled = property(lambda self: self.cp_size > 1)
    sp_enabled = property(lambda self: self.sp_size > 1)

    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate_enabled or self.dp_shard_enabled

    @property
    def active_mesh_dims(self) -> list[str]:
        return [axis for axis, size in self.sizes().items() if size != 1]

    # ---- serialisation ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in SIZE_FIELDS}
        out["tp_handler"] = dataclasses.asdict(self.tp_handler)
        out["cp_handler"] = dataclasses.asdict(self.cp_handler)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelismConfig:
        if not isinstance(data, dict):
            raise TypeError(f"a parallelism config must be a mapping, got {type(data).__name__}")
        allowed = set(SIZE_FIELDS) | {"tp_handler", "cp_handler"}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(f"unknown parallelism config key(s) {unknown}; valid keys: {sorted(allowed)}")
        kwargs = dict(data)
        if isinstance(kwargs.get("tp_handler"), dict):
            kwargs["tp_handler"] = TorchTensorParallelConfig(**kwargs["tp_handler"])
        if isinstance(kwargs.get("cp_handler"), dict):
            kwargs["cp_handler"] = TorchContextParallelConfig(**kwargs["cp_handler"])
        return cls(**kwargs)

    def to_yaml(self, path: str | os.PathLike | None = None) -> str:
        import yaml

        text = yaml.safe_dump({"parallelism": self.to_dict()}, sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> ParallelismConfig:
        """Read the ``parallelism:`` section of a YAML file written by `to_yaml` or ``ndparallel config``."""
        section = load_yaml(path).get("parallelism")
        return cls.from_dict({} if section is None else section)  # an empty `parallelism:` means defaults

    def to_env(self) -> dict[str, str]:
        """Environment variables that make ``ParallelismConfig()`` in a launched script equal this one."""
        return {size_env_var(name): str(getattr(self, name)) for name in SIZE_FIELDS}


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Load a YAML mapping with an error that names the file when it is missing or malformed."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {str(p)!r} does not exist; write one with `ndparallel config`")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(p)!r} must hold a mapping at the top level, got {type(data).__name__}")
    return data


# ---- FSDP plugin ----------------------------------------------------------------------------------------
AUTO_WRAP_POLICIES = ("transformer_based_wrap", "no_wrap")
STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")


@dataclass
class FullyShardedDataParallelPlugin:
    """Settings of FSDP2 (`torch.distributed.fsdp.fully_shard`), with Accelerate's field names.

    - auto_wrap_policy: "transformer_based_wrap" shards each transformer block separately (then the root);
      "no_wrap" shards only the root module.
    - transformer_cls_names_to_wrap: block class names; default: the model's ``_no_split_modules``.
    - reshard_after_forward: free the gathered parameters after forward (ZeRO-3) or keep them (ZeRO-2).
    - mixed_precision_policy: a ``MixedPrecisionPolicy``, a dict of its fields (dtypes may be "bf16"...),
      or None to derive it from the Accelerator's ``mixed_precision``.
    - cpu_offload: keep sharded parameters, gradients and optimizer state on the CPU.
    - activation_checkpointing: recompute each wrapped block's activations in backward.
    - ignored_modules: modules (or a regex over module names) whose parameters FSDP leaves alone.
    - state_dict_type: how `save_state` writes models and optimizers: "SHARDED_STATE_DICT" (each rank its shards,
      with torch.distributed.checkpoint) or "FULL_STATE_DICT" (rank 0 gathers and writes one file each).
    - cpu_ram_efficient_loading: accept models whose parameters are on the meta device in ``prepare`` and load
      their weights after sharding -- broadcast from rank 0, or each rank reading its own slices of the
      safetensors files (see `ndparallel.checkpoint.pretrained`).
    """

    fsdp_version: int = 2
    auto_wrap_policy: str = "transformer_based_wrap"
    transformer_cls_names_to_wrap: list[str] | str | None = None
    reshard_after_forward: bool = True
    mixed_precision_policy: Any = None
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    ignored_modules: Any = None
    state_dict_type: str = "SHARDED_STATE_DICT"
    cpu_ram_efficient_loading: bool = False

    def __post_init__(self) -> None:
        if self.fsdp_version != 2:
            raise ValueError(
                f"fsdp_version={self.fsdp_version!r} is not supported: ndparallel uses FSDP2 (fully_shard) only; "
                "set fsdp_version=2"
            )
        if isinstance(self.auto_wrap_policy, str):  # Accelerate spells them "TRANSFORMER_BASED_WRAP"
            self.auto_wrap_policy = self.auto_wrap_policy.lower()
        if self.auto_wrap_policy not in AUTO_WRAP_POLICIES:
            raise ValueError(
                f"auto_wrap_policy={self.auto_wrap_policy!r} is not supported; use one of {list(AUTO_WRAP_POLICIES)}"
            )
        if isinstance(self.transformer_cls_names_to_wrap, str):
            self.transformer_cls_names_to_wrap = [
                name.strip() for name in self.transformer_cls_names_to_wrap.split(",") if name.strip()
            ]
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError(f"reshard_after_forward must be a bool, got {self.reshard_after_forward!r}")
        if not isinstance(self.cpu_ram_efficient_loading, bool):
            raise TypeError(f"cpu_ram_efficient_loading must be a bool, got {self.cpu_ram_efficient_loading!r}")
        if isinstance(self.state_dict_type, str):
            self.state_dict_type = self.state_dict_type.upper()
        if self.state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type={self.state_dict_type!r} is not one of {list(STATE_DICT_TYPES)}")
        if isinstance(self.ignored_modules, str):
            try:
                re.compile(self.ignored_modules)
            except re.error as exc:
                raise ValueError(f"ignored_modules={self.ignored_modules!r} is not a valid regex: {exc}") from None
        elif self.ignored_modules is not None:
            self.ignored_modules = self._module_list(self.ignored_modules)
        self.mixed_precision_policy = self._parse_mp_policy(self.mixed_precision_policy)

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
    def _parse_mp_policy(policy: Any) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if policy is None or isinstance(policy, MixedPrecisionPolicy):
            return policy
        if isinstance(policy, str):
            dtype = parse_dtype(policy, "mixed_precision_policy")
            return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
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


__all__ = [
    "AXES",
    "FullyShardedDataParallelPlugin",
    "ParallelismConfig",
    "TorchContextParallelConfig",
    "TorchTensorParallelConfig",
]
