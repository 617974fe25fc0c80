"""Hardware profiles: what one GPU can compute, hold and send, as data (``data/hardware.json``).

A profile is a JSON object of the fields of `Hardware`. The built-in ones ship with the package; ``--hardware FILE``
reads a user's own: either one profile (an object with the fields below, plus ``"name"``) or a file in the built-in
format (``{"profiles": {name: profile, ...}}``), whose profiles are then looked up by ``--gpu`` like the built-in
ones. Bandwidths are bytes per second that one GPU *sends* during a collective (what the ring formulas of
`ndparallel.planner.comm` count); the last three fields are the model's free constants (docs/planner.md).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

GiB = 2**30


@dataclass(frozen=True)
class Hardware:
    """One GPU model and the node it sits in."""

    name: str
    peak_bf16_flops: float  # dense, per GPU
    peak_fp32_flops: float  # what fp32 matmuls reach without TF32 (torch's default matmul precision)
    memory_gib: float  # what the GPU reports as its total memory
    hbm_bandwidth: float  # bytes/s; the optimizer step is bound by it
    intra_node_bandwidth: float  # bytes/s one GPU sends in a collective among GPUs of its node
    inter_node_bandwidth: float  # bytes/s one GPU sends in a collective whose group spans nodes
    gpus_per_node: int = 8
    intra_node_latency_s: float = 10e-6  # per collective call
    inter_node_latency_s: float = 25e-6
    compute_efficiency: float = 0.5  # free constant: achieved fraction of peak on the step's FLOPs
    overlap: float = 0.9  # free constant: fraction of compute time that can hide data-parallel communication
    memory_reserve_gib: float = 3.0  # free constant: what lives outside torch's allocator (CUDA context, NCCL)
    fragmentation: float = 0.0  # free constant: the caching allocator's reserve beyond the step's tensors (memory.py)
    host_bandwidth: float = 25e9  # bytes/s one GPU moves to or from host memory (activation offloading); assumption
    # FSDP2's CPU offload (`planner.offload`): the node's host memory (0: unknown, not checked), what each training
    # process holds there besides the offloaded tensors, and the memory traffic torch's AdamW reaches on the host
    # per GPU (28 B per parameter, as on the GPU); assumptions, docs/planner.md.
    host_memory_gib: float = 0.0
    host_reserve_gib: float = 8.0
    host_optimizer_bandwidth: float = 6e9
    description: str = ""
    aliases: tuple[str, ...] = field(default=())

    def peak_flops(self, mixed_precision: str) -> float:
        return self.peak_bf16_flops if mixed_precision == "bf16" else self.peak_fp32_flops

    def host_budget_bytes(self, host_memory_gib: float | None, gpus_per_node: int) -> float | None:
        """Host memory one GPU's process may offload to: the node's (`host_memory_gib`, default the profile's) split
        evenly over its GPUs, less the process's own reserve; None where the node's memory is unknown."""
        node = self.host_memory_gib if host_memory_gib is None else host_memory_gib
        return (node / gpus_per_node - self.host_reserve_gib) * GiB if node else None

    @property
    def usable_bytes(self) -> float:
        return (self.memory_gib - self.memory_reserve_gib) * GiB


REQUIRED = tuple(f.name for f in dataclasses.fields(Hardware)
                 if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name != "name")
_FIELDS = {f.name for f in dataclasses.fields(Hardware)}


def _profile(name: str, data: Any, source: str) -> Hardware:
    if not isinstance(data, dict):
        raise ValueError(f"{source}: profile {name!r} must be a JSON object, got {type(data).__name__}")
    missing = [key for key in REQUIRED if key not in data]
    if missing:
        raise ValueError(f"{source}: profile {name!r} lacks {', '.join(missing)} (a profile needs "
                         f"{', '.join(REQUIRED)}; optional: {', '.join(sorted(_FIELDS - set(REQUIRED) - {'name'}))})")
    unknown = sorted(set(data) - _FIELDS - {"name"})
    if unknown:
        raise ValueError(f"{source}: profile {name!r} has unknown field(s) {unknown}; known: {sorted(_FIELDS)}")
    values = {key: value for key, value in data.items() if key != "name"}
    values["aliases"] = tuple(values.get("aliases", ()))
    for key, value in values.items():
        if key not in ("description", "aliases") and (isinstance(value, bool) or not isinstance(value, (int, float))
                                                      or value < 0):
            raise ValueError(f"{source}: profile {name!r}: {key} must be a non-negative number, got {value!r}")
    hw = Hardware(name=name, **values)
    if hw.gpus_per_node < 1 or int(hw.gpus_per_node) != hw.gpus_per_node:
        raise ValueError(f"{source}: profile {name!r}: gpus_per_node must be a positive integer")
    if not 0 < hw.compute_efficiency <= 1 or not 0 <= hw.overlap <= 1:
        raise ValueError(f"{source}: profile {name!r}: compute_efficiency must be in (0, 1] and overlap in [0, 1]")
    return dataclasses.replace(hw, gpus_per_node=int(hw.gpus_per_node))


def _profiles(data: Any, source: str) -> dict[str, Hardware]:
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
    if "profiles" in data:
        if not isinstance(data["profiles"], dict):
            raise ValueError(f"{source}: 'profiles' must map names to profiles")
        return {name.lower(): _profile(name.lower(), p, source) for name, p in data["profiles"].items()}
    name = str(data.get("name") or Path(source).stem).lower()
    return {name: _profile(name, data, source)}


def builtin_profiles() -> dict[str, Hardware]:
    text = resources.files("ndparallel.planner").joinpath("data/hardware.json").read_text()
    return _profiles(json.loads(text), "ndparallel/planner/data/hardware.json")


def read_profiles(path: str | Path) -> dict[str, Hardware]:
    """The profiles of a user's ``--hardware`` file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"hardware file {str(p)!r} does not exist")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"hardware file {str(p)!r} is not valid JSON: {exc}") from None
    return _profiles(data, str(p))


def known_names(profiles: dict[str, Hardware]) -> list[str]:
    return sorted(profiles)


def get_hardware(gpu: str | None, hardware_file: str | Path | None = None) -> Hardware:
    """The profile named `gpu` (or an alias), from `hardware_file` first, then the built-in ones. With a file of one
    profile and no `gpu`, that profile."""
    own = read_profiles(hardware_file) if hardware_file is not None else {}
    if gpu is None:
        if len(own) == 1:
            return next(iter(own.values()))
        raise ValueError(f"name a GPU with --gpu; known: {', '.join(known_names({**builtin_profiles(), **own}))}")
    profiles = {**builtin_profiles(), **own}
    key = gpu.lower()
    for name, hw in profiles.items():
        if key == name or key in hw.aliases:
            return hw
    aliases = sorted(a for hw in profiles.values() for a in hw.aliases)
    raise ValueError(f"unknown GPU {gpu!r}; known: {', '.join(known_names(profiles))} (aliases: {', '.join(aliases)}); "
                     "describe another one in a JSON file and pass it with --hardware FILE (fields: "
                     f"{', '.join(REQUIRED)})")
