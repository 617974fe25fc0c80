"""The one world `DeviceMesh` and the named views derived from it.

Axes, outermost first: ``dp_replicate, dp_shard, cp, sp, tp`` (all five are always present; size-1 axes cost
nothing). Code asks the mesh for a group *by purpose*, never by rank arithmetic:

- ``batch`` = dp_replicate x dp_shard: ranks that receive different samples;
- ``fsdp``  = dp_shard x cp x sp: ranks across which FSDP2 shards parameters (CP/SP ranks work on other
  tokens of the same samples, so their gradients are reduced anyway and sharding across them is free);
- ``loss``  = dp_replicate x dp_shard x cp x sp: ranks whose token losses add up to the global loss, and the
  ranks over which the data-parallel wrapper averages gradients;
- the single axes ``dp_replicate``, ``dp_shard``, ``cp``, ``sp``, ``tp``;
- Accelerate's flattened names, kept for compatibility: ``dp`` (= batch), ``dp_shard_cp``, ``dp_cp``.
"""

from __future__ import annotations

import warnings

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import AXES, ParallelismConfig

# Flattened views: name -> the axes they span (contiguous, outermost first).
VIEWS: dict[str, tuple[str, ...]] = {
    "batch": ("dp_replicate", "dp_shard"),
    "fsdp": ("dp_shard", "cp", "sp"),
    "loss": ("dp_replicate", "dp_shard", "cp", "sp"),
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


class ParallelMesh:
    """The world mesh of a resolved `ParallelismConfig` plus its named views.

    ``mesh["fsdp"]`` returns the 1-D `DeviceMesh` of that view that contains this rank; ``mesh.size(name)``
    and ``mesh.rank(name)`` give its size and this rank's coordinate in it.
    """

    def __init__(self, config: ParallelismConfig, device_type: str) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialised before building the mesh")
        config = config.resolve(dist.get_world_size())
        self.config = config
        self.device_type = device_type
        shape = tuple(config.sizes()[axis] for axis in AXES)
        self.world: DeviceMesh = init_device_mesh(device_type, shape, mesh_dim_names=AXES)
        self._views: dict[str, DeviceMesh] = {axis: self.world[axis] for axis in AXES}
        for name, axes in VIEWS.items():
            self._views[name] = self.world[axes]._flatten(name)
        # Creating a gloo group is not a synchronisation point: a rank that raced ahead and exited (say, on a
        # bad-input error raised right after) would reset connections other ranks are still opening.
        if dist.get_world_size() > 1 and dist.get_backend() != "fake":
            dist.barrier()

    @property
    def names(self) -> list[str]:
        return list(self._views)

    def __getitem__(self, name: str) -> DeviceMesh:
        try:
            return self._views[name]
        except KeyError:
            raise KeyError(f"no mesh view named {name!r}; valid names: {', '.join(self._views)}") from None

    def size(self, name: str) -> int:
        return self[name].size()

    def rank(self, name: str) -> int:
        """This rank's coordinate along view `name` (0 .. size-1)."""
        return self[name].get_local_rank()

    def group(self, name: str) -> dist.ProcessGroup:
        return self[name].get_group()

    def ranks(self, name: str) -> list[int]:
        """Global ranks of the view group that contains this rank, in view order."""
        return self[name].mesh.flatten().tolist()

    def hsdp(self) -> DeviceMesh:
        """2-D (dp_replicate, fsdp) mesh for HSDP: replicate outside, shard inside."""
        if hasattr(DeviceMesh, "_concatenate"):
            return DeviceMesh._concatenate([self._views["dp_replicate"], self._views["fsdp"]])
        with warnings.catch_warnings():  # older torch: slicing a flattened dim from the root mesh
            warnings.simplefilter("ignore")
            return self.world["dp_replicate", "fsdp"]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{axis}={self.config.sizes()[axis]}" for axis in AXES)
        return f"ParallelMesh({sizes}, device_type={self.device_type!r})"
