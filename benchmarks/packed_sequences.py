"""Packed against padded rows under context parallelism: attention work per rank, pairs computed against pairs
visible, and attention step time on the same tokens. Prints one table; writes it and the raw figures to --out.

    python benchmarks/packed_sequences.py [--row-len 8192] [--cp 2 4] [--docs 48] [--out bench_out]

Documents have long-tailed lengths (log-normal, median --median-doc tokens, clipped to [8, row length]), drawn once
with a fixed seed. *Packed*: documents concatenated into rows of --row-len tokens (a document that does not fit is
cut, its rest starting the next row as a document of its own; a last row that is not full is dropped), positions
restarting at 0 per document; *packed, dealt*: the same rows with each batch's 4*cp chunks dealt over the ranks by
attention work (`TorchContextParallelConfig(balance_documents=True)`, `masking.balanced_assignment`). *Padded*:
the same documents (the same tokens) one per row, right-padded to the longest (rounded up so the cp layout splits
it), in batches of --pad-batch rows. All feed `sequence_parallel_attention` with the ring strategy on forked gloo
ranks (fp32, 4 query / 2 K/V heads, head dim 32): forward + backward, median of --repeats.

*Computed pairs*: query-key scores the kernels evaluate (a skipped block none, a causal block half its square, a
full or masked block all of it: `masking.attention_work`); *visible pairs*: those the mask allows (the work an exact
variable-length kernel would do). *Imbalance*: per batch, the busiest rank's visible pairs over the mean (a
step waits for its busiest rank), averaged over the batches; the worst batch's in brackets.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import write_results  # noqa: E402

from ndparallel.test_utils import run_ranks  # noqa: E402


def document_lengths(count: int, median: int, row_len: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    draws = torch.empty(count).log_normal_(mean=float(torch.tensor(median).log()), std=1.0, generator=g)
    return [int(x) for x in draws.round().clamp(8, row_len)]


def packed_rows(lengths: list[int], row_len: int) -> list[list[int]]:
    """Each row's document lengths (summing to row_len; the last row may be short and is dropped)."""
    rows, row, left = [], [], row_len
    for n in lengths:
        while n:
            take = min(n, left)
            row.append(take)
            n, left = n - take, left - take
            if left == 0:
                rows.append(row)
                row, left = [], row_len
    return rows


