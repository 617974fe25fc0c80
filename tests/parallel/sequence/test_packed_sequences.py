"""Padded and packed rows under context and sequence parallelism: exact document masking.

Attention alone: every rank builds the same full batch (packed documents that cross shard boundaries and are
shorter than a shard, left padding, right padding that fills whole shards), computes masked attention densely in
fp64 (a query sees the keys of its own document at or before it; padded queries see nothing and output 0), and
compares its shard of the output and of the q/k/v gradients with the sharded attention's. Training: a tiny Llama
trains 6 AdamW steps with clipping on packed rows (the format of transformers' DataCollatorWithFlattening) under
cp 2, cp 4, sp 2 and cp 2 x sp 2 with both strategies, against an independent reference that runs each document
as its own sequence in one process; padded rows against the Hugging Face model's own attention mask in one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import run_ranks
from ndparallel.parallel.sequence import SequenceShards, sequence_parallel_attention
from ndparallel.parallel.sequence.masking import DocumentMask, document_ids

SEQ = 32
DOCS = [[5, 14, 3, 10], [6, 9, 17], [20, 12]]  # row 1: 6 tokens of left padding; row 2: 12 of right padding
PADDING = {1: "left", 2: "right"}


def packed_inputs(seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids, attention_mask) of `DOCS`: positions restart at 0 per document; padding masked."""
    positions, mask = [], []
    for row, lengths in enumerate(DOCS):
        pos = torch.cat([torch.arange(n) for n in lengths])
        m = torch.ones(seq, dtype=torch.long)
        if PADDING.get(row) == "left":  # the first "document" is the padding
            pos = torch.cat([torch.zeros(lengths[0], dtype=torch.long), torch.arange(lengths[1]),
                             torch.arange(lengths[2])])
            m[:lengths[0]] = 0
        elif PADDING.get(row) == "right":  # the last one is
            pos = torch.cat([torch.arange(lengths[0]), torch.zeros(lengths[1], dtype=torch.long)])
            m[lengths[0]:] = 0
        positions.append(pos)
        mask.append(m)
    return torch.stack(positions), torch.stack(mask)


