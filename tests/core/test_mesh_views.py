"""Tier 1 (no processes): the mesh's named views for every shape up to 16 ranks.

The mesh is built once per (shape, rank) inside this one process on torch's *fake* process group, which
answers as if it were rank r of n without talking to anyone. The expected groups are computed here from first
principles (row-major coordinates, itertools), never by asking the code under test.

torch 2.13 notes: `destroy_process_group()` followed by a fresh `init_process_group("fake", ...)` works any
number of times, and there is no global mesh cache to clear: the old `_mesh_resources` child->root and
flatten maps are gone (`_mesh_resources` only keeps the `with mesh:` stack), and flattened meshes are cached
on their own root mesh, which is rebuilt every time.

Every rank of every shape is checked (3,826 builds, ~15 s on 2 cores), with pp 1; shapes with pipeline stages (pp
outermost, every other view inside one stage) up to 8 ranks.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from ndparallel.configuration.parallelism import ParallelismConfig
from ndparallel.distributed.layout import VIEWS, Layout
from ndparallel.distributed.mesh import ParallelMesh

# Mesh axes, outermost first (DESIGN.md), and what each flattened view spans, written out independently.
AXES = ("dp_replicate", "dp_shard", "cp", "sp", "tp")
EXPECTED_VIEWS = {
    "batch": ("dp_replicate", "dp_shard"),
    "fsdp": ("dp_shard", "cp", "sp"),
    "loss": ("dp_replicate", "dp_shard", "cp", "sp"),
    "dp": ("dp_replicate", "dp_shard"),  # Accelerate's names
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
ALL_VIEWS = {**{axis: (axis,) for axis in AXES}, **EXPECTED_VIEWS}
MAX_WORLD = 16


def shapes(n: int) -> list[tuple[int, ...]]:
    """Every assignment of sizes to the 5 axes whose product is n."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return [s for s in itertools.product(divisors, repeat=len(AXES)) if math.prod(s) == n]


SHAPES = [s for n in range(1, MAX_WORLD + 1) for s in shapes(n)]


def unravel(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major (C-order) coordinates of `rank`: the last axis varies fastest."""
    coords = []
    for size in reversed(shape):
        rank, c = divmod(rank, size)
        coords.append(c)
    return tuple(reversed(coords))


def ravel(coords: tuple[int, ...], shape: tuple[int, ...]) -> int:
    rank = 0
    for c, size in zip(coords, shape):
        rank = rank * size + c
    return rank


def expected_ranks(rank: int, shape: tuple[int, ...], axes: tuple[str, ...]) -> list[int]:
    """Ranks sharing `rank`'s coordinates on every axis outside `axes`, row-major over `axes`."""
    mine = unravel(rank, shape)
    idx = [AXES.index(a) for a in axes]
    out = []
    for sub in itertools.product(*(range(shape[i]) for i in idx)):  # row-major over the view's axes
        coords = list(mine)
        for i, c in zip(idx, sub):
            coords[i] = c
        out.append(ravel(tuple(coords), shape))
    return out


@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    assert not dist.is_initialized(), "a process group leaked from another test"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build(shape: tuple[int, ...], fsdp: bool = False) -> ParallelMesh:
    return ParallelMesh(ParallelismConfig(**{f"{a}_size": s for a, s in zip(AXES, shape)}), "cpu", fsdp=fsdp)


# ---- the independent helpers themselves -----------------------------------------------------------
def test_helpers():
    assert len(SHAPES) == 341  # sum over n <= 16 of the ordered factorisations of n into 5 factors
    assert shapes(8).count((2, 2, 1, 1, 2)) == 1
    assert [unravel(r, (2, 3)) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    # (dp_replicate=2, dp_shard=2, cp=1, sp=1, tp=2): rank 5 = (1, 0, 0, 0, 1)
    shape = (2, 2, 1, 1, 2)
    assert expected_ranks(5, shape, ("tp",)) == [4, 5]
    assert expected_ranks(5, shape, ("dp_shard",)) == [5, 7]
    assert expected_ranks(5, shape, ("dp_replicate", "dp_shard")) == [1, 3, 5, 7]
    assert expected_ranks(5, shape, AXES) == list(range(8))


def test_view_table_matches_design():
    assert dict(VIEWS) == EXPECTED_VIEWS


def test_no_module_restates_the_axes_or_a_view():
    """The axes and the views are written once, in ndparallel/distributed/layout.py: no other module of the package
    writes their tuple of axis names out again (it imports it)."""
    import ast
    from pathlib import Path

    import ndparallel.distributed.layout as layout

    declared = {tuple(layout.AXES), *VIEWS.values(), *layout.DATA_PARALLEL.values(), layout.SAME_SAMPLES}
    declared |= {views[1:] for views in layout.DATA_PARALLEL.values()}  # (fsdp,) alone is no restatement: one name
    declared = {d for d in declared if len(d) > 1}
    src = Path(layout.__file__).parent
    found = []
    for path in sorted(src.rglob("*.py")):
        if path.name == "layout.py" and path.parent == src:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List)) and all(isinstance(e, ast.Constant) for e in node.elts):
                if tuple(e.value for e in node.elts) in declared:
                    found.append(f"{path.relative_to(src)}:{node.lineno}")
    assert not found, f"axes or a view restated (import them from ndparallel.distributed.layout): {found}"


