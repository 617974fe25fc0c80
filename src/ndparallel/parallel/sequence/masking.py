"""Which keys each query may see in a padded or packed batch: one description per batch, blocks derived from it.

Real fine-tuning batches are padded (a 2-D ``attention_mask`` with zeros at padded positions, left or right) or
packed (several documents per row, ``position_ids`` restarting at 0 where each document begins, as transformers'
``DataCollatorWithFlattening`` produces). Both are described by one integer per token, its *document*: tokens of
one document share an id, and padded tokens get -1. Query i sees key j when

    doc[i] == doc[j] >= 0,   j <= i (causal attention),   i - j < window (a sliding window, if any),

with i, j positions in the row. `DocumentMask` holds the ids of the whole (unsharded) batch, computed once per
batch from the full-sequence inputs; context-parallel attention asks it, per block of (query positions, key
positions), whether the block is skipped (no visible pair), needs no mask (every pair visible, or exactly the causal
pairs: the fused kernels run it), or needs the dense mask (the math kernel gets it). Block kinds are cached; masks
are built from the ids where used, on the tensors' device. A query that sees no key at all (padding) gets output 0,
log-sum-exp -inf and no gradient (`kernels`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...distributed.layout import load_balanced_chunks

SKIP, FULL, CAUSAL, MASKED = "skip", "full", "causal", "masked"


def document_ids(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                 shape: tuple[int, int]) -> torch.Tensor | None:
    """[batch, seq] document ids from full-sequence inputs, or None when every row is one whole document.

    A document begins where ``position_ids`` restart at 0 (and at position 0 of a row); padded positions
    (``attention_mask == 0``) are -1. Raises ValueError for inputs this description cannot express exactly: a
    mask that is not 2-D 0/1 padding, or positions that decrease without restarting at 0.
    """
    batch, seq = shape
    if attention_mask is not None and (attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, seq) or not
                                       bool(((attention_mask == 0) | (attention_mask == 1)).all())):
        raise ValueError(
            f"context parallelism: attention_mask of shape {tuple(attention_mask.shape)} is not a [batch, seq] "
            "padding mask of 0s and 1s; sharded attention honours padding (2-D masks) and packed documents "
            "(position_ids restarting at 0), not custom masks")
    ids = None
    if position_ids is not None:
        pos = (position_ids if position_ids.dim() == 2 else position_ids.unsqueeze(0)).expand(batch, seq)
        step = torch.diff(pos, dim=-1)
        restart = pos[:, 1:] == 0
        bad = ~((step == 1) | restart)
        if attention_mask is not None:  # positions under padding are whatever the collator put there
            real = attention_mask.bool()
            bad &= real[:, 1:] & real[:, :-1]
            restart &= real[:, 1:]
        if bool(bad.any()):
            row, col = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"context parallelism: position_ids of row {row} go from {int(pos[row, col])} to "
                f"{int(pos[row, col + 1])} at position {col + 1}; packed sequences must count up by one within each "
                "document and restart at 0 where the next begins (as DataCollatorWithFlattening gives them)")
        if bool(restart.any()):
            ids = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=pos.device),
                             restart.long().cumsum(-1)], dim=-1)
    if attention_mask is not None:
        if not bool(attention_mask.bool().all()):
            base = torch.zeros(batch, seq, dtype=torch.long, device=attention_mask.device) if ids is None else ids
            ids = torch.where(attention_mask.bool(), base.to(attention_mask.device), -1)
    return ids


def check_document_lengths(doc: torch.Tensor, limit: int | None, where: str) -> None:
    """Refuse documents longer than the model's `limit` (``max_position_embeddings``)."""
    if limit is None:
        return
    for row in range(doc.shape[0]):
        ids, counts = torch.unique_consecutive(doc[row], return_counts=True)
        counts = counts[ids >= 0]
        if counts.numel() and int(counts.max()) > limit:
            raise ValueError(f"{where}: a document of {int(counts.max())} tokens in row {row} is longer than the "
                             f"model's max_position_embeddings={limit}")


