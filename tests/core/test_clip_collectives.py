"""Tier 2 (forked gloo ranks): gradient clipping over mixed meshes, and the metric collectives.

Two forked runs of 4 ranks, each returning raw results that the tests below check against values computed
here from first principles, in plain single-process torch:

- layout dp_shard 2 x tp 2: `clip_grad_norm_` over DTensor gradients on four different meshes (sharded,
  replicated, 2-D, unevenly sharded, partial) plus plain tensors; `gather`, `reduce`, `gather_for_metrics`.
  Mesh axes are, outermost first, dp_replicate, dp_shard, cp, sp, tp, so global rank r has dp_shard
  coordinate r // 2 and tp coordinate r % 2. Tensor-parallel peers hold the same data, as they would in
  training.
- layout dp_replicate 2 x dp_shard 2 (HSDP): `Accelerator.clip_grad_norm_` on a prepared tiny llama against
  the single-process gradient; `gather` over four data ranks (global rank order here).

Tolerances: a norm is a sum over ranks all-reduced in another order than the reference's sum, so 1-, 2-norms
agree within 1e-6 relative (fp32); the inf-norm of the same values is a max and is exact. Across ranks every
result must be bitwise identical: ranks that clip by different factors let replicas drift apart.
"""

from __future__ import annotations

import math

import pytest
import torch

from harness import run_ranks

INF = math.inf
NORM_TYPES = (2.0, 1.0, INF)
MAX_NORMS = (0.5, 1e4)  # clips every norm type / clips nothing

# name -> (full shape, mesh, placements). "fsdp" and "tp" are 1-D views of size 2, "2d" is (dp_shard, tp).
GRAD_SPECS = {
    "fsdp_shard0": ((6, 4), "fsdp", ("S0",)),
    "fsdp_uneven": ((3, 5), "fsdp", ("S0",)),  # local rows 2 / 1
    "tp_shard1": ((3, 4), "tp", ("S1",)),
    "tp_replicate": ((5,), "tp", ("R",)),
    "tp_empty": ((1, 3), "tp", ("S0",)),  # tp rank 1 holds no rows
    "tp_partial": ((2, 3), "tp", ("P",)),  # tp rank 0 holds the values, tp rank 1 zeros
    "2d_s0_s1": ((4, 6), "2d", ("S0", "S1")),
    "2d_r_s0": ((4, 3), "2d", ("R", "S0")),
    "2d_uneven": ((3, 2), "2d", ("S0", "S0")),  # pieces of 1, 1, 1, 0 rows
    "2d_strided": ((8, 3), "2d", ("SS0", "S0")),  # what FSDP2 makes of a tp colwise weight (dp_shard x tp)
    "plain_a": ((7,), None, ()),
    "plain_b": ((2, 2), None, ()),
}


def full_grads() -> dict[str, torch.Tensor]:
    """The same full gradients on every rank and in the parent."""
    g = torch.Generator().manual_seed(1234)
    grads = {name: torch.randn(shape, generator=g) for name, (shape, _, _) in GRAD_SPECS.items()}
    # The largest |g| sits in the piece held by rank 3 only (dp_shard 1, tp 1): the inf-norm needs the max.
    grads["2d_s0_s1"][-1, -1] = -9.0
    return grads


def expected_norm(grads: dict[str, torch.Tensor], norm_type: float) -> float:
    flat = torch.cat([g.double().flatten() for g in grads.values()])
    return torch.linalg.vector_norm(flat, norm_type).item()


# ---- rank functions --------------------------------------------------------------------------------------
def _make_params(meshes: dict) -> list[torch.nn.Parameter]:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    kinds = {"S0": Shard(0), "S1": Shard(1), "R": Replicate(), "SS0": _StridedShard(0, split_factor=2)}
    params = []
    for name, full in full_grads().items():
        _, mesh_name, placements = GRAD_SPECS[name]
        if mesh_name is None:
            grad = full
        elif placements == ("P",):
            mesh = meshes[mesh_name]
            local = full if mesh.get_local_rank() == 0 else torch.zeros_like(full)
            grad = DTensor.from_local(local, mesh, [Partial()], run_check=False)
        else:
            grad = distribute_tensor(full, meshes[mesh_name], [kinds[p] for p in placements])
        param = torch.nn.Parameter(torch.zeros_like(grad))
        param.grad = grad
        params.append(param)
    return params


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()


