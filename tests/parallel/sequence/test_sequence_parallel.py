"""Ulysses sequence parallelism (sp) and Ulysses inside context parallelism (cp x sp) end to end: the
Accelerate-style script against the single-process reference, what `maybe_context_parallel` does under sp, the
entry point for models without transformers, and refusals.

Parity tolerances are those of tests/parallel/test_parity.py: per-step losses within 1e-5 over 6 AdamW steps (fp32; the
all-to-alls move data without arithmetic, gradients pass through reduce-scatters), and SGD-trained parameters
within 1e-6 when -100 labels are spread unevenly over the shards.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from harness import assert_refused, outcomes, run_ranks
from ndparallel import Accelerator, ParallelismConfig
from ndparallel.parallel.sequence import SequenceShards
from test_context_parallel import _batch, _CustomAttentionLM, loss_diff
from test_parity import max_param_diff, reference, run_layout
from tiny_models import build_model

SP = ["--sp-size", "2"]
LAYOUTS = [  # (id, world size, flags); the tiny models have 8 query heads, 4 key/value heads
    ("sp2", 2, SP),
    ("sp4", 4, ["--sp-size", "4"]),
    ("fsdp2_sp2", 4, ["--dp-shard-size", "2", *SP]),
    ("sp2_tp2", 4, [*SP, "--tp-size", "2"]),
    ("cp2_sp2", 4, ["--cp-size", "2", *SP]),
    ("fsdp2_cp2_sp2", 8, ["--dp-shard-size", "2", "--cp-size", "2", *SP]),
]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "qwen2"])
@pytest.mark.parametrize("name,world,flags", LAYOUTS, ids=[l[0] for l in LAYOUTS])
def test_losses_match_single_process(name, world, flags, model):
    ref = reference(model)
    results = run_layout(model, world, flags, 1)
    diff = loss_diff(results, ref)
    assert diff <= 1e-5, f"{name} {model}: per-step losses differ by {diff:.2e}"
    assert results[0]["lr"] == pytest.approx(ref["lr"])


@pytest.mark.slow
@pytest.mark.parametrize("name,world,model,flags", [
    # tp 2 leaves each rank 2 of the 4 key/value heads, fewer than sp 4: each is repeated to 4 before the all-to-all
    ("sp4_tp2_kv_repeated", 8, "qwen2", ["--sp-size", "4", "--tp-size", "2"]),
    ("cp2_sp2_ring_contiguous", 4, "llama", ["--cp-size", "2", *SP, "--cp-strategy", "ring", "--cp-no-load-balance"]),
    ("sp2_eager_activation_checkpointing", 2, "llama", [*SP, "--attn-implementation", "eager",
                                                        "--activation-checkpointing"]),
], ids=lambda x: x if isinstance(x, str) and not x.startswith("-") else None)
def test_more_layouts_keep_parity(name, world, model, flags):
    diff = loss_diff(run_layout(model, world, flags, 1), reference(model))
    assert diff <= 1e-5, f"{name}: per-step losses differ by {diff:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("name,world,flags", [("sp2", 2, SP), ("cp2_sp2", 4, ["--cp-size", "2", *SP])])
def test_uneven_ignored_labels_over_shards_give_single_process_parameters(name, world, flags):
    """Shards hold very different numbers of loss tokens: each rank's loss is weighted by its own shard's count
    (counted over the cp x sp layout), so SGD-trained parameters match the reference."""
    sgd = ["--uneven-labels", "--optimizer", "sgd", "--lr", "0.5", "--return-params"]
    ref = reference("llama", uneven_labels=True, optimizer="sgd", lr=0.5)
    results = run_layout("llama", world, flags, 1, *sgd)
    assert max_param_diff(results[0]["params"], ref["params"]) <= 1e-6


# ---- in forked ranks -------------------------------------------------------------------------------------------------
def _sharded_buffers(cp: int, sp: int) -> dict:
    acc = Accelerator(parallelism_config=ParallelismConfig(cp_size=cp, sp_size=sp))
    ids = torch.arange(16).view(1, 16)
    with acc.maybe_context_parallel(buffers=[ids], buffer_seq_dims=[1]):
        inside = ids.tolist()
    return {"inside": inside, "after": ids.tolist(), "cp": acc.cp_rank, "sp": acc.sp_rank}


@pytest.mark.parametrize("cp,sp", [(1, 2), (2, 2)])
def test_maybe_context_parallel_shards_over_cp_then_sp(cp, sp):
    """Each rank holds its cp rank's shard's sp-th contiguous piece; the buffer is whole again after the block."""
    for res in run_ranks(_sharded_buffers, cp * sp, cp, sp, timeout=60):
        expected = SequenceShards.of(16, cp, res["cp"], True, sp, res["sp"]).positions().tolist()
        assert res["inside"] == [expected] and len(expected) == 16 // (cp * sp)
        assert res["after"] == [list(range(16))]
    if (cp, sp) == (2, 2):
        assert expected == [8, 9, 10, 11]  # cp rank 1 holds chunks 1 and 2 (of 4); sp rank 1 the second


def _custom_model_grads() -> float:
    acc = Accelerator(parallelism_config=ParallelismConfig(sp_size=-1))
    torch.manual_seed(0)
    plain = _CustomAttentionLM()
    torch.manual_seed(0)
    model = acc.prepare(_CustomAttentionLM())
    batch = _batch()
    ids, labels, pos = batch["input_ids"], batch["shift_labels"], batch["position_ids"]
    n_total = int((labels != -100).sum())
    F.cross_entropy(plain(ids, pos).flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    with acc.maybe_context_parallel(buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1]):
        logits = model(ids, pos)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        (loss / n_total * acc.sp_size).backward()  # FSDP averages over sp: the global token mean
    return max((p.grad.full_tensor() - plain.get_parameter(name).grad).abs().max().item()
               for name, p in model.named_parameters())


def test_custom_model_through_context_parallel_attention_under_sp():
    assert max(run_ranks(_custom_model_grads, 2, timeout=60)) <= 1e-6


def _refusals() -> dict[str, tuple[str, str]]:
    acc = Accelerator(parallelism_config=ParallelismConfig(sp_size=2))

    def forward(model, batch, buffers=None):
        buffers = list(batch.values()) if buffers is None else buffers
        with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers)):
            model(**batch)

    def labels_only():
        ids = _batch()["input_ids"]
        forward(acc.prepare(build_model("llama")), {"input_ids": ids, "labels": ids.clone()})

    def not_sharded():
        batch = _batch()
        forward(acc.prepare(build_model("llama")), batch, buffers=[batch["shift_labels"], batch["position_ids"]])

    cases = {
        "seq-len-9": lambda: Accelerator(parallelism_config=ParallelismConfig(sp_size=2)).maybe_context_parallel(
            buffers=[torch.ones(1, 9)], buffer_seq_dims=[1]).__enter__(),
        "training-outside-maybe_context_parallel": lambda: acc.prepare(build_model("llama"))(**_batch()),
        "labels-without-shift_labels": labels_only,
        "input_ids-not-sharded": not_sharded,
        "kv-heads-do-not-divide-heads": lambda: acc.prepare(build_model("llama", num_key_value_heads=3)),
    }
    return outcomes(cases)


REFUSALS = {
    "seq-len-9": ("ValueError", r"sequence length 9 does not split over cp_size=1 x sp_size=2"),
    "training-outside-maybe_context_parallel": ("RuntimeError", r"prepared with sp_size=2 and is called in training "
                                                                r"mode outside accelerator.maybe_context_parallel"),
    "labels-without-shift_labels": ("ValueError", r"the batch has labels but no shift_labels.*pass shift_labels"),
    "input_ids-not-sharded": ("ValueError", r"input_ids has 16 positions, but this rank's shard of the 16-token "
                                            r"sequence has 8; it was not sharded"),
    "kv-heads-do-not-divide-heads": ("ValueError", r"num_attention_heads=8 is not a multiple of num_key_value_heads=3"),
}


@pytest.fixture(scope="module")
def refusals() -> list[dict]:
    return run_ranks(_refusals, 2, timeout=120)


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_with_a_clear_error(refusals, case):
    assert_refused(refusals, REFUSALS[case], case)
