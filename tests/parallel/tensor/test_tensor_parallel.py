"""Tensor parallelism, alone and with DDP, FSDP2 and HSDP, against the single-process reference.

The script is the Accelerate-style loop of the core tests (tests/scripts/accelerate_style.py); every rank builds
the model from the same seed and `prepare` applies the plan. Tolerance as for data parallelism: 1e-5 on the
per-step losses (fp32, 6 AdamW steps with clipping and an LR schedule).
"""

from __future__ import annotations

import pytest
from test_parity import max_param_diff, reference, run_layout

# (id, world size, flags). DDP x TP runs without an FSDP plugin, as a DDP user would write it.
TP_LAYOUTS = [
    ("tp2", 2, ["--tp-size", "2"]),
    ("tp4", 4, ["--tp-size", "4"]),
    ("fsdp2_tp2", 4, ["--dp-shard-size", "2", "--tp-size", "2"]),
    ("ddp2_tp2", 4, ["--dp-replicate-size", "2", "--tp-size", "2", "--no-fsdp-plugin"]),
    ("hsdp2x2_tp2", 8, ["--dp-replicate-size", "2", "--dp-shard-size", "2", "--tp-size", "2"]),
]
MODELS = ["llama", "qwen2", "mistral", "plain"]


def assert_losses_match(results: list[dict], ref: dict, what: str) -> float:
    worst = 0.0
    for rank, res in enumerate(results):
        assert len(res["losses"]) == len(ref["losses"]) == 6
        diff = max(abs(a - b) for a, b in zip(res["losses"], ref["losses"]))
        assert diff <= 1e-5, f"{what} rank {rank}: per-step losses differ from one process by {diff:.2e}"
        worst = max(worst, diff)
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name,world,flags", TP_LAYOUTS, ids=[layout[0] for layout in TP_LAYOUTS])
def test_losses_match_single_process(name, world, flags, model, sequence_parallel):
    extra = ["--sequence-parallel"] if sequence_parallel else []
    results = run_layout(model, world, flags, 1, *extra)
    assert_losses_match(results, reference(model), f"{name} {model} sp={sequence_parallel}")


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--tp-size", "2"], ["--tp-size", "2", "--sequence-parallel"],
                                   ["--dp-replicate-size", "2", "--tp-size", "2", "--no-fsdp-plugin"]],
                         ids=["tp2", "tp2_sp", "ddp2_tp2"])
def test_trained_parameters_match_and_tp_peers_agree(flags):
    """SGD-trained full parameters equal the reference's; every rank reassembles the same full weights."""
    world = 4 if "--dp-replicate-size" in flags else 2
    ref = reference("llama", optimizer="sgd", lr=0.5)
    results = run_layout("llama", world, flags, 1, "--optimizer", "sgd", "--lr", "0.5", "--return-params")
    assert max_param_diff(results[0]["params"], ref["params"]) <= 1e-6
    for res in results[1:]:
        assert max_param_diff(res["params"], results[0]["params"]) == 0.0


@pytest.mark.slow
def test_uneven_ignored_labels_with_tp_and_accumulation():
    """Token-weighted loss across dp ranks and micro-steps holds with TP (tp peers count their tokens once)."""
    ref = reference("llama", uneven_labels=True, optimizer="sgd", lr=0.5)
    results = run_layout("llama", 4, ["--dp-shard-size", "2", "--tp-size", "2"], 2, "--uneven-labels",
                         "--optimizer", "sgd", "--lr", "0.5", "--return-params")
    assert max_param_diff(results[0]["params"], ref["params"]) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("model,flags", [("llama", ["--tp-size", "2", "--sequence-parallel"]),
                                         ("plain", ["--dp-shard-size", "2", "--tp-size", "2"])],
                         ids=["llama_tp2_sp", "plain_fsdp2_tp2"])
def test_loss_parallel_matches_single_process(model, flags):
    world = 4 if "--dp-shard-size" in flags else 2
    results = run_layout(model, world, flags, 1, "--loss-parallel")
    assert_losses_match(results, reference(model), f"loss_parallel {model} {flags}")


def _loss_parallel_logits() -> tuple:
    import torch

    from ndparallel import Accelerator, MemoryKwargs, ParallelismConfig, TorchTensorParallelConfig
    from tiny_models import build_model

    # A training forward with labels returns no logits under the chunked loss (on by default): turned off to get them.
    acc = Accelerator(parallelism_config=ParallelismConfig(
        tp_size=2, tp_handler=TorchTensorParallelConfig(loss_parallel=True)),
        kwargs_handlers=[MemoryKwargs(chunked_loss=False)])
    model = acc.prepare(build_model("llama"))
    ids = torch.arange(32).reshape(2, 16)
    out = model(input_ids=ids, labels=ids)
    return type(out.logits).__name__, str(out.logits.placements), tuple(out.logits.to_local().shape), \
        type(out.loss).__name__


