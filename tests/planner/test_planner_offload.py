"""FSDP2's CPU offload in the planner (`ndparallel.planner.offload`): its terms, the host budget, the search
(``--offload-params``, ``plan --max-seq``), and the host bytes the library holds under ``cpu_offload=True`` against
the prediction (docs/planner.md, "FSDP2's CPU offload")."""

from __future__ import annotations

import json

import pytest
import torch

from harness import run_ranks
from ndparallel.cli import main
from ndparallel.planner import Layout, Recipe, get_hardware, load_model, spec_from_config
from ndparallel.planner.footprint import estimate, state_elements
from ndparallel.planner.offload import host_bytes, host_traffic, pinned
from ndparallel.planner.search import Request, best_row, evaluate
from tiny_models import build_model

GiB = 2**30
MiB = 2**20


def test_pinned_blocks_round_up_to_powers_of_two():
    assert [pinned(n) for n in (0, 1, 4096, 4097, 224 * MiB, 256 * MiB)] == [0, 1, 4096, 8192, 256 * MiB, 256 * MiB]
    assert pinned(224 * MiB, pin=False) == 224 * MiB


def _terms(layout: Layout, offload_params: bool, seq: int = 65536, **kw) -> dict[str, float]:
    recipe = Recipe(seq, 1, 1, "bf16", True, chunked_loss=True, tiled_mlp=True, offload=True,
                      offload_params=offload_params)
    return {n: t.bytes for n, t in estimate(load_model("llama-3.1-8b"), layout, recipe, 0.19, **kw).terms.items()}


