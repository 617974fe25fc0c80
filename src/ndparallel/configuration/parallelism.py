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
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..distributed.layout import AXES, SAME_SAMPLES, VIEWS, Layout  # the axes and the views: declared once, there
from .environment import ACCELERATE_ENV_PREFIX, load_yaml, size_env_var
from .handlers import PipelineParallelConfig, TorchContextParallelConfig, TorchTensorParallelConfig, strategy_from_env


AXIS_FIELDS: tuple[str, ...] = tuple(f"{axis}_size" for axis in AXES)  # their product is the world size

# Every size a config, a flag, a file or a variable sets. ep_size is no axis: the expert-parallel ranks are carved out
# of the ranks that already hold different tokens (dp_shard x cp x sp), so it does not multiply the world size.
SIZE_FIELDS: tuple[str, ...] = (*AXIS_FIELDS, "ep_size")


def _check_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (>= 1, or -1 for 'the ranks that are left'), got {value!r}")
    if value == 0 or value < -1:
        raise ValueError(f"{name} must be >= 1, or -1 for 'the ranks that are left'; got {value}")
    return value


CP_BACKENDS = ("torch",)  # Accelerate's name for torch-native context parallelism: here, ndparallel's own

SP_BACKENDS = ("ndparallel", "deepspeed")  # "deepspeed": Accelerate's default, refused when sp_size > 1

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

    Mesh axes, outermost first: pp, dp_replicate, dp_shard, cp, sp, tp. Fields left None mean sizes of 1 and the
    default handlers, or what the environment sets for them (``NDPARALLEL_<FIELD>``, then Accelerate's
    ``PARALLELISM_CONFIG_<FIELD>``; `from_env`).

    Attributes:
        dp_replicate_size: replicas that each hold full (or HSDP-sharded) parameters (DDP / the replicate
            dimension of HSDP).
        dp_shard_size: ranks across which FSDP2 shards parameters and which see different samples.
        tp_size: tensor parallel.
        cp_size: context parallel (ring / all-gather attention).
        cp_backend: "torch" (Accelerate's only value; context parallelism is ndparallel's own either way).
        sp_size: Ulysses sequence parallel.
        sp_backend: "ndparallel" (default: Ulysses built in) or Accelerate's "deepspeed", refused when sp_size > 1.
        tp_handler: a `TorchTensorParallelConfig`.
        cp_handler: a `TorchContextParallelConfig`.
        sp_handler: Accelerate's DeepSpeed settings; refused when sp_size > 1.
        pp_size: pipeline stages (ndparallel's; Accelerate has no pipeline axis).
        pp_handler: a `PipelineParallelConfig` (schedule, micro-batches, split).
        ep_size: expert parallelism (ndparallel's): the experts of a mixture-of-experts model are split over ep
            ranks, which exchange tokens all-to-all (`ndparallel.parallel.experts`). Not an axis of its own: ep ranks
            are taken from dp_shard x cp x sp (innermost first), which ep_size must divide, so it does not change the
            world size.
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
        """The sizes as a `ndparallel.distributed.layout.Layout`, which every view's size comes from (a -1 stays -1)."""
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
        return self.layout().same_samples

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
        return self._enabled(*SAME_SAMPLES)

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
        ndparallel's views too: `ndparallel.distributed.mesh.ParallelMesh`, ``accelerator.mesh``.)"""
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

    def to_json(self) -> dict[str, Any]:
        """As Accelerate 1.16's: a dict of plain values that ``json.dumps`` takes (Accelerate 1.15's returned None,
        ndparallel's before 1.16 a JSON string): `to_dict`'s sizes and handlers, with ``cp_backend`` and
        ``sp_backend``; `from_dict` rebuilds the config from it."""
        return {**self.to_dict(), "cp_backend": self.cp_backend, "sp_backend": self.sp_backend}

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