@dataclass
class DocumentMask:
    """The visibility of a batch's tokens (see the module docstring). `doc`: [batch, seq] ids, -1 for padding (None:
    every row one document); `window`: a sliding window or None."""

    doc: torch.Tensor | None
    window: int | None = None
    _kinds: dict = field(default_factory=dict, repr=False)
    _cpu: torch.Tensor | None = field(default=None, repr=False)

    @property
    def trivial(self) -> bool:
        return self.doc is None and self.window is None

    def with_window(self, window: int | None) -> DocumentMask:
        """The same documents with a sliding window (layers may differ); shares nothing that depends on it."""
        return self if window == self.window else DocumentMask(self.doc, window, _cpu=self._cpu)

    def block(self, queries: slice, keys: slice, causal: bool, device: torch.device | None = None) -> BlockMask:
        """The visibility of a block of query and key positions, computed tile by tile where used."""
        doc = self.doc
        if doc is not None and device is not None and doc.device != device:
            doc = doc.to(device)
        return BlockMask(None if doc is None else doc[:, queries], None if doc is None else doc[:, keys],
                         queries.start, keys.start, keys.stop - keys.start, causal, self.window)

    def pieces(self, queries: slice, keys: slice, causal: bool) -> list[tuple[slice, slice, slice, bool]] | None:
        """One unmasked piece ``(rows, query range, key range, causal)`` per (row, document) of a block of a batch
        without a sliding window, ranges relative to the block; None when some document's piece would still need a
        mask (then the block is computed masked). Cached per block."""
        key = ("pieces", queries.start, queries.stop, keys.start, keys.stop, causal)
        if key not in self._kinds:
            self.kind(queries, keys, causal)  # fills the CPU copy
            out: list | None = []
            cpu = self._cpu
            for b in range(cpu.shape[0]):
                dq, dk = cpu[b, queries], cpu[b, keys]
                for d in torch.unique(dq[dq >= 0]).tolist():
                    seg = _segment(dq, dk, d)
                    if seg is None:
                        continue
                    (qa, qb), (ka, kb) = (seg[0].start, seg[0].stop), (seg[1].start, seg[1].stop)
                    first_q, last_k = queries.start + qa, keys.start + kb - 1
                    if not causal or last_k <= first_q:
                        flag = False  # every key at or before every query: all visible
                    elif (queries.start + qa, qb - qa) == (keys.start + ka, kb - ka):
                        flag = True  # the same positions: exactly causal
                    else:
                        out = None
                        break
                    out.append((slice(b, b + 1), seg[0], seg[1], flag))
                if out is None:
                    break
            self._kinds[key] = out
        return self._kinds[key]

    def kind(self, queries: slice, keys: slice, causal: bool) -> str:
        """SKIP, FULL (every pair visible), CAUSAL (exactly the pairs with key <= query, on a square block whose
        keys and queries are the same positions) or MASKED, for a block of query and key positions."""
        key = (queries.start, queries.stop, keys.start, keys.stop, causal)
        if key not in self._kinds:
            if self._cpu is None and self.doc is not None:
                self._cpu = self.doc.cpu()
            block = DocumentMask(self._cpu, self.window).block(queries, keys, causal)
            visible = block.rows(torch.arange(queries.stop - queries.start))
            square = queries == keys
            if not bool(visible.any()):
                kind = SKIP
            elif bool(visible.all()):
                kind = FULL
            elif square and causal and torch.equal(visible, torch.ones_like(visible).tril()):
                kind = CAUSAL
            else:
                kind = MASKED
            self._kinds[key] = kind
        return self._kinds[key]



@dataclass(frozen=True)
class BlockMask:
    """Which keys the queries of one block see; `rows` gives it for some of the block's queries, so the math
    kernel never holds more of it than one tile of scores."""

    doc_q: torch.Tensor | None  # [batch, queries] document ids of the block's queries (None: one document per row)
    doc_k: torch.Tensor | None  # [batch, keys]
    first_query: int  # position of the block's first query in the row
    first_key: int
    keys: int
    causal: bool
    window: int | None

    def rows(self, offsets: torch.Tensor) -> torch.Tensor:
        """[batch (or 1), 1, len(offsets), keys] bool: query ``first_query + offset`` sees key ``first_key + j``."""
        qi = (self.first_query + offsets).unsqueeze(-1)
        kj = self.first_key + torch.arange(self.keys, device=offsets.device).unsqueeze(0)
        visible = torch.ones(qi.shape[0], self.keys, dtype=torch.bool, device=offsets.device)
        if self.causal:
            visible &= kj <= qi
        if self.window is not None:
            visible &= qi - kj < self.window
        if self.doc_q is None or self.doc_k is None:
            return visible.expand(1, 1, *visible.shape)
        dq, dk = self.doc_q[:, offsets].unsqueeze(-1), self.doc_k.unsqueeze(1)
        return ((dq == dk) & (dk >= 0) & visible).unsqueeze(1)


ALL = slice(None)


def _segment(dq: torch.Tensor, dk: torch.Tensor, d: int) -> tuple[slice, slice] | None:
    """The (query, key) index ranges of document `d` in a block's row (documents are contiguous runs)."""
    qi, ki = (dq == d).nonzero().flatten(), (dk == d).nonzero().flatten()
    if not qi.numel() or not ki.numel():
        return None
    return slice(int(qi[0]), int(qi[-1]) + 1), slice(int(ki[0]), int(ki[-1]) + 1)


