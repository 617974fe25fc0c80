"""Expert parallelism's dispatch against the experts module's own call, and what ep_size refuses.

`test_dispatch_equals_the_experts_own_call` runs one experts module (layer 0 of a tiny model) split over the ep ranks
on each rank's own tokens -- a different number of tokens on every rank, routed at random or all to experts 0 and 1 (the
ranks holding other experts then receive nothing, and under ep 2 the first rank sends nothing away) -- and compares with the unsplit
module's own call on every rank's tokens together: the outputs, the gradients of the hidden states and of the routing
weights, and each expert's weight gradient. The split module's weight gradient is divided by ep (`experts.compute`:
FSDP2 averages it over the remaining ranks), so ep times it is compared. Tolerances: the matmuls of a group of rows
may round differently from the same rows among others (1e-6 here, fp32).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn

from harness import assert_refused, outcomes, run_ranks
from tiny_models import _SMALL, build_model
from ndparallel.parallel.experts.modules import check_experts

TOLERANCE = 1e-6


def _tokens(world: int, hidden: int, experts: int, k: int, routing: str, ep: int):
    """Every rank's tokens (5 + 3r of them), their top-k experts and weights, and the output's cotangent."""
    g = torch.Generator().manual_seed(7)
    parts = []
    for rank in range(world):
        n = 5 + 3 * rank
        x = torch.randn(n, hidden, generator=g)
        if routing == "first_experts":  # experts 0 .. k-1 only
            index = torch.stack([torch.randperm(k, generator=g) for _ in range(n)])
        else:
            index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])
        weights = torch.rand(n, k, generator=g)
        parts.append((x, index, weights, torch.randn(n, hidden, generator=g)))
    return parts


def _run(model_name: str, ep: int, routing: str) -> dict:
    from ndparallel.configuration.parallelism import ParallelismConfig
    from ndparallel.distributed.mesh import ParallelMesh
    from ndparallel.parallel.experts import apply_expert_parallel
    from ndparallel.parallel.options import PrepareOptions

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = ParallelMesh(ParallelismConfig(dp_shard_size=world, ep_size=ep), "cpu")
    torch.manual_seed(0)
    model = build_model(model_name)
    unsplit = copy.deepcopy(model.model.layers[0].mlp.experts)
    apply_expert_parallel(model, mesh, PrepareOptions(device=torch.device("cpu")))
    split = model.model.layers[0].mlp.experts
    experts, k = unsplit.num_experts, 2
    parts = _tokens(world, model.config.hidden_size, experts, k, routing, ep)

    # One process: the tokens of every rank of this rank's ep group (whose experts' gradients they make) together.
    group = mesh.ranks("ep")
    x, index, weights, cotangent = (torch.cat(t) for t in zip(*(parts[r] for r in group)))
    x.requires_grad_(), weights.requires_grad_()
    (unsplit(x, index, weights) * cotangent).sum().backward()
    place = group.index(rank)
    rows = slice(sum(len(parts[r][0]) for r in group[:place]), sum(len(parts[r][0]) for r in group[:place + 1]))
    mine = slice(mesh.rank("ep") * experts // ep, (mesh.rank("ep") + 1) * experts // ep)

    # This rank: its tokens through its part of the split module.
    xr, index_r, weights_r, cotangent_r = parts[rank]
    xr, weights_r = xr.clone().requires_grad_(), weights_r.clone().requires_grad_()
    out = split(xr, index_r, weights_r)
    (out * cotangent_r).sum().backward()
    with torch.no_grad():
        ref_out = unsplit(x, index, weights)[rows]
    diffs = {"output": (out - ref_out).abs().max().item(),
             "hidden grad": (xr.grad - x.grad[rows]).abs().max().item(),
             "routing weight grad": (weights_r.grad - weights.grad[rows]).abs().max().item()}
    for name, param in split.named_parameters():
        local = param.grad.to_local()
        diffs[f"{name} grad"] = (local * ep - getattr(unsplit, name).grad[mine]).abs().max().item()
        assert local.shape[0] == experts // ep
    received = int(sum(1 for e in index.reshape(-1).tolist() if mine.start <= e < mine.stop))
    return {"diffs": diffs, "received": received, "moved": x.grad.abs().max().item()}


@pytest.mark.parametrize("model,world,ep,routing", [
    ("qwen3_moe", 2, 2, "random"),
    ("qwen3_moe", 2, 2, "first_experts"),
    ("gpt_oss", 2, 2, "random"),  # biases, weights stored (experts, in, out), clamped SwiGLU on interleaved columns
    pytest.param("qwen3_moe", 4, 4, "first_experts", marks=pytest.mark.slow),
    pytest.param("mixtral", 4, 2, "random", marks=pytest.mark.slow),  # two ep groups of 2
])
def test_dispatch_equals_the_experts_own_call(model, world, ep, routing):
    results = run_ranks(_run, world, model, ep, routing, timeout=120)
    for rank, res in enumerate(results):
        assert max(res["diffs"].values()) <= TOLERANCE, (rank, res["diffs"])
        assert res["moved"] > 0  # gradients flowed
    if routing == "first_experts":  # the imbalance the case is for: only the ranks holding experts 0, 1 receive tokens
        receiving = -(-2 * ep // 4)  # 4 / ep experts per rank: experts 0 and 1 are on the first ceil(2 ep / 4) ranks
        assert [r["received"] > 0 for r in results[:ep]] == [r < receiving for r in range(ep)]


# ---- refusals -----------------------------------------------------------------------------------------------------
def _per_expert_modules():
    """A Qwen3-MoE whose experts are an nn.ModuleList of MLPs (as older transformers and remote code build them)."""
    model = build_model("qwen3_moe")
    for layer in model.model.layers:
        layer.mlp.experts = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
    return model


@pytest.mark.parametrize("build,ep,match", [
    (lambda: build_model("llama"), 2, r"ep_size=2: LlamaForCausalLM has no experts \(no num_experts/"
                                      r"num_local_experts/n_routed_experts in its config\).*drop ep_size"),
    (lambda: transformers.FlexOlmoForCausalLM(transformers.FlexOlmoConfig(**dict(_SMALL, num_experts=4,
                                                                                    pad_token_id=0))), 2,
     r"ep_size=2: FlexOlmoForCausalLM \(model_type 'flex_olmo', \{'num_experts': 4.*\}\) is a mixture of experts whose "
     r"router and experts ndparallel's family table does not know \(it knows \['deepseek_v3', 'gpt_oss', 'mixtral', "
     r"'olmoe', 'qwen2_moe', 'qwen3_moe'\]"),
    (lambda: build_model("qwen3_moe"), 3, r"ep_size=3 must divide the experts of Qwen3MoeForCausalLM: num_experts=4 "
                                          r"cannot be split over 3 ranks; use an ep_size in \[1, 2, 4\]"),
    (lambda: build_model("deepseek_v3"), 16, r"n_routed_experts=8 cannot be split over 16 ranks"),
    (_per_expert_modules, 2, r"'model.layers.0.mlp.experts' \(ModuleList\) is not transformers' stacked experts "
                             r"layout .*per-expert modules .* are trained without ep_size"),
], ids=["no_experts", "unknown_family", "indivisible", "more_ranks_than_experts", "per_expert_modules"])
def test_what_expert_parallelism_cannot_split_is_refused(build, ep, match):
    with pytest.raises(ValueError, match=match):
        check_experts(build(), ep)
    check_experts(build(), 1)  # without expert parallelism nothing is asked of the model


def _prepare_refused(model_name: str, sizes: dict) -> dict:
    from ndparallel import Accelerator, ParallelismConfig

    def prepare():
        accelerator = Accelerator(parallelism_config=ParallelismConfig(**sizes))
        accelerator.prepare(build_model(model_name))

    return outcomes({"prepare": prepare})


@pytest.mark.parametrize("model,sizes,match", [
    ("llama", {"dp_shard_size": 2, "ep_size": 2}, r"ep_size=2: LlamaForCausalLM has no experts"),
    ("qwen3_moe", {"dp_shard_size": 2, "ep_size": 4},
     r"ep_size=4 must divide the ranks the experts are split over, dp_shard\(2\) \* cp\(1\) \* sp\(1\) = 2"),
])
def test_every_rank_refuses_alike_before_any_collective(model, sizes, match):
    """Raised on every rank with the same message: none waits in a collective for the others."""
    assert_refused(run_ranks(_prepare_refused, 2, model, sizes, timeout=120), ("ValueError", match), "prepare")
