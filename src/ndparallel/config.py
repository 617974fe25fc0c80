"""Configuration objects: which parallelisms to use and how.

`ParallelismConfig` keeps Hugging Face Accelerate's field names so a script written for Accelerate's
ND-parallel API runs with only its imports changed. Every size defaults to 1; at most one may be -1,
meaning "the ranks that are left". A size left unset (``None``) is read, as Accelerate's constructor reads it, from
the environment: ``NDPARALLEL_<FIELD>`` (``NDPARALLEL_DP_SHARD_SIZE``..., which ``ndparallel launch`` sets), else
Accelerate's ``PARALLELISM_CONFIG_<FIELD>`` (which ``accelerate launch`` sets), else 1. So a launched script that
builds ``ParallelismConfig()`` with no arguments runs with the launch's sizes. `ParallelismConfig.from_env` does the
same from a mapping given explicitly (the Accelerator's settings, tests).

Validation happens twice: when the object is built (types, -1 at most once) and in `resolve`, against the
world size, with errors that show every factor.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh


from .layout import AXES, VIEWS, Layout  # the axes, outermost first, and the views: declared once, there

AXIS_FIELDS: tuple[str, ...] = tuple(f"{axis}_size" for axis in AXES)  # their product is the world size
# Every size a config, a flag, a file or a variable sets. ep_size is no axis: the expert-parallel ranks are carved out
# of the ranks that already hold different tokens (dp_shard x cp x sp), so it does not multiply the world size.
SIZE_FIELDS: tuple[str, ...] = (*AXIS_FIELDS, "ep_size")
ENV_PREFIX = "NDPARALLEL_"
# Settings `ndparallel launch` passes to the Accelerator of every rank (used when the script leaves them unset).
MIXED_PRECISION_ENV = ENV_PREFIX + "MIXED_PRECISION"
ACCUMULATION_ENV = ENV_PREFIX + "GRADIENT_ACCUMULATION_STEPS"

# Floating-point dtypes by the names settings use. Mixed precision is one of MIXED_PRECISION: "no" computes in the
# parameters' own dtype, the others in that dtype (`compute_dtype`).
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                                  "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
MIXED_PRECISION = ("no", "bf16", "fp16", "fp8")


def compute_dtype(mixed_precision: str) -> torch.dtype | None:
    """The dtype a `mixed_precision` setting computes in; None for "no". fp8 computes its eligible linear layers'
    matmuls in fp8 (`ndparallel.parallel.fp8`) and the rest in bf16, as Accelerate does."""
    if mixed_precision == "fp8":
        return torch.bfloat16
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
    enable_async_tp: Accelerate's field; accepted and ignored with a warning (no asynchronous TP here).
    """

    plan: dict[str, str] | None = None
    sequence_parallel: bool = False
    loss_parallel: bool = False
    enable_async_tp: bool = False

    def __post_init__(self) -> None:
        if self.plan is not None and not isinstance(self.plan, dict):
            raise TypeError("TorchTensorParallelConfig.plan must be a dict of pattern -> style, got "
                            f"{type(self.plan).__name__}")
        if self.enable_async_tp:
            warnings.warn("TorchTensorParallelConfig(enable_async_tp=True): asynchronous tensor parallelism is not "
                          "supported; ignoring it", stacklevel=3)


# Context-parallel strategies; Accelerate's "alltoall" (torch's rotation of K/V blocks between the cp ranks) is
# ndparallel's ring.
CP_STRATEGIES = ("allgather", "ring", "alltoall")
CP_STRATEGY_ENV = "PARALLELISM_CONFIG_CP_COMM_STRATEGY"  # what `accelerate launch` exports


def strategy_from_env(environ: Mapping[str, str]) -> str:
    """The context-parallel strategy `environ` sets (``PARALLELISM_CONFIG_CP_COMM_STRATEGY``), else "allgather"."""
    strategy = environ.get(CP_STRATEGY_ENV) or "allgather"
    if strategy not in CP_STRATEGIES:
        raise ValueError(f"Invalid cp_comm_strategy: {strategy} (from ${CP_STRATEGY_ENV}). Must be one of "
                         f"{list(CP_STRATEGIES)}")
    return strategy