def plan_block(doc: DocumentMask | None, queries: slice, keys: slice, causal_block: bool, causal: bool,
               device: torch.device) -> list[tuple[slice, slice, slice, bool, BlockMask | None]]:
    """How to compute the block of `queries` x `keys` (positions in the row): a list of pieces ``(rows, query
    range, key range, causal flag for the kernel, mask or None)``, ranges relative to the block; empty to skip it.

    Without a document mask, the block itself (`causal_block`: a causal diagonal block or a full one). With one:
    nothing for a block no query sees; the block unmasked when every pair is visible or exactly the causal ones;
    otherwise, without a sliding window, one unmasked piece per (row, document) -- a document's queries against
    that document's keys are all visible, or exactly causal on the diagonal -- so the fused kernels compute just the
    visible pairs; with a window (or a piece that would need one), the block with its mask."""
    whole = (ALL, slice(0, queries.stop - queries.start), slice(0, keys.stop - keys.start))
    if doc is None or doc.trivial:
        return [(*whole, causal_block, None)]
    kind = doc.kind(queries, keys, causal)
    if kind == SKIP:
        return []
    if kind in (FULL, CAUSAL):
        return [(*whole, kind == CAUSAL, None)]
    pieces = doc.pieces(queries, keys, causal) if doc.window is None else None
    if pieces is None:
        return [(*whole, False, doc.block(queries, keys, causal, device))]
    return [(rows, q, k, flag, None) for rows, q, k, flag in pieces]


def attention_work(doc: DocumentMask, seq_len: int, cp_size: int, chunk_ids, causal: bool = True) -> list[dict]:
    """Per cp rank, the query-key pairs its attention computes and the ones that are visible, for a batch described
    by `doc`: ``[{"computed": ..., "visible": ...}, ...]``. `chunk_ids(rank)` gives the chunks a rank holds (as
    `SequenceChunking.chunk_ids`), of ``seq_len / number of chunks`` positions each. A skipped block computes nothing,
    a causal one half its square (with the diagonal), full and masked ones all their pairs (the masked kernel scores
    the whole block). Pure arithmetic, for reports and benchmarks: nothing is communicated."""
    chunks = sorted(c for r in range(cp_size) for c in chunk_ids(r))
    n = seq_len // len(chunks)
    rows_total = 1 if doc.doc is None else doc.doc.shape[0]
    out = []
    for r in range(cp_size):
        computed = visible = 0
        for qc in chunk_ids(r):
            q = slice(qc * n, (qc + 1) * n)
            for kc in chunks:
                if causal and kc > qc:
                    continue
                k = slice(kc * n, (kc + 1) * n)
                for rows, qs, ks, flag, _ in plan_block(doc, q, k, causal and kc == qc, causal, None):
                    count = rows_total if rows == ALL else 1
                    nq, nk = qs.stop - qs.start, ks.stop - ks.start
                    computed += count * (nq * (nq + 1) // 2 if flag else nq * nk)
                if doc.kind(q, k, causal) != SKIP:
                    visible += int(doc.block(q, k, causal).rows(torch.arange(n)).sum()) * (
                        rows_total if doc.doc is None else 1)
        out.append({"computed": computed, "visible": visible})
    return out


def chunk_work(doc: torch.Tensor, num_chunks: int) -> list[int]:
    """Causal attention work of each of `num_chunks` equal chunks of the rows: the visible (query, key) pairs of
    its queries -- a query at offset t of its document sees t + 1 keys, a padded one none -- summed over rows."""
    rows, seq = doc.shape
    start = torch.zeros_like(doc)
    new = torch.ones_like(doc, dtype=torch.bool)
    new[:, 1:] = doc[:, 1:] != doc[:, :-1]
    index = torch.arange(seq).expand(rows, seq)
    start = torch.where(new, index, torch.zeros_like(index)).cummax(dim=1).values  # first position of the document
    keys = torch.where(doc >= 0, index - start + 1, torch.zeros_like(index))
    return [int(x) for x in keys.sum(0).view(num_chunks, seq // num_chunks).sum(1)]


def balanced_assignment(doc: torch.Tensor, cp_size: int, chunks_per_rank: int = 4
                        ) -> tuple[tuple[int, ...], ...] | None:
    """A document-aware partition of packed or padded rows over `cp_size` ranks: ``cp_size * chunks_per_rank``
    equal chunks, each rank the same number, dealt so that the ranks' causal attention work (`chunk_work`) is as
    even as a greedy deal makes it (heaviest chunk first, to the least loaded rank with room). None when the rows
    do not split into that many chunks, or when the deal is no more even than the load-balanced layout."""
    seq = doc.shape[1]
    n = cp_size * chunks_per_rank
    halves_count = load_balanced_chunks(cp_size)
    if seq % n or seq % halves_count:
        return None
    work = chunk_work(doc, n)
    load, ranks = [0] * cp_size, [[] for _ in range(cp_size)]
    for c in sorted(range(n), key=lambda c: (-work[c], c)):
        r = min((r for r in range(cp_size) if len(ranks[r]) < chunks_per_rank), key=lambda r: (load[r], r))
        ranks[r].append(c)
        load[r] += work[c]
    halves = chunk_work(doc, halves_count)
    default = [halves[r] + halves[halves_count - 1 - r] for r in range(cp_size)]
    if max(load) >= max(default):
        return None
    return tuple(tuple(sorted(chunks)) for chunks in ranks)
