"""The one world `DeviceMesh` and the process groups of the views `ndparallel.distributed.layout` declares.

Code asks the mesh for a group *by purpose* (``batch``, ``fsdp``, ``loss``, ``ep``, a single axis...: the views and
what each is for are declared in `ndparallel.distributed.layout`), never by rank arithmetic. Every view but ``pp`` lies
inside one pipeline stage: its group holds the ranks of this rank's stage only.

Process groups exist only where they are needed. The world mesh has a dimension for each axis of more than one
rank (as Accelerate's has); a view spanning one such axis *is* that axis's group; a view spanning several is
flattened once, under the first name that spans them (``loss`` and ``dp_cp`` share a group when cp is 1). Every
other name of a view of more than one rank is registered in the world mesh as an alias of that group (no new group),
so ``world["dp_cp"]`` works wherever Accelerate's mesh has it. A view of one rank has no group: `size` and `rank`
answer 1 and 0 without one, and asking for its group raises. (One process
keeps all six axes: there every group is the default one and costs nothing.) The one exception: when FSDP2 will wrap
models but shards over one rank (replication only, as under DDP x TP), ``dp_shard`` keeps its dimension so that
`data_parallel` can give FSDP2 a mesh on the same root as the tensor-parallel one.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .layout import EXPERT_VIEWS, VIEWS, Layout, view_axes

if TYPE_CHECKING:
    from ..configuration.parallelism import ParallelismConfig

class ParallelMesh:
    """The world mesh of a resolved `ParallelismConfig` plus its named views.

    ``mesh.size(name)`` and ``mesh.rank(name)`` give a view's size and this rank's coordinate in it;
    ``mesh[name]`` / ``mesh.group(name)`` its 1-D `DeviceMesh` / process group (views of more than one rank only).
    """

    def __init__(self, config: ParallelismConfig, device_type: str, fsdp: bool = False) -> None:
        """`fsdp`: FSDP2 will wrap models over `data_parallel()` (``ndparallel.parallel.uses_fsdp``)."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialised before building the mesh")
        world_size = dist.get_world_size()
        config = config.resolve(world_size)
        self.config = config
        self.device_type = device_type
        self.layout: Layout = config.layout()  # every view's size (`ndparallel.distributed.layout`)
        self._sizes = self.layout.sizes()  # every axis, outermost first
        axes = tuple(self._sizes)
        self._axes: dict[str, tuple[str, ...]] = {**{axis: (axis,) for axis in axes}, **VIEWS}
        dims = tuple(axis for axis in axes if self._sizes[axis] > 1) or axes
        replicate_only = fsdp and world_size > 1 and self.size("fsdp") == 1
        if replicate_only:  # FSDP2 needs a (one-rank) fsdp dimension of this mesh, for HSDP or beside tp
            dims = tuple(a for a in axes if a in dims or a == "dp_shard")
        self.world: DeviceMesh = init_device_mesh(device_type, tuple(self._sizes[a] for a in dims), mesh_dim_names=dims)
        self._views: dict[str, DeviceMesh | None] = {}
        by_axes: dict[tuple[str, ...], DeviceMesh] = {}
        for name, axes in self._axes.items():
            live = tuple(a for a in axes if self._sizes[a] > 1 or world_size == 1)
            if not live:
                self._views[name] = None
                continue
            if live not in by_axes:
                by_axes[live] = self.world[live[0]] if len(live) == 1 else self.world[live]._flatten(name)
            elif name not in dims:
                _alias(self.world, name, by_axes[live])
            self._views[name] = by_axes[live]
        if replicate_only:
            self._views["fsdp"] = self.world["dp_shard"]
        self._expert_shard = self._carve_experts(config.ep_size)
        self._data_parallel: DeviceMesh | None = None
        self._expert_data_parallel: DeviceMesh | None = None
        self._stage: DeviceMesh | None = None
        # Creating a gloo group is not a synchronisation point: a rank that raced ahead and exited (say, on a
        # bad-input error raised right after) would reset connections other ranks are still opening.
        if world_size > 1 and dist.get_backend() != "fake":
            dist.barrier()

    def _carve_experts(self, ep: int) -> DeviceMesh | None:
        """The ``ep`` and ``expert_shard`` views (see the module docstring); returns the expert_shard dimension, kept
        even where it has one rank (FSDP2 wraps the experts over it), or None without expert parallelism."""
        if ep == 1:
            self._views["ep"], self._views["expert_shard"] = None, self._views["fsdp"]
            return None
        if not hasattr(DeviceMesh, "_unflatten"):
            import torch

            raise ValueError(f"ep_size={ep}: expert parallelism needs DeviceMesh._unflatten (it carves the ep ranks "
                             f"out of fsdp), which torch {torch.__version__} lacks; ndparallel needs torch >= 2.11")
        split = self._views["fsdp"]._unflatten(0, (self.size("expert_shard"), ep), ("expert_shard", "ep"))
        self._views["ep"] = split["ep"]
        self._views["expert_shard"] = split["expert_shard"] if self.size("expert_shard") > 1 else None
        return split["expert_shard"]

    @property
    def names(self) -> list[str]:
        return [*self._axes, *EXPERT_VIEWS]

    def _axes_of(self, name: str) -> tuple[str, ...]:
        return view_axes(name)  # raises KeyError naming the valid views

    def __getitem__(self, name: str) -> DeviceMesh:
        axes = self._axes_of(name)
        view = self._views[name]
        if view is None:
            sizes = (f"{name} of fsdp={self.size('fsdp')} with ep_size={self.config.ep_size}" if name in EXPERT_VIEWS
                     else ' x '.join(f'{a}_size={self._sizes[a]}' for a in axes))
            raise ValueError(
                f"mesh view {name!r} ({sizes}) holds this rank alone and has no process group; check "
                f"mesh.size({name!r}) > 1 before asking for it"
            )
        return view

    def size(self, name: str) -> int:
        return self.layout.size(name)

    def rank(self, name: str) -> int:
        """This rank's coordinate along view `name` (0 .. size-1)."""
        self._axes_of(name)
        view = self._views[name]
        return 0 if view is None else view.get_local_rank()

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group of view `name` (a view of more than one rank)."""
        return self[name].get_group()

    def ranks(self, name: str) -> list[int]:
        """Global ranks of the view group that contains this rank, in view order."""
        self._axes_of(name)
        view = self._views[name]
        return [dist.get_rank()] if view is None else view.mesh.flatten().tolist()

    def within_stage(self) -> DeviceMesh | None:
        """Every rank of this rank's pipeline stage (all axes but ``pp``) as one 1-D mesh; None when the stage is this
        rank alone. Built on first use (pipeline layouts only)."""
        dims = tuple(a for a in (self.world.mesh_dim_names or ()) if a != "pp" and self._sizes[a] > 1)
        if not dims:
            return None
        if len(dims) == 1:
            return self.world[dims[0]]
        if self._stage is None:
            self._stage = self.world[dims]._flatten("stage")
        return self._stage

    def data_parallel(self) -> DeviceMesh:
        """The mesh FSDP2 wraps over: 2-D (dp_replicate, fsdp) for HSDP when dp_replicate > 1 (replicate outside,
        shard inside), else the 1-D ``fsdp`` view. Needs the mesh built with ``fsdp=True`` where fsdp has one rank."""
        if self._data_parallel is None:
            if self._views["fsdp"] is None:
                raise ValueError("FSDP2 over a one-rank fsdp view needs the mesh built with "
                                 "ParallelMesh(..., fsdp=True)")
            self._data_parallel = self._over(self.layout.data_parallel_views(), self._views["fsdp"])
        return self._data_parallel

    def expert_data_parallel(self) -> DeviceMesh:
        """The mesh FSDP2 wraps the experts over under expert parallelism: (dp_replicate, expert_shard) when
        dp_replicate > 1, else ``expert_shard`` -- a one-rank dimension where ep takes all of fsdp (FSDP2 then only
        manages the experts' gradients and mixed precision)."""
        if self._expert_shard is None:
            raise ValueError("expert_data_parallel(): no expert parallelism on this mesh (ep_size=1)")
        if self._expert_data_parallel is None:
            self._expert_data_parallel = self._over(self.layout.data_parallel_views(experts=True), self._expert_shard)
        return self._expert_data_parallel

    def _over(self, views: tuple[str, ...], inner: DeviceMesh) -> DeviceMesh:
        """The mesh over `views` (`Layout.data_parallel_views`, outermost first), the last one given as `inner` (a
        dimension kept where it has one rank): the views concatenated, or `inner` alone."""
        meshes = [*(self._views[name] for name in views[:-1]), inner]
        return meshes[0] if len(meshes) == 1 else self._concatenate_meshes(meshes)

    def _concatenate_meshes(self, views: list[DeviceMesh]) -> DeviceMesh:
        if hasattr(DeviceMesh, "_concatenate"):
            return DeviceMesh._concatenate(views)
        with warnings.catch_warnings():  # older torch: slicing (flattened) dimensions from the root mesh
            warnings.simplefilter("ignore")
            return self.world[tuple(v.mesh_dim_names[0] for v in views)]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{axis}={size}" for axis, size in self._sizes.items())
        experts = f", ep={self.config.ep_size}" if self.config.ep_size > 1 else ""
        return f"ParallelMesh({sizes}{experts}, device_type={self.device_type!r})"


def _alias(root: DeviceMesh, name: str, view: DeviceMesh) -> None:
    """Make ``root[name]`` the 1-D `view` under another name, sharing its process group (no new group is made)."""
    if name == view.mesh_dim_names[0] or name in (root.mesh_dim_names or ()):
        return
    try:  # torch >= 2.9: a DeviceMesh is a layout over the root's ranks, as `DeviceMesh._concatenate` builds them
        alias = DeviceMesh(root.device_type, _layout=view._layout, _rank_map=root._rank_map, mesh_dim_names=(name,),
                           _root_mesh=root, _init_backend=False)
        alias._dim_group_names = view._dim_group_names
        root._flatten_mapping[name] = alias
    except (AttributeError, TypeError):  # older torch: a flattened dimension of its own (one more group)
        view._flatten(name)