@dataclass
class TorchContextParallelConfig:
    """How context parallelism (cp_size > 1) shards sequences and computes attention over them.

    cp_comm_strategy: "allgather" (default: all-gather K/V over cp; their gradients are reduce-scattered back) or
        "ring" (pass K/V blocks around the ring with point-to-point sends, merge partial results by log-sum-exp;
        memory stays 1/cp of the sequence; Accelerate's name for it is "alltoall"). Both are exact; see
        `ndparallel.parallel.sequence`.
    load_balance: rank r holds chunks r and 2*cp-1-r of 2*cp equal chunks, so causal attention costs every rank
        the same (sequence length must be a multiple of 2*cp); False: rank r holds chunk r of cp (a multiple of cp).
    balance_documents: for packed or padded rows (whose attention work the load-balanced layout does not even out),
        deal 4*cp equal chunks of each batch over the cp ranks by their attention work instead, when that is more
        even (`ndparallel.parallel.sequence.masking.balanced_assignment`; batches from the prepared data loader,
        sequence length a multiple of 4*cp). Exact either way; only the balance changes.
    """

    cp_comm_strategy: str | None = None
    load_balance: bool = True
    balance_documents: bool = False

    def __post_init__(self) -> None:
        if self.cp_comm_strategy is None:  # as Accelerate's: what `accelerate launch` exported, else all-gather
            self.cp_comm_strategy = strategy_from_env(os.environ)
        elif self.cp_comm_strategy not in CP_STRATEGIES:
            raise ValueError(f"Invalid cp_comm_strategy: {self.cp_comm_strategy}. Must be one of {list(CP_STRATEGIES)}")
        if not isinstance(self.load_balance, bool):
            raise TypeError(f"load_balance must be a bool, got {self.load_balance!r}")
        if not isinstance(self.balance_documents, bool):
            raise TypeError(f"balance_documents must be a bool, got {self.balance_documents!r}")


# Pipeline schedules by name -> (torch.distributed.pipelining class, stages per rank it takes: 1, or "2+", or 2).
PP_SCHEDULES: dict[str, tuple[str, str]] = {
    "gpipe": ("ScheduleGPipe", "1"),
    "1f1b": ("Schedule1F1B", "1"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "2+"),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", "2+"),
    "zbv": ("ScheduleZBVZeroBubble", "2"),
}


@dataclass
class PipelineParallelConfig:
    """How pipeline parallelism (pp_size > 1) splits the model and schedules its micro-batches
    (`ndparallel.parallel.pipeline`).

    schedule: "1f1b" (default), "gpipe", "interleaved_1f1b", "zero_bubble" (interleaved, backward split into input
        and weight gradients) or "zbv" (zero bubble over two stages per rank in a V), torch's schedules.
    microbatches: micro-batches each rank's batch is cut into (its rows must divide by it); None: one per stage
        of the pipeline (pp_size * stages_per_rank), the fewest that keep every stage busy.
    stages_per_rank: model chunks each rank holds (virtual stages); None: 1, or 2 for the interleaved schedules.
    split: where stages begin -- None: balanced by parameter count; a list of decoder-layer indices (a Hugging
        Face causal LM: stage s > 0 begins at layer ``split[s-1]``); or a list of module names (any model whose
        forward runs its top-level children in order, such as an ``nn.Sequential``: stage s > 0 begins at child
        ``split[s-1]``). One entry fewer than the pipeline's stages.
    loss_fn: ``loss_fn(output, labels) -> mean loss`` for models that compute no loss of their own (not needed for
        Hugging Face causal LMs, whose own loss function is used).
    """

    schedule: str = "1f1b"
    microbatches: int | None = None
    stages_per_rank: int | None = None
    split: list[int] | list[str] | None = None
    loss_fn: Any = None

    def __post_init__(self) -> None:
        if self.schedule not in PP_SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {self.schedule!r}; use one of {list(PP_SCHEDULES)}")
        takes = PP_SCHEDULES[self.schedule][1]
        if self.stages_per_rank is None:
            self.stages_per_rank = 1 if takes == "1" else 2
        if isinstance(self.stages_per_rank, bool) or not isinstance(self.stages_per_rank, int) or (
                self.stages_per_rank < 1):
            raise ValueError(f"stages_per_rank must be an int >= 1, got {self.stages_per_rank!r}")
        ok = {"1": self.stages_per_rank == 1, "2": self.stages_per_rank == 2, "2+": self.stages_per_rank >= 2}[takes]
        if not ok:
            want = {"1": "1", "2": "2", "2+": "2 or more"}[takes]
            raise ValueError(f"schedule {self.schedule!r} runs {want} stage(s) per rank, got stages_per_rank="
                             f"{self.stages_per_rank}; single-stage schedules: gpipe, 1f1b; interleaved: "
                             "interleaved_1f1b, zero_bubble (2 or more), zbv (2)")
        if self.microbatches is not None and (isinstance(self.microbatches, bool) or not isinstance(
                self.microbatches, int) or self.microbatches < 1):
            raise ValueError(f"microbatches must be an int >= 1 (or None: one per stage), got {self.microbatches!r}")
        if self.split is not None:
            if not isinstance(self.split, (list, tuple)) or not (
                    all(isinstance(x, int) and not isinstance(x, bool) for x in self.split)
                    or all(isinstance(x, str) for x in self.split)):
                raise TypeError("split must be a list of layer indices or a list of module names, got "
                                f"{self.split!r}")
            self.split = list(self.split)
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(output, labels), got {type(self.loss_fn).__name__}")