# Names a size of cp, sp or dp_shard goes by in the package (a variable, an attribute, a config field).
_CP, _SP, _DP_SHARD = {"cp", "cp_size"}, {"sp", "sp_size"}, {"dp_shard", "dp_shard_size"}
# Benchmarks that write the layout out on purpose, as an independent check of the library: the plain-PyTorch step
# (workloads.py's plain runner, plain_sequence.py's attention) and run.py's expected bytes.
_WRITTEN_OUT_ON_PURPOSE = {"workloads.py", "plain_sequence.py", "run.py"}


def _product_factors(node) -> list:
    import ast

    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _product_factors(node.left) + _product_factors(node.right)
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    return [node.value] if isinstance(node, ast.Constant) else [None]


def restates_a_mesh_fact(factors: list) -> bool:
    """A product that computes a view's size or the sequence divisor from the sizes: cp x sp (what holds different
    tokens of a sample; the sequence divisor 2 x cp x sp), dp_shard x cp (the fsdp size), 2 x cp (the load-balanced
    chunks)."""
    names = {f for f in factors if isinstance(f, str)}
    return bool(names & _CP) and bool(names & _SP or names & _DP_SHARD or 2 in factors)


def test_restatement_check_catches_planted_products():
    import ast

    def caught(code: str) -> bool:
        return any(restates_a_mesh_fact(_product_factors(node)) for node in ast.walk(ast.parse(code))
                   if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult))

    for planted in ("n = 2 * cp * sp", "n = config.dp_shard_size * config.cp_size * config.sp_size",
                    "n = 2 * self.cp_size", "n = layout.cp * layout.sp", "n = QUANTUM * 2 * layout.cp * layout.sp"):
        assert caught(planted), planted
    for fine in ("n = layout.sequence_divisor * QUANTUM", "n = 2 * tp", "n = cp + sp", "n = heads * tp"):
        assert not caught(fine), fine


