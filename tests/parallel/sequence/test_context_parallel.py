"""Context parallelism end to end: the Accelerate-style script against the single-process reference, inputs CP must
refuse, and the behaviour of `maybe_context_parallel` and of the attention entry points.

Parity tolerances are those of tests/parallel/test_parity.py: per-step losses within 1e-5 over 6 AdamW steps (fp32; gradients
pass through reduce-scatters and the blockwise softmax sums in another order), and SGD-trained parameters within 1e-6
when -100 labels are spread unevenly over the shards.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harness import assert_refused, outcomes, run_ranks
from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig, context_parallel_attention
from ndparallel.parallel.sequence import SequenceChunking
from test_parity import max_param_diff, reference, run_layout
from tiny_models import build_model

CP = ["--cp-size", "2"]
LAYOUTS = [  # (id, world size, flags)
    ("cp2", 2, CP),
    ("cp4", 4, ["--cp-size", "4"]),
    ("fsdp2_cp2", 4, ["--dp-shard-size", "2", *CP]),
    ("hsdp2x2_cp2", 8, ["--dp-replicate-size", "2", "--dp-shard-size", "2", *CP]),
]
TP_LAYOUTS = [
    ("cp2_tp2", 4, [*CP, "--tp-size", "2"]),
    ("fsdp2_cp2_tp2", 8, ["--dp-shard-size", "2", *CP, "--tp-size", "2"]),
]


def loss_diff(results: list[dict], ref: dict) -> float:
    assert all(len(r["losses"]) == len(ref["losses"]) == 6 for r in results)
    return max(abs(a - b) for r in results for a, b in zip(r["losses"], ref["losses"]))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "qwen2"])
@pytest.mark.parametrize("strategy", ["allgather", "ring"])
@pytest.mark.parametrize("name,world,flags", [*LAYOUTS, *TP_LAYOUTS],
                         ids=[l[0] for l in LAYOUTS + TP_LAYOUTS])
def test_losses_match_single_process(name, world, flags, strategy, model):
    ref = reference(model)
    results = run_layout(model, world, flags, 1, "--cp-strategy", strategy)
    diff = loss_diff(results, ref)
    assert diff <= 1e-5, f"{name} {strategy} {model}: per-step losses differ by {diff:.2e}"
    assert results[0]["lr"] == pytest.approx(ref["lr"])


@pytest.mark.slow
def test_four_dimensional_layout_matches_single_process():
    """dp_replicate 2 x dp_shard 2 x cp 2 x tp 2 on 16 ranks."""
    flags = ["--dp-replicate-size", "2", "--dp-shard-size", "2", *CP, "--tp-size", "2"]
    diff = loss_diff(run_layout("qwen2", 16, flags, 1, "--cp-strategy", "ring"), reference("qwen2"))
    assert diff <= 1e-5, f"per-step losses differ by {diff:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ["--cp-no-load-balance", "--cp-strategy", "ring"],
    ["--cp-no-load-balance", "--cp-strategy", "allgather"],
    ["--activation-checkpointing", "--cp-strategy", "ring"],
    ["--attn-implementation", "eager", "--cp-strategy", "allgather"],
], ids=["contiguous_ring", "contiguous_allgather", "activation_checkpointing", "eager"])
def test_options_keep_parity(extra):
    diff = loss_diff(run_layout("llama", 2, CP, 1, *extra), reference("llama"))
    assert diff <= 1e-5, f"{extra}: per-step losses differ by {diff:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["allgather", "ring"])
def test_bf16_follows_the_fp32_trajectory(strategy):
    """FSDP2 computes in bf16: the blocks take bf16 inputs and keep softmax statistics in fp32."""
    results = run_layout("llama", 2, CP, 1, "--cp-strategy", strategy, "--mixed-precision", "bf16")
    diff = loss_diff(results, reference("llama"))
    assert 0 < diff < 5e-2, f"bf16 {strategy}: {diff:.2e} from the fp32 run"  # rounding, not another trajectory


@pytest.mark.slow
def test_sliding_window_covering_the_sequence_trains_as_causal():
    """Mistral's sliding window (4096 by default) is longer than the 16-token sequences: exactly causal, so allowed."""
    diff = loss_diff(run_layout("mistral", 2, CP, 1, "--cp-strategy", "ring"), reference("mistral"))
    assert diff <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name,world,flags,accum", [
    ("cp2", 2, CP, 1),
    ("fsdp2_cp2_accum2", 4, ["--dp-shard-size", "2", *CP, "--cp-strategy", "ring"], 2),
])
def test_uneven_ignored_labels_over_shards_give_single_process_parameters(name, world, flags, accum):
    """Shards hold very different numbers of loss tokens: each rank's loss is weighted by its shard's count (not its
    sample's), so SGD-trained parameters match the reference."""
    sgd = ["--uneven-labels", "--optimizer", "sgd", "--lr", "0.5", "--return-params"]
    ref = reference("llama", uneven_labels=True, optimizer="sgd", lr=0.5)
    results = run_layout("llama", world, flags, accum, *sgd)
    assert max_param_diff(results[0]["params"], ref["params"]) <= 1e-6