CP_BACKENDS = ("torch",)  # Accelerate's name for torch-native context parallelism: here, ndparallel's own
SP_BACKENDS = ("ndparallel", "deepspeed")  # "deepspeed": Accelerate's default, refused when sp_size > 1
# Accelerate's environment variables (`accelerate launch` exports them), read for the fields a config leaves unset
# after ndparallel's own NDPARALLEL_<FIELD>.
ACCELERATE_ENV_PREFIX = "PARALLELISM_CONFIG_"
ENV_FIELDS = (*SIZE_FIELDS, "cp_backend", "sp_backend", "cp_handler")  # what the environment may fill when unset


def _env_values(unset: frozenset[str], environ: Mapping[str, str]) -> dict[str, Any]:
    """The fields in `unset` that `environ` sets: each size from ``NDPARALLEL_<FIELD>``, else
    ``PARALLELISM_CONFIG_<FIELD>``; the backends from ``PARALLELISM_CONFIG_CP_BACKEND`` / ``_SP_BACKEND``; the
    context-parallel handler from ``PARALLELISM_CONFIG_CP_COMM_STRATEGY``."""
    values: dict[str, Any] = {}
    for name in sorted(unset & set(SIZE_FIELDS)):
        for var in (size_env_var(name), ACCELERATE_ENV_PREFIX + name.upper()):
            raw = environ.get(var, "")
            if raw != "":
                try:
                    values[name] = int(raw)
                except ValueError:
                    raise ValueError(f"environment variable {var}={raw!r} is not an integer") from None
                break
    for name in ("cp_backend", "sp_backend"):
        if name in unset and environ.get(ACCELERATE_ENV_PREFIX + name.upper()):
            values[name] = environ[ACCELERATE_ENV_PREFIX + name.upper()]
    if "cp_handler" in unset:
        values["cp_handler"] = TorchContextParallelConfig(cp_comm_strategy=strategy_from_env(environ))
    return values