def reference_attention(q, k, v, doc: torch.Tensor, window: int | None = None):
    """Dense masked attention in fp64; rows that see no key give 0."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5
    i, j = torch.arange(q.shape[2]).unsqueeze(-1), torch.arange(q.shape[2]).unsqueeze(0)
    visible = (j <= i) & (doc.unsqueeze(-1) == doc.unsqueeze(1)) & (doc.unsqueeze(1) >= 0)
    if window is not None:
        visible &= i - j < window
    s = s.masked_fill(~visible.unsqueeze(1), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a row with no visible key: all -inf, softmax NaN -> 0
    return p @ vv


def _numbered(row: torch.Tensor) -> list[int]:
    """Document ids renumbered 0, 1, ... in order of appearance (-1, padding, kept): only the partition matters."""
    order: dict[int, int] = {}
    return [-1 if x < 0 else order.setdefault(x, len(order)) for x in row.tolist()]


def test_document_ids_from_packed_and_padded_inputs():
    positions, mask = packed_inputs()
    doc = document_ids(positions, mask, (3, SEQ))
    assert _numbered(doc[0]) == [0] * 5 + [1] * 14 + [2] * 3 + [3] * 10
    assert _numbered(doc[1]) == [-1] * 6 + [0] * 9 + [1] * 17
    assert _numbered(doc[2]) == [0] * 20 + [-1] * 12
    assert document_ids(torch.arange(SEQ).expand(3, SEQ), None, (3, SEQ)) is None  # one document per row
    assert document_ids(None, torch.ones(3, SEQ), (3, SEQ)) is None


def test_block_kinds_skip_what_no_query_sees():
    doc = DocumentMask(torch.tensor([[0] * 8 + [1] * 8]))
    assert doc.kind(slice(8, 16), slice(0, 8), True) == "skip"  # the second document never sees the first
    assert doc.kind(slice(0, 8), slice(0, 8), True) == "causal"  # one document: plain causal
    assert doc.kind(slice(4, 12), slice(0, 4), True) == "masked"
    assert DocumentMask(torch.zeros(1, 16, dtype=torch.long)).kind(slice(8, 16), slice(0, 8), True) == "full"
    assert DocumentMask(None, window=4).kind(slice(8, 16), slice(0, 4), True) == "skip"  # all keys out of the window


def _compare(strategy: str, cp: int, sp: int, window: int | None) -> dict[str, float]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cp_rank, sp_rank = divmod(rank, sp)
    cp_groups = [dist.new_group([c * sp + s for c in range(cp)]) for s in range(sp)]
    sp_groups = [dist.new_group([c * sp + s for s in range(sp)]) for c in range(cp)]
    positions, mask = packed_inputs()
    doc = document_ids(positions, mask, (3, SEQ))
    g = torch.Generator().manual_seed(7)
    q = torch.randn(3, 4, SEQ, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(3, 2, SEQ, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    dout = torch.randn(3, 4, SEQ, 8, generator=g, dtype=torch.float64)
    full = reference_attention(q, k, v, doc, window)
    full.backward(dout)
    shards = SequenceShards.of(SEQ, cp, cp_rank, True, sp, sp_rank)
    local = [shards.shard(t.detach(), 2).clone().requires_grad_() for t in (q, k, v)]
    out = sequence_parallel_attention(*local, shards, cp_group=cp_groups[sp_rank], sp_group=sp_groups[cp_rank],
                                      strategy=strategy, is_causal=True, doc=DocumentMask(doc, window))
    out.backward(shards.shard(dout, 2))
    errors = {"out": (out - shards.shard(full, 2)).abs().max().item()}
    errors.update({f"d{n}": (t.grad - shards.shard(r.grad, 2)).abs().max().item()
                   for n, t, r in zip("qkv", local, (q, k, v))})
    padded = (shards.shard(doc, 1) < 0).unsqueeze(1).unsqueeze(-1)  # [B, 1, local, 1]
    errors["padded rows nonzero"] = float(out.masked_select(padded).abs().sum() + local[0].grad.masked_select(
        padded).abs().sum())
    errors["nan"] = float(any(bool(t.isnan().any()) for t in (out, *[t.grad for t in local])))
    dist.destroy_process_group()
    return errors


@pytest.mark.parametrize("strategy,cp,sp,window", [
    ("ring", 2, 1, None), ("allgather", 2, 1, None), ("ring", 4, 1, None), ("allgather", 1, 2, None),
    ("ring", 2, 2, None), ("allgather", 2, 2, None), ("ring", 2, 1, 5), ("allgather", 1, 2, 5)],
    ids=lambda x: str(x))
def test_sharded_attention_masks_documents_exactly(strategy, cp, sp, window):
    results = run_ranks(_compare, cp * sp, strategy, cp, sp, window, timeout=120)
    worst = {key: max(r[key] for r in results) for key in results[0]}
    assert all(err < 1e-12 for err in worst.values()), worst


def test_the_test_fails_without_the_mask():
    """The reference differs from plain causal attention on these rows, so the comparison above can fail."""
    positions, mask = packed_inputs()
    doc = document_ids(positions, mask, (3, SEQ))
    q, k, v = (torch.randn(3, 4, SEQ, 8, dtype=torch.float64) for _ in range(3))
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (causal - reference_attention(q, k, v, doc)).abs().max() > 0.1


# ---- training: packed rows against each document on its own, padded rows against the model's own mask -------------
STEPS, ROWS, TRAIN_SEQ = 6, 2, 32


def training_rows(kind: str, seq: int = TRAIN_SEQ) -> list[dict[str, torch.Tensor]]:
    """STEPS * ROWS rows of random tokens. "packed": documents of long-tailed lengths (1 to 24 tokens, some crossing
    every shard boundary), labels -100 at each document's first token (DataCollatorWithFlattening's format);
    "padded": one document per row, right padding in even rows, left in odd ones (in step 1 both rows hold 4 real
    tokens, at the two ends: under cp 2 one rank's whole shard is padding),
    labels -100 on padding, an attention mask and positions counting the real tokens."""
    from tiny_models import VOCAB

    g = torch.Generator().manual_seed(99)
    rows = []
    for r in range(STEPS * ROWS):
        ids = torch.randint(0, VOCAB, (seq,), generator=g)
        labels = ids.clone()
        row = {"input_ids": ids}
        if kind == "packed":
            lengths, left = [], seq
            while left:
                n = min(left, int(torch.empty(1).exponential_(1 / 7, generator=g).ceil().clamp(1, 24)))
                lengths.append(n)
                left -= n
            row["position_ids"] = torch.cat([torch.arange(n) for n in lengths])
            labels[row["position_ids"] == 0] = -100
        else:
            real = seq * [32, 12, 4, 4, 31, 17][r % 6] // 32  # step 1: under cp 2, rank 1's whole shard is padding
            mask = torch.zeros(seq, dtype=torch.long)
            if r % 2:
                mask[seq - real:] = 1
            else:
                mask[:real] = 1
            row["attention_mask"] = mask
            row["position_ids"] = (mask.cumsum(0) - 1).clamp(min=0)
            labels[mask == 0] = -100
        row["labels"] = labels
        row["shift_labels"] = F.pad(labels[1:], (0, 1), value=-100)
        rows.append(row)
    return rows


def _reference_losses(kind: str, model_name: str, overrides: dict, seq: int = TRAIN_SEQ) -> list[float]:
    """One process, no library: packed rows as one sequence per document; padded rows with the model's own mask."""
    from tiny_models import build_model

    torch.manual_seed(0)
    model = build_model(model_name, **overrides)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    rows, losses = training_rows(kind, seq), []
    for step in range(STEPS):
        batch = rows[step * ROWS:(step + 1) * ROWS]
        if kind == "packed":
            total, count = 0.0, 0
            for row in batch:
                starts = (row["position_ids"] == 0).nonzero().flatten().tolist() + [seq]
                for a, b in zip(starts, starts[1:]):
                    if b - a < 2:
                        continue  # a one-token document predicts nothing
                    ids = row["input_ids"][a:b].unsqueeze(0)
                    logits = model(input_ids=ids).logits
                    total = total + F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
                    count += b - a - 1
            loss = total / count
        else:
            stacked = {k: torch.stack([row[k] for row in batch]) for k in ("input_ids", "attention_mask",
                                                                            "position_ids", "labels")}
            loss = model(**stacked).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _train(kind: str, flags: dict, strategy: str, model_name: str, overrides: dict,
           seq: int = TRAIN_SEQ) -> tuple[list[float], int]:
    """Losses of the run, and how many batches the prepared loader dealt by attention work."""
    from ndparallel import Accelerator, ParallelismConfig, TorchContextParallelConfig
    from tiny_models import build_model

    flags = dict(flags)
    balance = flags.pop("balance_documents", False)
    acc = Accelerator(parallelism_config=ParallelismConfig(
        **flags, cp_handler=TorchContextParallelConfig(cp_comm_strategy=strategy, balance_documents=balance)))
    torch.manual_seed(0)
    model = build_model(model_name, **overrides)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    data_ranks = flags.get("dp_shard_size", 1) * flags.get("dp_replicate_size", 1)
    loader = torch.utils.data.DataLoader(training_rows(kind, seq), batch_size=ROWS // data_ranks)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    losses, dealt = [], 0
    for batch in loader:
        dealt += acc.gradient_state.batch.sequence_shards is not None
        batch.pop("labels")  # the loss reads shift_labels (shifted before sharding)
        buffers = list(batch.values())
        with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                        no_restore_buffers=set(buffers)):
            loss = model(**batch).loss
            acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(acc.reduce_loss(loss).item())
    acc.end_training()
    return losses, dealt


TRAINING = {  # id -> (rows, world, sizes, strategy, model, model overrides[, row length])
    "packed-cp2-ring": ("packed", 2, {"cp_size": 2}, "ring", "llama", {}),
    "packed-cp2-allgather": ("packed", 2, {"cp_size": 2}, "allgather", "llama", {}),
    "packed-cp4-ring": ("packed", 4, {"cp_size": 4}, "ring", "llama", {}),
    "packed-cp4-allgather": ("packed", 4, {"cp_size": 4}, "allgather", "llama", {}),
    "packed-sp2": ("packed", 2, {"sp_size": 2}, "allgather", "llama", {}),
    "packed-cp2xsp2-allgather": ("packed", 4, {"cp_size": 2, "sp_size": 2}, "allgather", "llama", {}),
    "packed-cp2xsp2-ring": ("packed", 4, {"cp_size": 2, "sp_size": 2}, "ring", "llama", {}),
    "packed-fsdp2xcp2xtp2-ring": ("packed", 8, {"dp_shard_size": 2, "cp_size": 2, "tp_size": 2}, "ring", "llama",
                                  {}),
    "padded-cp2-ring": ("padded", 2, {"cp_size": 2}, "ring", "llama", {}),
    "padded-sp2": ("padded", 2, {"sp_size": 2}, "allgather", "llama", {}),
    "mistral-window16-cp2": ("padded", 2, {"cp_size": 2}, "ring", "mistral", {"sliding_window": 16}),
    "mistral-window16-64-tokens-cp2": ("padded", 2, {"cp_size": 2}, "allgather", "mistral", {"sliding_window": 16},
                                       64),
    # the chunks of each batch dealt over cp by attention work (TorchContextParallelConfig(balance_documents=True))
    "packed-cp4-ring-balanced": ("packed", 4, {"cp_size": 4, "balance_documents": True}, "ring", "llama", {}),
    "packed-cp2xsp2-allgather-balanced": ("packed", 4, {"cp_size": 2, "sp_size": 2, "balance_documents": True},
                                          "allgather", "llama", {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TRAINING))
def test_training_matches_the_single_process_reference(case):
    kind, world, flags, strategy, model_name, overrides, *seq = TRAINING[case]
    seq = seq[0] if seq else TRAIN_SEQ
    expected = _reference_losses(kind, model_name, overrides, seq)
    results = run_ranks(_train, world, kind, flags, strategy, model_name, overrides, seq, timeout=180)
    losses, dealt = results[0]
    assert all(r == results[0] for r in results), "ranks logged different losses"
    gaps = [abs(a - b) for a, b in zip(losses, expected)]
    assert len(gaps) == STEPS and max(gaps) < 1e-5, list(zip(losses, expected))
    assert (dealt > 0) == bool(flags.get("balance_documents")), dealt  # the dealt layout was really used


def test_attention_work_counts_visible_pairs_and_imbalance():
    """Whole causal rows: the load-balanced layout gives every rank the same work, and computes S(S+1)/2 pairs
    per row. Packed rows: only visible pairs are computed (document pieces), and the report shows the imbalance."""
    from ndparallel.parallel.sequence import SequenceChunking
    from ndparallel.parallel.sequence.masking import attention_work

    def chunks(seq, cp):
        return lambda r: SequenceChunking(seq, cp, r).chunk_ids()

    plain = attention_work(DocumentMask(torch.zeros(3, 32, dtype=torch.long)), 32, 4, chunks(32, 4))
    assert sum(w["visible"] for w in plain) == 3 * 32 * 33 // 2 and len({w["visible"] for w in plain}) == 1
    positions, mask = packed_inputs()
    doc = DocumentMask(document_ids(positions, mask, (3, SEQ)))
    work = attention_work(doc, SEQ, 2, chunks(SEQ, 2))
    visible = sum(n * (n + 1) // 2 for row, lengths in enumerate(DOCS) for i, n in enumerate(lengths)
                  if not (PADDING.get(row) == "left" and i == 0) and not (PADDING.get(row) == "right" and i == 1))
    assert sum(w["visible"] for w in work) == visible
    assert all(w["computed"] == w["visible"] for w in work)
    assert max(w["visible"] for w in work) > min(w["visible"] for w in work)  # packed rows are not balanced


# ---- balance: the work of packed rows over cp ranks ---------------------------------------------------------------
UNBALANCED = torch.cat([torch.arange(24), torch.zeros(8, dtype=torch.long)]).unsqueeze(0)  # one long doc, 8 tiny ones


def test_balanced_assignment_evens_out_packed_rows():
    """One 24-token document then eight 1-token ones: under the load-balanced layout (cp 2) rank 1 holds positions
    8-23 and does 264 of the 308 visible pairs (1.71x the mean); the dealt partition is within 1.1x."""
    from ndparallel.parallel.sequence import SequenceChunking
    from ndparallel.parallel.sequence.masking import attention_work, balanced_assignment

    doc = document_ids(UNBALANCED, None, (1, 32))
    default = [w["visible"] for w in attention_work(DocumentMask(doc), 32, 2,
                                                     lambda r: SequenceChunking(32, 2, r).chunk_ids())]
    assert default == [44, 264]
    assignment = balanced_assignment(doc, 2)
    assert sorted(c for chunks in assignment for c in chunks) == list(range(8))
    dealt = [w["visible"] for w in attention_work(DocumentMask(doc), 32, 2,
                                                   lambda r: SequenceChunking(32, 2, r, assignment=assignment)
                                                   .chunk_ids())]
    assert sum(dealt) == 308 and max(dealt) / (sum(dealt) / 2) < 1.1, dealt
    # whole causal rows are already even: nothing to deal
    assert balanced_assignment(torch.zeros(2, 32, dtype=torch.long), 2) is None


def _first_batch_warning() -> list[str]:
    import warnings

    from ndparallel import Accelerator, ParallelismConfig
    from tiny_models import build_model

    acc = Accelerator(parallelism_config=ParallelismConfig(cp_size=2))
    model = acc.prepare(build_model("llama"))
    ids = torch.arange(32).unsqueeze(0) % 50
    batch = {"input_ids": ids, "position_ids": UNBALANCED.clone(),
             "shift_labels": F.pad(ids[:, 1:], (0, 1), value=-100)}
    buffers = list(batch.values())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1]):
            model(**batch)
    acc.end_training()
    return [str(w.message) for w in caught if "attention work" in str(w.message)]


def test_unbalanced_packed_rows_are_reported_with_the_remedy():
    messages = run_ranks(_first_batch_warning, 2)
    assert len(messages[0]) == 1 and not messages[1]  # said once, by cp rank 0
    assert "1.71x the mean attention work" in messages[0][0] and "balance_documents=True" in messages[0][0]