# ---- in forked ranks: what maybe_context_parallel does, entry points, refusals ------------------------------------
def _cp_accelerator(**plugin) -> Accelerator:
    """cp over every rank (all of them: cp_size=-1), with an FSDP plugin when plugin settings are given."""
    return Accelerator(parallelism_config=ParallelismConfig(cp_size=-1),
                       fsdp_plugin=FullyShardedDataParallelPlugin(**plugin) if plugin else None)


def _batch(seq: int = 16) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (2, seq), generator=torch.Generator().manual_seed(seq))
    return {"input_ids": ids, "shift_labels": F.pad(ids[:, 1:], (0, 1), value=-100),
            "position_ids": torch.arange(seq).repeat(2, 1)}


def _buffers_are_sharded_in_place() -> dict:
    acc = _cp_accelerator()
    kept, restored = torch.arange(16).view(1, 16), torch.arange(16).view(1, 16) * 10
    with acc.maybe_context_parallel(buffers=[kept, restored], buffer_seq_dims=[1, 1], no_restore_buffers={kept}):
        inside = (kept.tolist(), restored.tolist())
    return {"inside": inside, "after": (kept.tolist(), restored.tolist())}


def test_maybe_context_parallel_shards_buffers_in_place_and_restores_them():
    out = run_ranks(_buffers_are_sharded_in_place, 2, timeout=60)
    assert out[0]["inside"] == ([[0, 1, 2, 3, 12, 13, 14, 15]], [[0, 10, 20, 30, 120, 130, 140, 150]])
    assert out[1]["inside"] == ([[4, 5, 6, 7, 8, 9, 10, 11]], [[40, 50, 60, 70, 80, 90, 100, 110]])
    for rank, res in enumerate(out):  # no_restore_buffers stay sharded, the others get their full contents back
        assert res["after"] == (out[rank]["inside"][0], [[10 * i for i in range(16)]])


def _hf_behaviour() -> dict:
    acc = _cp_accelerator()
    out = {}
    for impl in ("sdpa", "eager"):
        torch.manual_seed(0)
        plain = build_model("llama", attn_implementation=impl)
        torch.manual_seed(0)  # the same initial weights
        prepared = acc.prepare(build_model("llama", attn_implementation=impl))
        # Outside maybe_context_parallel (evaluation), the model's own attention runs, padding masks included.
        batch = _batch()
        mask = torch.ones_like(batch["input_ids"])
        mask[0, :5] = 0
        prepared.eval()
        with torch.no_grad():
            a = prepared(input_ids=batch["input_ids"], attention_mask=mask).logits
            b = plain(input_ids=batch["input_ids"], attention_mask=mask).logits
        out[f"eval_{impl}"] = (a - b).abs().max().item()
    # Inside: position_ids left out are supplied as the shard's global positions; an all-ones mask is ignored.
    prepared.train()
    batch = _batch()
    full = plain(input_ids=batch["input_ids"], shift_labels=batch["shift_labels"]).logits
    buffers = list(batch.values())
    with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
        with torch.no_grad():
            logits = prepared(input_ids=batch["input_ids"], shift_labels=batch["shift_labels"],
                              attention_mask=torch.ones(2, 16, dtype=torch.long)).logits
    chunking = SequenceChunking(16, 2, dist.get_rank())
    out["inside_no_position_ids"] = (logits - chunking.shard(full, 1)).abs().max().item()
    # A shard without loss tokens (rank 0 holds positions 0-3 and 12-15, all -100 here): loss 0, not NaN.
    batch = _batch()
    batch["shift_labels"][:, :4] = batch["shift_labels"][:, 12:] = -100
    buffers = list(batch.values())
    with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
        loss = prepared(**batch).loss
        loss.backward()
    out["empty_shard_loss"] = loss.item() if dist.get_rank() == 0 else 0.0
    out["nonfinite_grads"] = float(sum(not torch.isfinite(p.grad.full_tensor()).all() for p in prepared.parameters()))
    return out


def test_hugging_face_models_evaluate_unsharded_and_get_global_positions():
    for res in run_ranks(_hf_behaviour, 2, timeout=90):
        assert all(v <= 1e-5 for v in res.values()), res