def test_no_module_computes_a_mesh_fact():
    """The fsdp size (dp_shard x cp x sp), the sequence divisor (2 x cp x sp) and the load-balanced chunks (2 x cp)
    are computed in ndparallel/distributed/layout.py only (`Layout.fsdp`, `Layout.sequence_divisor`,
    `sequence_divisor`, `load_balanced_chunks`): no other module of the package, and no benchmark but the ones that
    write the layout out on purpose, multiplies those sizes again."""
    import ast
    from pathlib import Path

    import ndparallel.distributed.layout as layout

    src = Path(layout.__file__).parent.parent
    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    paths = [*sorted(src.rglob("*.py")), *(p for p in sorted(benchmarks.glob("*.py"))
                                           if p.name not in _WRITTEN_OUT_ON_PURPOSE)]
    found = set()
    for path in paths:
        if path == Path(layout.__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and restates_a_mesh_fact(
                    _product_factors(node)):
                found.add(f"{path.name}:{node.lineno}")
    assert not found, f"a mesh fact computed outside ndparallel/distributed/layout.py (ask Layout): {sorted(found)}"


# ---- every shape, every rank ----------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_views(shape):
    n = math.prod(shape)
    sizes = dict(zip(AXES, shape))
    fsdp_size = sizes["dp_shard"] * sizes["cp"] * sizes["sp"]
    for rank in range(n):
        with fake_world(rank, n):
            mesh = build(shape, fsdp=True)  # FSDP2 will wrap: the data-parallel mesh exists for every shape
            assert set(mesh.names) == set(ALL_VIEWS) | {"pp", "ep", "expert_shard"}
            assert mesh.config.sizes() == {"pp": 1, **sizes}
            for name, axes in ALL_VIEWS.items():
                want = expected_ranks(rank, shape, axes)
                where = f"view {name!r}, shape {shape}, rank {rank}"
                assert mesh.ranks(name) == want, where
                assert mesh.size(name) == len(want) == math.prod(sizes[a] for a in axes), where
                assert mesh.rank(name) == want.index(rank), where
                # the planner's groups (no mesh) come from the same declaration
                assert Layout(**sizes).group(name, rank) == sorted(want), where
            # The mesh FSDP2 wraps over: HSDP's (dp_replicate, fsdp) when there are replicas, else the fsdp view.
            dp = mesh.data_parallel()
            if sizes["dp_replicate"] > 1:
                assert tuple(dp.mesh.shape) == (sizes["dp_replicate"], fsdp_size)
                # rows: replicas; columns: the fsdp group; every rank with this rank's tp coordinate
                assert dp.mesh.flatten().tolist() == expected_ranks(rank, shape, AXES[:-1])
                assert dp.get_local_rank(0) == mesh.rank("dp_replicate")
                assert dp.get_local_rank(1) == mesh.rank("fsdp")
            else:
                assert dp.mesh.flatten().tolist() == expected_ranks(rank, shape, EXPECTED_VIEWS["fsdp"])
                assert dp.get_local_rank() == mesh.rank("fsdp")


# ---- pipeline stages: the pp axis, outermost --------------------------------------------------------------
PP_AXES = ("pp", *AXES)
PP_SHAPES = [s for n in range(2, 9) for s in itertools.product(
    *[[d for d in range(1, n + 1) if n % d == 0]] * len(PP_AXES)) if math.prod(s) == n and s[0] > 1]


def expected_ranks_pp(rank: int, shape: tuple[int, ...], axes: tuple[str, ...]) -> list[int]:
    """As `expected_ranks`, over the six axes."""
    mine = unravel(rank, shape)
    idx = [PP_AXES.index(a) for a in axes]
    out = []
    for sub in itertools.product(*(range(shape[i]) for i in idx)):
        coords = list(mine)
        for i, c in zip(idx, sub):
            coords[i] = c
        out.append(ravel(tuple(coords), shape))
    return out


@pytest.mark.parametrize("shape", PP_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_views_with_pipeline_stages(shape):
    """``pp`` is outermost; every other view lies inside one stage (its ranks share this rank's pp coordinate), and
    `within_stage` spans every rank of the stage."""
    n = math.prod(shape)
    sizes = dict(zip(PP_AXES, shape))
    for rank in range(n):
        with fake_world(rank, n):
            mesh = ParallelMesh(ParallelismConfig(**{f"{a}_size": s for a, s in sizes.items()}), "cpu", fsdp=True)
            for name, axes in {"pp": ("pp",), **ALL_VIEWS}.items():
                want = expected_ranks_pp(rank, shape, axes)
                assert mesh.ranks(name) == want, (name, shape, rank)
                assert mesh.rank(name) == want.index(rank), (name, shape, rank)
            stage = mesh.within_stage()
            want = expected_ranks_pp(rank, shape, AXES)
            assert (stage is None and want == [rank]) or stage.mesh.flatten().tolist() == want, (shape, rank)


def test_minus_one_is_resolved_against_the_world():
    with fake_world(3, 8):
        mesh = ParallelMesh(ParallelismConfig(dp_shard_size=-1, tp_size=2), "cpu")
        assert mesh.config.dp_shard_size == 4
        assert mesh.ranks("tp") == [2, 3]
        assert mesh.ranks("fsdp") == [1, 3, 5, 7]


def test_wrong_world_size_raises():
    with fake_world(0, 6):
        with pytest.raises(ValueError, match=r"dp_shard\(2\) \* tp\(2\) = 4 != world size 6"):
            ParallelMesh(ParallelismConfig(dp_shard_size=2, tp_size=2), "cpu")


def test_unknown_view_lists_valid_names():
    with fake_world(0, 4):
        mesh = build((1, 2, 1, 1, 2))
        valid = ", ".join(mesh.names)
        for call in (mesh.__getitem__, mesh.size, mesh.rank, mesh.ranks, mesh.group):
            with pytest.raises(KeyError, match=r"no mesh view named 'experts'; valid names: " + re.escape(valid)):
                call("experts")
        with pytest.raises(KeyError) as info:
            mesh["dp_shard_tp"]
        message = str(info.value)
        assert all(name in message for name in [*ALL_VIEWS, "pp", "ep", "expert_shard"])


# ---- expert parallelism: ep and expert_shard carved out of fsdp ----------------------------------------------------
EP_CASES = [(shape, ep) for shape in SHAPES if math.prod(shape) <= 8
            for ep in range(2, shape[1] * shape[2] * shape[3] + 1) if (shape[1] * shape[2] * shape[3]) % ep == 0]


@pytest.mark.parametrize("shape,ep", EP_CASES, ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple) else str(c))
def test_expert_views(shape, ep):
    """``ep``: this rank's block of ep consecutive fsdp ranks (fsdp's own order, sp fastest); ``expert_shard``: the
    fsdp ranks at this rank's place in every block; FSDP2 wraps experts over (dp_replicate, expert_shard)."""
    n = math.prod(shape)
    sizes = dict(zip(AXES, shape))
    for rank in range(n):
        with fake_world(rank, n):
            mesh = ParallelMesh(ParallelismConfig(**{f"{a}_size": s for a, s in sizes.items()}, ep_size=ep), "cpu",
                                fsdp=True)
            fsdp = expected_ranks(rank, shape, EXPECTED_VIEWS["fsdp"])
            place = fsdp.index(rank)
            block = fsdp[place - place % ep: place - place % ep + ep]
            shard = fsdp[place % ep::ep]
            assert (mesh.ranks("ep"), mesh.rank("ep"), mesh.size("ep")) == (block, block.index(rank), ep), (shape, rank)
            assert (mesh.ranks("expert_shard"), mesh.size("expert_shard")) == (shard, len(fsdp) // ep), (shape, rank)
            layout = Layout(**sizes, ep=ep)
            assert (layout.group("ep", rank), layout.group("expert_shard", rank)) == (block, shard), (shape, rank)
            replicas = [expected_ranks(r, shape, ("dp_replicate",)) for r in shard]
            want = [[row[i] for row in replicas] for i in range(sizes["dp_replicate"])]
            experts_dp = mesh.expert_data_parallel().mesh
            assert (experts_dp.tolist() == want) if sizes["dp_replicate"] > 1 else (experts_dp.tolist() == shard)


def test_no_expert_parallelism_keeps_ep_a_one_rank_view():
    with fake_world(1, 4):
        mesh = build((1, 4, 1, 1, 1), fsdp=True)
        assert (mesh.size("ep"), mesh.rank("ep"), mesh.ranks("ep")) == (1, 0, [1])
        assert mesh.ranks("expert_shard") == mesh.ranks("fsdp") == [0, 1, 2, 3]
        with pytest.raises(ValueError, match=r"mesh view 'ep' \(ep of fsdp=4 with ep_size=1\) holds this rank alone"):
            mesh.group("ep")
        with pytest.raises(ValueError, match=r"no expert parallelism on this mesh \(ep_size=1\)"):
            mesh.expert_data_parallel()


def _new_groups(shape: tuple[int, ...], fsdp: bool) -> int:
    """Process groups created while building the mesh of `shape` (as rank 0)."""
    n = math.prod(shape)
    with fake_world(0, n):
        before = len(dist.distributed_c10d._world.pg_map)
        build(shape, fsdp)
        return len(dist.distributed_c10d._world.pg_map) - before


@pytest.mark.parametrize("shape,groups,fsdp", [
    ((1, 1, 1, 1, 1), 0, True),  # one process: every view is the default group
    ((1, 4, 1, 1, 1), 0, True),  # one axis spanning the world: the default group serves every view
    ((1, 2, 1, 1, 2), 2, True),  # dp_shard and tp only; batch = fsdp = loss = dp_shard's group
    ((2, 2, 1, 1, 2), 4, True),  # dp_replicate, dp_shard, tp, and one flattened (dp_replicate x dp_shard)
    ((1, 2, 2, 1, 1), 2, True),  # dp_shard and cp; their product (fsdp = loss = ...) spans the world: default group
    ((2, 2, 2, 1, 2), 7, True),  # 4 axes; batch (= dp), fsdp (= dp_shard_cp), loss (= dp_cp)
    ((2, 1, 1, 1, 2), 2, False),  # DDP x TP without FSDP2 would need dp_replicate and tp only ...
    ((2, 1, 1, 1, 2), 3, True),  # ... with FSDP2 replicating, a one-rank dp_shard dimension beside them
])
def test_groups_only_for_axes_and_views_that_exist(shape, groups, fsdp):
    """Size-1 axes get no dimension and views that repeat another's axes share its group (before: every axis and
    six flattened views made groups: 11 per rank for every shape here but the first two)."""
    assert _new_groups(shape, fsdp) == groups


def test_views_of_one_rank_have_no_group():
    with fake_world(0, 4):
        mesh = build((1, 2, 1, 1, 2))
        assert mesh.world.mesh_dim_names == ("dp_shard", "tp")
        assert (mesh.size("cp"), mesh.rank("cp"), mesh.ranks("cp")) == (1, 0, [0])
        with pytest.raises(ValueError, match=r"mesh view 'cp' \(cp_size=1\) holds this rank alone and has no "
                                             r"process group; check mesh.size\('cp'\) > 1"):
            mesh.group("cp")


def test_mesh_needs_initialised_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"torch.distributed must be initialised"):
        build((1, 1, 1, 1, 1))