def test_loss_parallel_keeps_logits_split_over_the_vocabulary():
    from harness import run_ranks

    for result in run_ranks(_loss_parallel_logits, 2):
        assert result == ("DTensor", "(Shard(dim=2),)", (2, 16, 48), "Tensor")  # vocab 96 / 2; loss made local


@pytest.mark.slow
def test_sequence_parallel_with_a_length_tp_does_not_divide():
    """15 tokens over tp 4: the sequence shards are uneven (4, 4, 4, 3) and the result is still exact."""
    from reference import reference_run

    ref = reference_run("llama", global_batch=8, seq_len=15)
    results = run_layout("llama", 4, ["--tp-size", "4"], 1, "--sequence-parallel", "--seq-len", "15")
    assert_losses_match(results, ref, "tp4 sp seq 15")


@pytest.mark.parametrize("optimizer", ["adamw_foreach", "adamw_fused"])
def test_multi_tensor_optimizers_under_tensor_parallelism_alone(optimizer):
    """TP without FSDP2 leaves some parameters plain (norms) beside the sharded DTensors: torch's foreach and fused
    AdamW kernels, which take a parameter group in one call, get groups of one kind (`optim.uniform_param_groups`)."""
    results = run_layout("llama", 2, ["--tp-size", "2", "--no-fsdp-plugin"], 1, "--optimizer", optimizer)
    assert_losses_match(results, reference("llama"), f"tp2 {optimizer}")


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--activation-checkpointing"], ["--no-fsdp-plugin"]],
                         ids=["fsdp2_tp2_activation_checkpointing", "tp2_without_fsdp_plugin"])
def test_options_keep_parity(extra):
    world, flags = (4, ["--dp-shard-size", "2", "--tp-size", "2"]) if "--activation-checkpointing" in extra \
        else (2, ["--tp-size", "2"])
    results = run_layout("llama", world, flags, 1, *extra)
    assert_losses_match(results, reference("llama"), f"{flags} {extra}")


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--dp-shard-size", "2", "--tp-size", "2"], ["--tp-size", "2", "--no-fsdp-plugin"]],
                         ids=["fsdp2_tp2", "tp2_autocast"])
def test_bf16_follows_the_fp32_trajectory(flags):
    world = 4 if "--dp-shard-size" in flags else 2
    losses = run_layout("llama", world, flags, 1, "--mixed-precision", "bf16")[0]["losses"]
    diff = max(abs(a - b) for a, b in zip(losses, reference("llama")["losses"]))
    assert 0 < diff < 5e-2, f"bf16 {flags}: {diff:.2e} from the fp32 run"  # rounding, not another trajectory


def _replicate_style_run() -> dict:
    import torch
    from torch.distributed.tensor import DTensor

    from ndparallel import Accelerator, ParallelismConfig
    from tiny_models import PLAIN_PLAN, build_model

    acc = Accelerator(parallelism_config=ParallelismConfig(tp_size=2))
    torch.manual_seed(0)
    model = acc.prepare(build_model("plain"), tp_plan={**PLAIN_PLAN, "norm": "replicate"})
    ids = torch.arange(32).reshape(2, 16) % 96
    loss = model(input_ids=ids, labels=ids).loss
    acc.backward(loss)
    norm = acc.clip_grad_norm_(model.parameters(), 1e9)
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}
    return {"loss": loss.item(), "norm": norm.item(), "grads": grads,
            "norm.weight": str(getattr(model.norm.weight, "placements", None))}


def test_replicate_style_matches_single_process():
    """`replicate` makes the final norm's parameters replicated DTensors; loss, gradients and the clipping norm
    equal the single-process ones."""
    import torch

    from harness import run_ranks
    from tiny_models import build_model

    torch.manual_seed(0)
    model = build_model("plain")
    ids = torch.arange(32).reshape(2, 16) % 96
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    for res in run_ranks(_replicate_style_run, 2):
        assert res["norm.weight"] == "(Replicate(),)"
        assert abs(res["loss"] - loss.item()) <= 1e-6 and abs(res["norm"] - norm.item()) <= 1e-5
        assert max((res["grads"][n] - p.grad).abs().max().item() for n, p in model.named_parameters()) <= 1e-6