class _CustomAttentionLM(nn.Module):
    """A model written without transformers: its attention calls ndparallel's documented entry point."""

    def __init__(self, vocab: int = 96, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed, self.qkv = nn.Embedding(vocab, dim), nn.Linear(dim, 3 * dim)
        self.out, self.head = nn.Linear(dim, dim), nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + positions.unsqueeze(-1).float() / 16
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        a = context_parallel_attention(q, k, v, is_causal=True)
        return self.head(x + self.out(a.transpose(1, 2).reshape(b, n, d)))


def _custom_model_grads() -> float:
    acc = _cp_accelerator()
    torch.manual_seed(0)
    plain = _CustomAttentionLM()
    torch.manual_seed(0)
    model = acc.prepare(_CustomAttentionLM())
    batch = _batch()
    ids, labels, pos = batch["input_ids"], batch["shift_labels"], batch["position_ids"]
    n_total = int((labels != -100).sum())
    F.cross_entropy(plain(ids, pos).flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    with acc.maybe_context_parallel(buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1]):
        # Sum of this shard's token losses over all tokens, times cp: FSDP's average over cp is the global mean.
        logits = model(ids, pos)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        (loss / n_total * acc.cp_size).backward()
    return max((p.grad.full_tensor() - plain.get_parameter(name).grad).abs().max().item()
               for name, p in model.named_parameters())


def test_custom_model_through_context_parallel_attention_matches_single_process():
    assert max(run_ranks(_custom_model_grads, 2, timeout=60)) <= 1e-6


# ---- refusals: each trigger runs on both ranks and must raise, before anything can hang ------------------------------
class _BypassingLM(_CustomAttentionLM):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, n = input_ids.shape
        x = self.embed(input_ids)
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # not ndparallel's: sees its shard only
        return self.head(self.out(a.transpose(1, 2).reshape(b, n, -1)))


def _forward_sharded(acc: Accelerator, model: nn.Module, batch: dict, buffers: list | None = None, **call) -> None:
    buffers = list(batch.values()) if buffers is None else buffers
    with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers)):
        model(**batch, **call)


def _refusals() -> dict[str, tuple[str, str]]:
    acc = _cp_accelerator()

    def llama(**config):
        return acc.prepare(build_model("llama", **config))

    def flex():
        model = build_model("llama")
        model.config._attn_implementation_internal = "flex_attention"
        acc.prepare(model)

    def labels_only():
        ids = _batch()["input_ids"]
        _forward_sharded(acc, llama(), {"input_ids": ids, "labels": ids.clone()})

    def custom_mask():
        batch = _batch()
        _forward_sharded(acc, llama(), {**batch, "attention_mask": torch.ones(2, 1, 16, 16, dtype=torch.long)},
                         buffers=list(batch.values()))

    def input_ids_not_sharded():
        batch = _batch()
        _forward_sharded(acc, llama(), batch, buffers=[batch["shift_labels"], batch["position_ids"]])

    def positions_decrease():
        batch = _batch()
        batch["position_ids"] = torch.cat([torch.arange(8), torch.arange(5, 13)]).repeat(2, 1)
        _forward_sharded(acc, llama(), batch)

    def document_too_long():
        batch = _batch()
        batch["position_ids"] = torch.cat([torch.arange(12), torch.arange(4)]).repeat(2, 1)  # packed: 12 + 4
        _forward_sharded(acc, llama(max_position_embeddings=8), batch)

    def shared_memory():
        ids = torch.zeros(1, 16)
        acc.maybe_context_parallel(buffers=[ids, ids[:, :]], buffer_seq_dims=[1, 1]).__enter__()

    def nested():
        with acc.maybe_context_parallel(buffers=[torch.zeros(1, 16)], buffer_seq_dims=[1]):
            _forward_sharded(acc, llama(), _batch())

    def bypassed():
        batch = _batch()
        _forward_sharded(acc, acc.prepare(_BypassingLM()),
                         {"input_ids": batch["input_ids"], "positions": batch["position_ids"]})

    def mismatched_counts():
        loader = acc.prepare(torch.utils.data.DataLoader(
            [{"input_ids": torch.arange(16), "labels": torch.arange(16)}] * 2, batch_size=2))
        batch = next(iter(loader))
        labels = F.pad(batch.pop("labels")[:, 1:], (0, 1), value=-100)
        labels[:, :6] = -100  # masks more than the loader counted
        batch.update(shift_labels=labels, position_ids=torch.arange(16).repeat(2, 1))
        _forward_sharded(acc, llama(), batch)

    def mismatched_counts_later():  # after a first training forward whose counts agree: checked on the device
        model = llama()
        batches = iter(acc.prepare(torch.utils.data.DataLoader(
            [{"input_ids": torch.arange(16), "labels": torch.arange(16)}] * 4, batch_size=2)))
        for mask in (0, 6):
            batch = next(batches)
            labels = F.pad(batch.pop("labels")[:, 1:], (0, 1), value=-100)
            labels[:, :mask] = -100
            batch.update(shift_labels=labels, position_ids=torch.arange(16).repeat(2, 1))
            _forward_sharded(acc, model, batch)

    def recompute_outside():
        ac = _cp_accelerator(activation_checkpointing=True)
        model, batch = ac.prepare(build_model("llama")), _batch()
        buffers = list(batch.values())
        with ac.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
            loss = model(**batch).loss
        loss.backward()

    cases = {
        "seq-len-18": lambda: _forward_sharded(acc, llama(), _batch(18)),
        "no-buffers": lambda: acc.maybe_context_parallel().__enter__(),
        "labels-without-shift_labels": labels_only,
        "custom-4d-mask": custom_mask,
        "input_ids-not-sharded": input_ids_not_sharded,
        "position_ids-decrease": positions_decrease,
        "document-longer-than-max_position_embeddings": document_too_long,
        "attention-dropout": lambda: _forward_sharded(acc, llama(attention_dropout=0.1), _batch()),
        "use_cache": lambda: _forward_sharded(acc, llama(), _batch(), use_cache=True),
        "flex_attention": flex,
        "training-outside-maybe_context_parallel": lambda: llama()(**_batch()),
        "buffers-share-memory": shared_memory,
        "nested": nested,
        "custom-attention-bypassed": bypassed,
        "shift_labels-differ-from-loader-count": mismatched_counts,
        "shift_labels-differ-from-loader-count-later": mismatched_counts_later,
        "backward-recompute-outside": recompute_outside,  # last: leaves that model's backward half done
    }
    return outcomes(cases)