def batches(kind: str, lengths: list[int], row_len: int, cp: int, pad_batch: int) -> list[dict]:
    """[{"position_ids", "attention_mask" (padded only), "dealt", "tokens"}] batches of one kind."""
    out = []
    rows = packed_rows(lengths, row_len)
    if kind.startswith("packed"):
        for row in rows:
            out.append({"position_ids": torch.cat([torch.arange(n) for n in row]).unsqueeze(0), "attention_mask": None,
                        "dealt": kind == "packed, dealt", "tokens": sum(row)})
        return out
    lengths = [n for row in rows for n in row]  # the packed rows' documents: the same tokens
    from ndparallel.distributed.layout import load_balanced_chunks

    multiple = load_balanced_chunks(cp)
    for i in range(0, len(lengths), pad_batch):
        group = lengths[i:i + pad_batch]
        width = -(-max(group) // multiple) * multiple
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for r, n in enumerate(group):
            mask[r, :n] = 1
        out.append({"position_ids": (mask.cumsum(-1) - 1).clamp(min=0), "attention_mask": mask, "dealt": False,
                    "tokens": sum(group)})
    return out


def _time_attention(kind_batches: list[dict], repeats: int) -> float:
    """Seconds per pass over all batches (forward + backward), median of `repeats`; on every rank."""
    import torch.distributed as dist

    from ndparallel.parallel.sequence import SequenceChunking, SequenceShards, sequence_parallel_attention
    from ndparallel.parallel.sequence.masking import DocumentMask, document_ids

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cp, rank = dist.get_world_size(), dist.get_rank()
    prepared = []
    for b in kind_batches:
        rows, seq = b["position_ids"].shape
        doc = document_ids(b["position_ids"], b["attention_mask"], (rows, seq))
        shards = SequenceShards(SequenceChunking(seq, cp, rank, assignment=assignment(b, cp)))
        g = torch.Generator().manual_seed(seq)
        q = torch.randn(rows, 4, shards.local_len, 32, generator=g)
        k, v = (torch.randn(rows, 2, shards.local_len, 32, generator=g) for _ in range(2))
        prepared.append((shards, DocumentMask(doc), q, k, v))
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        for shards, doc, q, k, v in prepared:
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = sequence_parallel_attention(*leaves, shards, cp_group=dist.group.WORLD, strategy="ring", doc=doc)
            out.sum().backward()
        dist.barrier()
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    return statistics.median(times[1:])


def assignment(batch: dict, cp: int):
    """The dealt chunks of a "packed, dealt" batch (None: the load-balanced layout)."""
    from ndparallel.parallel.sequence.masking import balanced_assignment, document_ids

    if not batch["dealt"]:
        return None
    rows, seq = batch["position_ids"].shape
    return balanced_assignment(document_ids(batch["position_ids"], batch["attention_mask"], (rows, seq)), cp)


def work(kind_batches: list[dict], cp: int) -> dict:
    from ndparallel.parallel.sequence import SequenceChunking
    from ndparallel.parallel.sequence.masking import DocumentMask, attention_work, document_ids

    per_rank = [{"computed": 0, "visible": 0} for _ in range(cp)]
    per_batch = []  # each step waits for its busiest rank: the imbalance that costs time is per batch
    for b in kind_batches:
        rows, seq = b["position_ids"].shape
        doc = DocumentMask(document_ids(b["position_ids"], b["attention_mask"], (rows, seq)))
        dealt = assignment(b, cp)
        for r, w in enumerate(attention_work(doc, seq, cp, lambda rank: SequenceChunking(
                seq, cp, rank, assignment=dealt).chunk_ids())):
            per_rank[r]["computed"] += w["computed"]
            per_rank[r]["visible"] += w["visible"]
            per_batch.append((len(per_batch) // cp, w["visible"]))
    batches_visible: dict[int, list[int]] = {}
    for index, visible in per_batch:
        batches_visible.setdefault(index, []).append(visible)
    ratios = [max(v) / max(1e-9, statistics.mean(v)) for v in batches_visible.values()]
    visible = [w["visible"] for w in per_rank]
    computed = sum(w["computed"] for w in per_rank)
    return {"per_rank": per_rank, "computed": computed, "visible": sum(visible),
            "computed_over_visible": computed / max(1, sum(visible)),
            "imbalance": statistics.mean(ratios), "worst_imbalance": max(ratios)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--row-len", type=int, default=8192)
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--docs", type=int, default=48)
    p.add_argument("--median-doc", type=int, default=600)
    p.add_argument("--pad-batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    args = p.parse_args(argv)
    lengths = document_lengths(args.docs, args.median_doc, args.row_len)
    results = []
    for cp in args.cp:
        row = {"cp": cp}
        for kind in ("packed", "packed, dealt", "padded"):
            kb = batches(kind, lengths, args.row_len, cp, args.pad_batch)
            tokens = sum(b["tokens"] for b in kb)
            seconds = run_ranks(_time_attention, cp, kb, args.repeats, timeout=1800)[0]
            row[kind] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, **work(kb, cp)}
            print(f"cp {cp} {kind}: {tokens} tokens, {seconds:.2f} s, computed/visible "
                  f"{row[kind]['computed_over_visible']:.2f}, imbalance {row[kind]['imbalance']:.2f}", flush=True)
        results.append(row)
    lines = [f"Packed vs padded, {len(lengths)} documents (median {args.median_doc} tokens, log-normal), rows of "
             f"{args.row_len} tokens; attention forward + backward, ring, fp32, forked gloo ranks on this CPU", "",
             "| cp | layout | tokens | tokens/s | tokens/s / padded's | pairs computed (M) | visible (M) | "
             "computed/visible | imbalance (max/mean) |", "|---|---|---|---|---|---|---|---|---|"]
    for row in results:
        for kind in ("packed", "packed, dealt", "padded"):
            r = row[kind]
            speed = r["tokens_per_s"] / row["padded"]["tokens_per_s"]
            lines.append(f"| {row['cp']} | {kind} | {r['tokens']} | {r['tokens_per_s']:,.0f} | "
                         f"{speed:.2f} | {r['computed'] / 1e6:.1f} | {r['visible'] / 1e6:.1f} | "
                         f"{r['computed_over_visible']:.2f} | {r['imbalance']:.2f} ({r['worst_imbalance']:.2f}) |")
    table = "\n".join(lines) + "\n"
    return write_results(args.out, "packed_sequences", table, {"lengths": lengths, "results": results}, show=True)


if __name__ == "__main__":
    main()