def _tp_layout_ranks() -> dict:
    import torch.distributed as dist

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.training import clip

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2), cpu=True)
    rank = dist.get_rank()
    out: dict = {"batch_rank": acc.mesh.rank("batch")}

    # 1. Clipping over mixed meshes.
    meshes = {"fsdp": acc.mesh["fsdp"], "tp": acc.mesh["tp"], "2d": acc.mesh.world["dp_shard", "tp"]}
    uneven = _make_params(meshes)
    out["local_rows"] = {n: p.grad.to_local().shape[0] for n, p in zip(GRAD_SPECS, uneven)
                         if n in ("fsdp_uneven", "tp_empty", "2d_uneven")}
    out["clip"] = {}
    for norm_type in NORM_TYPES:
        for max_norm in MAX_NORMS:
            params = _make_params(meshes)
            norm = clip.clip_grad_norm_(params, max_norm, norm_type)
            out["clip"][norm_type, max_norm] = (norm.item(), {n: _full(p.grad) for n, p in zip(GRAD_SPECS, params)})

    # 3. gather: tp peers (same dp_shard coordinate) hold the same data.
    d = rank // 2
    nested = {"rows": torch.arange(3 * (d + 1), dtype=torch.float32).reshape(d + 1, 3) + 100 * d,
              "other": [torch.tensor(float(d)), torch.full((2 - 2 * d, 2), d, dtype=torch.long)]}
    out["gather_nested"] = acc.gather(nested)
    out["gather_global_rank"] = acc.gather(torch.tensor([rank]))  # not what tp peers do; shows the groups
    out["gather_for_metrics_tensor"] = acc.gather_for_metrics(nested)

    # 4. reduce over the loss view.
    x = torch.tensor([1.5 * (d + 1), -(d + 1.0)])
    ints = torch.tensor([d + 1, 10 * (d + 1)])
    out["reduce"] = {
        "sum": acc.reduce(x, "sum"), "mean": acc.reduce(x, "mean"),
        "sum_scaled": acc.reduce(x, "sum", scale=0.5), "mean_scaled": acc.reduce(x, "mean", scale=2.0),
        "int_sum": acc.reduce(ints, "sum"), "int_mean": acc.reduce(ints, "mean"),
        "scalar_mean": acc.reduce(torch.tensor(d + 1.0), "mean"),
        "nested_sum": acc.reduce({"x": x, "l": [ints]}, "sum"),
        "unchanged_input": x.clone(),
    }
    try:
        acc.reduce(x, "median")
    except ValueError as exc:
        out["reduce"]["bad_reduction"] = str(exc)

    # 5. gather_for_metrics of Python objects.
    out["objects_list"] = acc.gather_for_metrics([{"d": d, "s": "x" * d}, ("t", d)], use_gather_object=True)
    out["objects_single"] = acc.gather_for_metrics(f"data-{d}", use_gather_object=True)
    return out


HSDP_SEQ, HSDP_PER_RANK, HSDP_MAX_NORM = 16, 2, 0.1


def _rank_batch(dataset, r: int) -> dict[str, torch.Tensor]:
    rows = range(r * HSDP_PER_RANK, (r + 1) * HSDP_PER_RANK)
    return {k: torch.stack([dataset[i][k] for i in rows]) for k in ("input_ids", "labels")}