REFUSALS = {
    "seq-len-18": ("ValueError", r"sequence length 18 is not divisible by 2 \* cp_size = 4"),
    "no-buffers": ("ValueError", r"cp_size=2 needs the batch's sequence tensors: pass buffers="),
    "labels-without-shift_labels": ("ValueError", r"the batch has labels but no shift_labels.*pass shift_labels"),
    "custom-4d-mask": ("ValueError", r"attention_mask of shape \(2, 1, 16, 16\) is not a \[batch, seq\] padding "
                                     r"mask of 0s and 1s"),
    "input_ids-not-sharded": ("ValueError", r"input_ids has 16 positions, but this rank's shard of the 16-token "
                                            r"sequence has 8; it was not sharded: list it in maybe_context_parallel"),
    "position_ids-decrease": ("ValueError", r"position_ids of row 0 go from 7 to 5 at position 8; packed sequences "
                                            r"must count up by one within each document and restart at 0"),
    "document-longer-than-max_position_embeddings": ("ValueError", r"a document of 12 tokens in row 0 is longer "
                                                                   r"than the model's max_position_embeddings=8"),
    "attention-dropout": ("ValueError", r"attention dropout 0.1 is not supported"),
    "use_cache": ("ValueError", r"a KV cache \(past_key_values, use_cache=True\) cannot be used"),
    "flex_attention": ("ValueError", r"cp_size=2: LlamaForCausalLM uses attn_implementation='flex_attention'; "
                                     r"context parallelism supports \['sdpa', 'eager'\]"),
    "training-outside-maybe_context_parallel": ("RuntimeError", r"prepared with cp_size=2 and is called in training "
                                                                r"mode outside accelerator.maybe_context_parallel"),
    "buffers-share-memory": ("ValueError", r"two buffers share memory"),
    "nested": ("RuntimeError", r"maybe_context_parallel blocks cannot be nested"),
    "custom-attention-bypassed": ("RuntimeError", r"none of its attention went through ndparallel's"),
    "shift_labels-differ-from-loader-count": ("ValueError", r"shift_labels hold (6|12) loss tokens, but the "
                                                            r"prepared data loader counted (14|16) for this shard"),
    "shift_labels-differ-from-loader-count-later": ("RuntimeError", r"shift_labels hold another number of loss tokens, "
                                                                    r"but the prepared data loader counted (14|16)"),
    "backward-recompute-outside": ("RuntimeError", r"activation checkpointing recomputes attention during backward"),
}


@pytest.fixture(scope="module")
def refusals() -> list[dict]:
    return run_ranks(_refusals, 2, timeout=180)


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_with_a_clear_error(refusals, case):
    assert_refused(refusals, REFUSALS[case], case)