@dataclass
class ParallelismConfig:
    """Sizes of each parallelism; their product must equal the world size.

    Mesh axes, outermost first: pp, dp_replicate, dp_shard, cp, sp, tp.
    - dp_replicate_size: replicas that each hold full (or HSDP-sharded) parameters (DDP / the replicate
      dimension of HSDP).
    - dp_shard_size: ranks across which FSDP2 shards parameters and which see different samples.
    - cp_size / sp_size: context parallel (ring / all-gather attention) and Ulysses sequence parallel.
    - tp_size: tensor parallel.
    - cp_backend: "torch" (Accelerate's only value; context parallelism is ndparallel's own either way).
    - sp_backend: "ndparallel" (default: Ulysses built in) or Accelerate's "deepspeed", refused when sp_size > 1;
      sp_handler (Accelerate's DeepSpeed settings) likewise.
    - tp_handler / cp_handler: `TorchTensorParallelConfig` / `TorchContextParallelConfig`.
    - pp_size: pipeline stages (ndparallel's; Accelerate has no pipeline axis); pp_handler: a
      `PipelineParallelConfig` (schedule, micro-batches, split).
    - ep_size: expert parallelism (ndparallel's): the experts of a mixture-of-experts model are split over ep ranks,
      which exchange tokens all-to-all (`ndparallel.parallel.experts`). Not an axis of its own: ep ranks are taken
      from dp_shard x cp x sp (innermost first), which ep_size must divide, so it does not change the world size.
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: TorchTensorParallelConfig | None = None
    cp_handler: TorchContextParallelConfig | None = None
    sp_handler: Any = None
    pp_size: int | None = None
    pp_handler: PipelineParallelConfig | None = None
    ep_size: int | None = None
    # Fields left unset (None): sizes 1 and default handlers, or what `from_env` reads for them.
    unset: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)

    device_mesh = None  # Accelerate's: the world DeviceMesh, once built (`get_device_mesh`, or by the Accelerator)

    def __post_init__(self) -> None:
        self.unset = frozenset(name for name in ENV_FIELDS if getattr(self, name) is None)
        self._apply_env(os.environ)

    def _apply_env(self, environ: Mapping[str, str]) -> None:
        """Fill the fields the caller left unset from `environ` (`_env_values`), then validate every field."""
        for name, value in _env_values(self.unset, environ).items():
            setattr(self, name, value)
        if "sp_backend" in self.unset and self.sp_size in (None, 1):
            self.sp_backend = None  # Accelerate exports its default "deepspeed" even without sp
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            setattr(self, name, _check_size(name, 1 if value is None else value))
        if self.ep_size == -1:
            raise ValueError("ep_size must be >= 1: the expert-parallel ranks are carved out of dp_shard x cp x sp, "
                             "so -1 ('the ranks that are left') has no meaning for it; give the number of ranks "
                             "the experts are split over")
        unknown = [name for name in AXIS_FIELDS if getattr(self, name) == -1]
        if len(unknown) > 1:
            raise ValueError(
                f"at most one size may be -1 ('the ranks that are left'); got -1 for {', '.join(unknown)}"
            )
        if self.tp_handler is not None and not isinstance(self.tp_handler, TorchTensorParallelConfig):
            raise TypeError(f"tp_handler must be a TorchTensorParallelConfig, got {type(self.tp_handler).__name__}")
        if self.cp_handler is not None and not isinstance(self.cp_handler, TorchContextParallelConfig):
            raise TypeError(f"cp_handler must be a TorchContextParallelConfig, got {type(self.cp_handler).__name__}")
        if self.pp_handler is not None and not isinstance(self.pp_handler, PipelineParallelConfig):
            raise TypeError(f"pp_handler must be a PipelineParallelConfig, got {type(self.pp_handler).__name__}")
        if self.pp_handler is None:
            self.pp_handler = PipelineParallelConfig()
        if self.tp_handler is None:
            self.tp_handler = TorchTensorParallelConfig()
        if self.cp_handler is None:
            self.cp_handler = TorchContextParallelConfig()
        self.cp_backend = self.cp_backend or "torch"
        if self.cp_backend not in CP_BACKENDS:
            raise ValueError(f"cp_backend must be one of {list(CP_BACKENDS)}, got {self.cp_backend!r}")
        self.sp_backend = self.sp_backend or "ndparallel"
        if self.sp_backend not in SP_BACKENDS:
            raise ValueError(f"sp_backend must be one of {list(SP_BACKENDS)}, got {self.sp_backend!r}")
        if self.sp_size != 1 and (self.sp_backend == "deepspeed" or self.sp_handler is not None):
            raise ValueError(
                f"sp_size={self.sp_size} with sp_backend={self.sp_backend!r}"
                f"{' and an sp_handler' if self.sp_handler is not None else ''}: ndparallel runs Ulysses sequence "
                "parallelism itself, without DeepSpeed; drop sp_backend and sp_handler (it composes with FSDP2, TP "
                "and CP)"
            )

    @classmethod
    def from_env(cls, config: ParallelismConfig | None = None,
                 environ: Mapping[str, str] | None = None) -> ParallelismConfig:
        """A copy of `config` (default: every field unset) whose unset fields are read from `environ` (default:
        ``os.environ``) rather than from the environment the config was built in: each size from
        ``NDPARALLEL_<FIELD>`` (`size_env_var`, which ``ndparallel launch`` sets), else Accelerate's
        ``PARALLELISM_CONFIG_<FIELD>`` (which ``accelerate launch`` sets), else 1; ``PARALLELISM_CONFIG_CP_BACKEND``
        / ``_SP_BACKEND`` / ``_CP_COMM_STRATEGY`` fill the backends and the context-parallel strategy likewise."""
        if config is None:
            config = cls(**dict.fromkeys(SIZE_FIELDS, 1), cp_backend="torch", sp_backend="ndparallel",
                         cp_handler=TorchContextParallelConfig(cp_comm_strategy="allgather"))
            config.unset = frozenset(ENV_FIELDS)
        out = copy.copy(config)
        for name in config.unset:  # unset again, then read from `environ`
            setattr(out, name, None)
        out._apply_env(os.environ if environ is None else environ)
        return out

    # ---- sizes --------------------------------------------------------------------------------------
    def sizes(self) -> dict[str, int]:
        """Axis name -> size, outermost first (may contain one -1 before `resolve`)."""
        return {axis: getattr(self, f"{axis}_size") for axis in AXES}

    def layout(self) -> Layout:
        """The sizes as a `ndparallel.layout.Layout`, which every view's size comes from (a -1 stays -1)."""
        return Layout(**{axis: getattr(self, f"{axis}_size") for axis in AXES}, ep=self.ep_size)

    @property
    def ep_enabled(self) -> bool:
        return self.ep_size != 1

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
        resolved._check_expert_parallel()
        return resolved

    def _check_expert_parallel(self) -> None:
        """ep_size must divide the ranks it is taken from (dp_shard x cp x sp), with every size resolved."""
        taken_from = self.layout().size("fsdp")
        if taken_from % self.ep_size:
            divisors = [d for d in range(1, taken_from + 1) if taken_from % d == 0]
            raise ValueError(
                f"ep_size={self.ep_size} must divide the ranks the experts are split over, dp_shard("
                f"{self.dp_shard_size}) * cp({self.cp_size}) * sp({self.sp_size}) = {taken_from} (the ranks that hold "
                f"different tokens; dp_replicate and tp ranks hold copies); use ep_size in {divisors}, or more "
                "dp_shard ranks")

    @property
    def total_size(self) -> int:
        if any(s == -1 for s in self.sizes().values()):
            raise ValueError("total_size is unknown until a -1 size is resolved against the world size")
        return self.layout().world

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different samples: dp_replicate * dp_shard (the ``batch`` view)."""
        return self.layout().size("batch")

    @property
    def non_data_parallel_size(self) -> int:
        return self.cp_size * self.sp_size * self.tp_size

    pp_enabled = property(lambda self: self.pp_size != 1)
    dp_replicate_enabled = property(lambda self: self.dp_replicate_size != 1)
    dp_shard_enabled = property(lambda self: self.dp_shard_size != 1)
    tp_enabled = property(lambda self: self.tp_size != 1)
    cp_enabled = property(lambda self: self.cp_size != 1)
    sp_enabled = property(lambda self: self.sp_size != 1)

    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate_enabled or self.dp_shard_enabled

    # ---- Accelerate's dimension names (enabled dimensions only) ----------------------------------------------
    def _enabled(self, *axes: str) -> list[str]:
        return [axis for axis in axes if getattr(self, f"{axis}_size") != 1]

    @property
    def dp_dim_names(self) -> list[str]:
        """Enabled dimensions across which data parallelism is applied (different samples)."""
        return self._enabled(*VIEWS["dp"])

    @property
    def non_dp_dim_names(self) -> list[str]:
        """Enabled dimensions whose ranks receive the same samples."""
        return self._enabled("tp", "cp", "sp")

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """Enabled dimensions of Accelerate's ``dp_shard_cp`` view."""
        return self._enabled(*VIEWS["dp_shard_cp"])

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """Enabled dimensions of Accelerate's ``dp_cp`` view."""
        return self._enabled(*VIEWS["dp_cp"])

    @property
    def fsdp_dim_names(self) -> list[str]:
        """Accelerate's dimensions of the FSDP mesh: ``dp_replicate`` (when enabled), then ``dp_shard_cp``. (ndparallel
        shards over dp_shard x cp x sp: the mesh's ``fsdp`` view.)"""
        return self._enabled("dp_replicate") + ["dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        """Names of all enabled dimensions (Accelerate's order: data-parallel ones, then tp, cp, sp)."""
        return self.dp_dim_names + self.non_dp_dim_names

    def _get_mesh(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(names, sizes) of the enabled dimensions in mesh order, as ``init_device_mesh`` takes them."""
        enabled = [axis for axis in AXES if getattr(self, f"{axis}_size") != 1]
        return tuple(enabled), tuple(getattr(self, f"{axis}_size") for axis in enabled)

    def build_device_mesh(self, device_type: str) -> DeviceMesh | None:
        """Accelerate's: ``init_device_mesh`` over the enabled dimensions (`_get_mesh`; it starts torch.distributed
        from the launcher's variables if nothing has yet), with ``dp``, ``dp_shard_cp`` and ``dp_cp`` flattened where
        their dimensions are enabled. None when every size is 1. (The Accelerator builds its own mesh, with
        ndparallel's views too: `ndparallel.mesh.ParallelMesh`, ``accelerator.mesh``.)"""
        from torch.distributed import device_mesh as torch_device_mesh  # looked up at call time, as Accelerate's

        if any(size == -1 for size in self.sizes().values()):
            raise ValueError(f"build_device_mesh: a size is -1 ({self.formula()}); resolve it against the world size "
                             "first (ParallelismConfig.resolve(world_size))")
        names, shape = self._get_mesh()
        if not names:
            return None
        mesh = torch_device_mesh.init_device_mesh(device_type, shape, mesh_dim_names=names)
        for flat, dims in (("dp", self.dp_dim_names), ("dp_shard_cp", self.dp_shard_cp_dim_names),
                           ("dp_cp", self.dp_cp_dim_names)):
            if dims:
                mesh[dims]._flatten(flat)
        return mesh

    def get_device_mesh(self, device_type: str | None = None) -> DeviceMesh:
        """The mesh built for this config (by the Accelerator, or by `build_device_mesh` on first call)."""
        if self.device_mesh is None:
            if device_type is None:
                raise ValueError("get_device_mesh() needs a device_type (e.g. 'cuda' or 'cpu') to build the mesh")
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ValueError(f"the device mesh was built for {self.device_mesh.device_type!r}, not {device_type!r}")
        return self.device_mesh

    # ---- serialisation ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        # ep_size only when used (a file without it stays readable by older versions), as pp_handler below
        out: dict[str, Any] = {name: getattr(self, name) for name in SIZE_FIELDS if name != "ep_size" or self.ep_size != 1}
        out["tp_handler"] = dataclasses.asdict(self.tp_handler)
        out["cp_handler"] = dataclasses.asdict(self.cp_handler)
        if self.pp_size != 1 or self.pp_handler != PipelineParallelConfig():
            # A loss function is code, not data: it is not written (the script passes it)
            out["pp_handler"] = {f.name: getattr(self.pp_handler, f.name) for f in dataclasses.fields(
                self.pp_handler) if f.name != "loss_fn"}
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelismConfig:
        if not isinstance(data, dict):
            raise TypeError(f"a parallelism config must be a mapping, got {type(data).__name__}")
        allowed = set(SIZE_FIELDS) | {"tp_handler", "cp_handler", "pp_handler", "cp_backend", "sp_backend"}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(f"unknown parallelism config key(s) {unknown}; valid keys: {sorted(allowed)}")
        kwargs = dict(data)
        if isinstance(kwargs.get("tp_handler"), dict):
            kwargs["tp_handler"] = TorchTensorParallelConfig(**kwargs["tp_handler"])
        if isinstance(kwargs.get("cp_handler"), dict):
            kwargs["cp_handler"] = TorchContextParallelConfig(**kwargs["cp_handler"])
        if isinstance(kwargs.get("pp_handler"), dict):
            kwargs["pp_handler"] = PipelineParallelConfig(**kwargs["pp_handler"])
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
        """Environment variables that make ``ParallelismConfig.from_env()`` in a launched script equal this one."""
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


__all__ = [
    "AXES",
    "ParallelismConfig",
    "PipelineParallelConfig",
    "TorchContextParallelConfig",
    "TorchTensorParallelConfig",
]