def _hsdp_ranks() -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from ndparallel import Accelerator, ParallelismConfig
    from tiny_models import TokenDataset, build_model

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2), cpu=True)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = acc.prepare(build_model("llama"))
    data = TokenDataset(4 * HSDP_PER_RANK, HSDP_SEQ)
    acc.backward(model(**_rank_batch(data, rank)).loss)
    params = list(model.parameters())
    out: dict = {"all_dtensor": all(isinstance(p.grad, DTensor) for p in params)}
    out["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    # max_norm = inf scales by exactly 1 (inf / norm clamped to 1): norms without changing the gradients.
    out["norm_inf"] = acc.clip_grad_norm_(params, INF, norm_type=INF).item()
    out["norm_1"] = acc.clip_grad_norm_(params, INF, norm_type=1).item()
    out["norm_2"] = acc.clip_grad_norm_(params, HSDP_MAX_NORM).item()
    out["clipped"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}

    # gather over four data ranks: batch = dp_replicate x dp_shard, so batch rank = global rank here.
    out["gather"] = acc.gather({"rows": torch.full((rank, 2), float(rank)), "scalar": torch.tensor(rank),
                                "list": [torch.arange(rank + 1)]})
    out["reduce_mean"] = acc.reduce(torch.tensor([float(rank)]), "mean")
    return out


@pytest.fixture(scope="module")
def tp_layout() -> list[dict]:
    return run_ranks(_tp_layout_ranks, 4)


@pytest.fixture(scope="module")
def hsdp() -> list[dict]:
    return run_ranks(_hsdp_ranks, 4)


def assert_same_on_every_rank(values: list) -> None:
    first = values[0]
    for rank, v in enumerate(values[1:], 1):
        assert v == first, f"rank {rank} disagrees with rank 0: {v} != {first}"


# ---- 1. clip_grad_norm_ over DTensors on different meshes and plain tensors --------------------------------
def test_test_grads_are_really_uneven(tp_layout):
    rows = [res["local_rows"] for res in tp_layout]
    assert [r["fsdp_uneven"] for r in rows] == [2, 2, 1, 1]  # dp_shard 0 / 1
    assert [r["tp_empty"] for r in rows] == [1, 0, 1, 0]  # tp 0 / 1
    assert [r["2d_uneven"] for r in rows] == [1, 1, 1, 0]


@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=["l2", "l1", "inf"])
@pytest.mark.parametrize("max_norm", MAX_NORMS, ids=["clips", "no_clip"])
def test_clip_mixed_meshes_matches_full_tensors(tp_layout, norm_type, max_norm):
    full = full_grads()
    norm = expected_norm(full, norm_type)
    coef = min(1.0, max_norm / (norm + 1e-6))
    assert (coef < 0.1) if max_norm < 1 else coef == 1.0  # both branches are exercised
    results = [res["clip"][norm_type, max_norm] for res in tp_layout]
    assert_same_on_every_rank([r[0] for r in results])
    if math.isinf(norm_type):
        assert results[0][0] == pytest.approx(9.0, abs=0)  # a max: exact
    else:
        assert results[0][0] == pytest.approx(norm, rel=1e-6)
    for rank, (_, clipped) in enumerate(results):
        for name, g in clipped.items():
            torch.testing.assert_close(g, full[name] * coef, rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"rank {rank}, {name}: {m}")
            assert torch.equal(g, results[0][1][name]), f"rank {rank}, {name}: differs from rank 0"


def test_clip_double_counting_would_be_detected():
    """Guards the test above: counting replicated/tp copies twice gives a norm outside the tolerance."""
    full = full_grads()
    doubled = {**full, "tp_replicate_again": full["tp_replicate"], "plain_a_again": full["plain_a"]}
    assert abs(expected_norm(doubled, 2.0) / expected_norm(full, 2.0) - 1) > 1e-3


# ---- 2. Accelerator.clip_grad_norm_ on a prepared HSDP model --------------------------------------------
@pytest.fixture(scope="module")
def hsdp_reference() -> dict[str, torch.Tensor]:
    """Single process: the gradient of the mean of the four ranks' mean losses (FSDP/HSDP average gradients
    over the loss view, and each rank's loss is its own token mean)."""
    from tiny_models import TokenDataset, build_model

    torch.manual_seed(0)
    model = build_model("llama")
    data = TokenDataset(4 * HSDP_PER_RANK, HSDP_SEQ)
    loss = torch.stack([model(**_rank_batch(data, r)).loss for r in range(4)]).mean()
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_accelerator_clip_on_hsdp_matches_single_process(hsdp, hsdp_reference):
    ref = hsdp_reference
    assert all(res["all_dtensor"] for res in hsdp)
    # The setup is right: the sharded gradients are the single-process ones (reduce-scatter/all-reduce sum
    # in another order: fp32 rounding only).
    for name, g in hsdp[0]["grads"].items():
        torch.testing.assert_close(g, ref[name], rtol=1e-5, atol=1e-7)
    for key, norm_type in (("norm_2", 2.0), ("norm_1", 1.0), ("norm_inf", INF)):
        assert_same_on_every_rank([res[key] for res in hsdp])
        assert hsdp[0][key] == pytest.approx(expected_norm(ref, norm_type), rel=1e-6), key
        # Against the full tensors of the very gradients that were clipped.
        assert hsdp[0][key] == pytest.approx(expected_norm(hsdp[0]["grads"], norm_type), rel=1e-6), key
    coef = HSDP_MAX_NORM / (expected_norm(ref, 2.0) + 1e-6)
    assert coef < 1
    for rank, res in enumerate(hsdp):
        for name, g in res["clipped"].items():
            torch.testing.assert_close(g, hsdp[0]["grads"][name] * coef, rtol=1e-6, atol=1e-9,
                                       msg=lambda m: f"rank {rank}, {name}: {m}")