def test_offload_moves_the_states_to_the_host_and_keeps_the_staging_on_the_gpu():
    for layout in (Layout(dp_shard=8), Layout(sp=8), Layout()):
        on, off = _terms(layout, True), _terms(layout, False)
        assert on["params"] == on["grads"] == on["optimizer"] == 0
        exact = _terms(layout, True, pin=False)
        assert exact["host_params"] == exact["host_grads"] == off["params"]  # the same shards, in host memory
        assert exact["host_optimizer"] == off["optimizer"]
        assert on["host_params"] >= exact["host_params"]  # pinned blocks: rounded up
        assert on["offload_staging"] > 0 and on["peak"] < off["peak"]
    # A one-rank shard group keeps its compute-dtype copies gathered without offload; under it, it reshards after
    # forward (the library's `reshards_after_forward`), holding the root unit and one layer gathered at a time.
    layer = 218_112_000  # one Llama 3.1 8B decoder layer's elements
    one_rank, kept = _terms(Layout(), True), _terms(Layout(), False)
    assert kept["unsharded_params"] == 8_030_261_248 * 2 and "unsharded_params" not in one_rank
    assert one_rank["root_unsharded"] == 1_050_677_248 * 2  # embedding, head and final norm
    assert one_rank["layer_buffers"] == 3 * layer * 2 + layer * 4  # its parameters, 2 layers' gradients, fp32 reduce
    assert one_rank["offload_staging"] == 2 * layer * 4  # one layer's fp32 shard in, one gradient out
    assert "unsharded_params" not in _terms(Layout(dp_shard=8), True)
    assert _terms(Layout(dp_shard=8), True)["offload_staging"] == 3 * (layer // 8) * 4  # two prefetched shards in


def test_offloaded_layer_inputs_are_held_at_their_bytes():
    """The offload's host pool holds each layer's input at its bytes (aligned), pinned or not: not rounded up to a
    power of two per block as torch's caching host allocator pins (`pinned`)."""
    seq = 3 * 65536  # 196,608 tokens x 4,096 x 2 B = 1.5 GiB per layer input: a pinned block would hold 2 GiB
    on = _terms(Layout(dp_shard=8), True, seq=seq)
    block = seq * 4096 * 2
    assert on["host_offload"] == 32 * block == _terms(Layout(dp_shard=8), True, seq=seq, pin=False)["host_offload"]
    assert on["host_offload"] < 32 * pinned(block)


def test_the_host_budget_is_a_constraint():
    model, hw = load_model("llama-3.1-8b"), get_hardware("h100")
    roomy = Request(model, hw, 1, 1, 131072, 131072, offload_params="on")
    row = best_row(roomy, Layout())
    assert row.fits and row.recipe.offload_params and host_bytes(row.memory) > 120 * GiB
    tight = Request(model, hw, 1, 1, 131072, 131072, offload_params="on", host_memory_gib=100)
    assert not best_row(tight, Layout()).fits  # the same row, but the node's 100 GiB cannot hold its states
    unchecked = Request(model, hw, 1, 1, 131072, 131072, offload_params="on", host_memory_gib=0)
    assert unchecked.host_budget_bytes is None and best_row(unchecked, Layout()).fits
    with pytest.raises(ValueError, match="leaves nothing per GPU"):
        Request(model, hw, 1, 8, 131072, 131072, host_memory_gib=16)


def test_host_traffic_and_the_optimizer_step_on_the_host():
    model, hw, layout = load_model("llama-3.1-8b"), get_hardware("h100"), Layout(dp_shard=8)
    held, _, _ = state_elements(model, layout)
    root = 2 * (128256 // 8) * 4096 + 4096 // 8  # embedding and head rows over 8 ranks, the final norm
    recipe = Recipe(8192, 1, 2, "bf16", True, offload_params=True)
    h2d, d2h, _ = host_traffic(held - root, root, layout, recipe)
    assert (h2d, d2h) == (2 * (2 * (held - root) + root) * 4, held * 4)  # in at every gather, out once per step
    # One rank: gathered in forward and again in backward (it reshards after forward under offload), each micro-step.
    assert host_traffic(held, 0, Layout(), recipe)[0] == 2 * 2 * held * 4
    row = evaluate(Request(model, hw, 1, 8, 8192, 16 * 8192), layout, recipe)
    assert row.timing.optimizer_s == pytest.approx(held * 28 / hw.host_optimizer_bandwidth)
    moved = (h2d + d2h) / hw.host_bandwidth
    assert row.timing.exposed_s >= max(0.0, moved - hw.overlap * row.timing.compute_s)


def _max_seq(capsys, gpus: int, *extra: str) -> tuple[int, list[dict]]:
    code = main(["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--gpus-per-node", str(gpus), "--max-seq",
                 "--json", *extra])
    return code, json.loads(capsys.readouterr().out or "[]")


def test_max_seq_uses_the_offload_where_it_makes_the_sequence_longer(capsys):
    code, rows = _max_seq(capsys, 1)
    assert code == 0 and rows[0]["offload_params"] and rows[0]["tokens_without_offload_params"] == 0
    assert rows[0]["tokens"]["all"] > 0
    assert _max_seq(capsys, 1, "--offload-params", "off")[0] != 0  # an 8B model's states alone exceed one H100
    code, rows = _max_seq(capsys, 8)
    best = rows[0]
    assert code == 0 and best["offload_params"] and best["tokens"]["all"] > best["tokens_without_offload_params"] > 0
    code, off = _max_seq(capsys, 8, "--offload-params", "off")
    same = next(r for r in off if r["name"] == best["name"])  # the same layout, without the offload
    assert not any(r["offload_params"] for r in off) and same["tokens"]["all"] == best["tokens_without_offload_params"]
    code, small = _max_seq(capsys, 8, "--host-memory-gib", "200")  # 25 GiB per GPU less the 8 GiB reserve
    assert small[0]["tokens"]["all"] < best["tokens"]["all"]
    assert all(r["host_bytes"]["all"] <= (25 - 8) * GiB for r in small if r["host_bytes"]["all"])


def test_plan_recommends_the_cpu_offload_it_chose(capsys):
    args = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--gpus-per-node", "1", "--seq-len", "65536",
            "--global-batch-tokens", "65536"]
    assert main(args + ["--json"]) == 0
    best = json.loads(capsys.readouterr().out)["rows"][0]
    assert best["offload_params"] and best["fits"] and best["host_bytes"] <= best["host_budget_bytes"]
    assert main(args) == 0
    assert "FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing=True, cpu_offload=True)" in \
        capsys.readouterr().out
    assert main(args + ["--offload-params", "off"]) != 0  # nothing fits one H100 without it


# ---- against the library -----------------------------------------------------------------------------------------
def _host_bytes_on_rank(sizes: dict[str, int], precision: str) -> dict:
    """One rank of the library under FullyShardedDataParallelPlugin(cpu_offload=True), after two AdamW steps (before
    zero_grad): the bytes of the storages the offload policy placed in host memory, counted by distinct storage --
    every FSDP2 parameter's sharded data (``FSDPParam._sharded_param_data``, the padded fp32 shard CPUOffloadPolicy
    keeps on the host), its gradient's local tensor, and the optimizer's tensor states (not AdamW's scalar step
    counters) -- and whether each unit reshards after forward. On this CPU-only machine host and device are the same
    memory, so "on the host" means "placed by the offload policy": every FSDPParam must say offload_to_cpu."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(**sizes), mixed_precision=precision, cpu=True,
                      fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=True))
    model = build_model("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(0))
    samples = [{"input_ids": r, "labels": r, "shift_labels": torch.nn.functional.pad(r[1:], (0, 1), value=-100)}
               for r in rows]
    model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(samples, batch_size=1))
    for step, batch in enumerate(loader):
        buffers = list(batch.values())
        with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * 3, no_restore_buffers=set(buffers)):
            acc.backward(model(**batch).loss)
        optimizer.step()
        if step == 1:
            break
        optimizer.zero_grad()

    def storage_bytes(tensors) -> int:
        out = {}
        for t in tensors:
            local = t.to_local() if isinstance(t, DTensor) else t
            out[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        return sum(out.values())

    fsdp_params, reshard = [], []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
            for group in groups:
                fsdp_params += group.fsdp_params
                if module is not model:  # the root stays gathered into backward either way
                    reshard.append(group._reshard_after_forward)
    params = [p.sharded_param for p in fsdp_params]
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"offloaded": [p.offload_to_cpu for p in fsdp_params], "reshard": set(reshard),
            "params": storage_bytes(p._sharded_param_data for p in fsdp_params),
            "grads": storage_bytes(p.grad for p in params), "optimizer": storage_bytes(state),
            "count": len(params), "model_params": len(list(model.parameters()))}


@pytest.mark.slow
@pytest.mark.parametrize("sizes,precision", [({"dp_shard_size": 2}, "no"), ({"tp_size": 2}, "bf16"),
                                             ({"sp_size": 2}, "bf16")], ids=["dp_shard2", "tp2", "sp2"])
def test_host_bytes_the_library_holds_under_cpu_offload_match_the_prediction(sizes, precision):
    """Rank by rank (exact: shard arithmetic, no floats): the planner's host_params, host_grads, host_optimizer for
    the tiny Llama (`pin=False`: a CPU-only run pins nothing, so no power-of-two rounding) against the storages the
    library's offload holds, and the planner's one-rank rule -- compute-dtype copies kept gathered exactly where the
    library reshards after forward: under cpu_offload everywhere, tp=2's one-rank shard group too."""
    layout = Layout(**{k.removesuffix("_size"): v for k, v in sizes.items()})
    spec = spec_from_config(build_model("llama").config.to_dict(), "tiny")
    recipe = Recipe(32, 1, 1, "bf16" if precision == "bf16" else "fp32", offload_params=True)
    predicted = estimate(spec, layout, recipe, pin=False)
    for rank in run_ranks(_host_bytes_on_rank, 2, sizes, precision):
        assert all(rank["offloaded"]) and rank["count"] == rank["model_params"]
        assert (rank["params"], rank["grads"], rank["optimizer"]) == (
            predicted["host_params"], predicted["host_grads"], predicted["host_optimizer"]), (rank, predicted.terms)
        assert rank["reshard"] == {True}  # under cpu_offload also a one-rank shard group (tp=2)
        assert "unsharded_params" not in predicted.terms  # no gathered copies kept: every unit reshards