# ---- 3. gather ------------------------------------------------------------------------------------------
def test_gather_dp_shard_x_tp_counts_each_data_rank_once(tp_layout):
    expected = {
        "rows": torch.cat([torch.arange(3.0).reshape(1, 3), torch.arange(6.0).reshape(2, 3) + 100]),
        "other": [torch.tensor([0.0, 1.0]), torch.zeros((2, 2), dtype=torch.long)],  # data rank 1: no rows
    }
    for rank, res in enumerate(tp_layout):
        assert res["batch_rank"] == rank // 2
        got = res["gather_nested"]
        assert isinstance(got, dict) and isinstance(got["other"], list)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        # 2 entries (dp_shard), not 4: the ranks with this rank's tp coordinate, in dp_shard order.
        assert res["gather_global_rank"].tolist() == [rank % 2, 2 + rank % 2]
        torch.testing.assert_close(res["gather_for_metrics_tensor"], expected, rtol=0, atol=0)


def test_gather_uneven_lengths_scalars_and_lists_in_rank_order(hsdp):
    expected = {
        "rows": torch.cat([torch.full((r, 2), float(r)) for r in range(4)]),  # rank 0 contributes no rows
        "scalar": torch.arange(4),
        "list": [torch.cat([torch.arange(r + 1) for r in range(4)])],
    }
    for res in hsdp:
        assert isinstance(res["gather"]["list"], list)
        torch.testing.assert_close(res["gather"], expected, rtol=0, atol=0)


# ---- 4. reduce over the loss view ----------------------------------------------------------------------
def test_reduce_counts_tp_copies_once(tp_layout):
    # Data ranks 0 and 1 hold x = [1.5, -1] and [3, -2]; ints = [1, 10] and [2, 20].
    expected = {
        "sum": torch.tensor([4.5, -3.0]), "mean": torch.tensor([2.25, -1.5]),
        "sum_scaled": torch.tensor([2.25, -1.5]), "mean_scaled": torch.tensor([4.5, -3.0]),
        "int_sum": torch.tensor([3, 30]), "int_mean": torch.tensor([1.5, 15.0]),
        "scalar_mean": torch.tensor(1.5),
        "nested_sum": {"x": torch.tensor([4.5, -3.0]), "l": [torch.tensor([3, 30])]},
    }
    for rank, res in enumerate(tp_layout):
        red = res["reduce"]
        for key, value in expected.items():
            torch.testing.assert_close(red[key], value, rtol=0, atol=0, msg=lambda m: f"rank {rank} {key}: {m}")
        assert red["int_sum"].dtype == torch.int64
        assert red["int_mean"].dtype == torch.float32
        # reduce returns new tensors; the input is untouched.
        torch.testing.assert_close(red["unchanged_input"], torch.tensor([1.5, -1.0]) * (rank // 2 + 1))
        assert "'median'" in red["bad_reduction"] and "'sum', 'mean'" in red["bad_reduction"]


def test_reduce_mean_over_four_data_ranks(hsdp):
    for res in hsdp:
        torch.testing.assert_close(res["reduce_mean"], torch.tensor([1.5]), rtol=0, atol=0)


# ---- 5. gather_for_metrics with Python objects -----------------------------------------------------------
def test_gather_for_metrics_objects(tp_layout):
    for res in tp_layout:
        assert res["objects_list"] == [{"d": 0, "s": ""}, ("t", 0), {"d": 1, "s": "x"}, ("t", 1)]
        assert res["objects_single"] == ["data-0", "data-1"]
