"""How a sequence is split over the ranks of ``cp`` (and ``sp``): which positions each rank holds.

Context parallelism (`SequenceChunking`). A sequence of S tokens is cut into equal chunks:
- load-balanced (default): 2*cp chunks of S/(2*cp); rank r holds chunks r and 2*cp-1-r, in that order. Under a
  causal mask, chunk c attends to c+1 chunks' worth of keys, so every rank gets the same amount of work
  (r+1 + 2*cp-r = 2*cp+1 chunk pairs);
- contiguous: cp chunks of S/cp; rank r holds chunk r (the last rank does cp times the work of the first);
- assigned: any equal number of equal chunks per rank, given as data (`assignment`) -- the document-balanced
  partition of packed rows (`masking.balanced_assignment`) is one.
A rank's local rows are its chunks concatenated; `SequenceChunking.positions` gives their global positions.

With Ulysses sequence parallelism as well (cp x sp), `SequenceShards` cuts each cp rank's shard into sp contiguous
pieces; after Ulysses' all-to-all each rank holds its cp rank's whole shard again, in the order context-parallel
attention expects. Nothing here communicates: every function is pure arithmetic on lengths and indices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...distributed.layout import load_balanced_chunks


@dataclass(frozen=True)
class SequenceChunking:
    """How one sequence of `seq_len` tokens is split over the `size` ranks of a group; `rank` is this rank's index.

    Raises ValueError when `seq_len` does not split into equal chunks, before anything is communicated.
    """

    seq_len: int
    size: int
    rank: int
    load_balance: bool = True
    assignment: tuple[tuple[int, ...], ...] | None = None  # chunk ids of each rank; overrides load_balance

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.size}")
        if self.assignment is not None:
            ids = sorted(c for chunks in self.assignment for c in chunks)
            if len(self.assignment) != self.size or len({len(c) for c in self.assignment}) != 1 or ids != list(
                    range(len(ids))):
                raise ValueError(f"a chunk assignment gives each of the {self.size} ranks the same number of the "
                                 f"chunks 0..n-1, once each; got {self.assignment}")
        if self.seq_len < 1:
            raise ValueError(f"context parallelism needs sequences of at least one token, got length {self.seq_len}")
        if self.seq_len % self.num_chunks:
            if self.assignment is not None:
                raise ValueError(f"sequence length {self.seq_len} does not split into the assignment's "
                                 f"{self.num_chunks} equal chunks")
            if self.load_balance:
                raise ValueError(
                    f"sequence length {self.seq_len} is not divisible by 2 * cp_size = {self.num_chunks}: the "
                    f"load-balanced context-parallel layout cuts each sequence into {self.num_chunks} equal chunks. "
                    f"Pad or cut sequences to a multiple of {self.num_chunks}, or use "
                    f"TorchContextParallelConfig(load_balance=False), which needs a multiple of {self.size}"
                )
            raise ValueError(
                f"sequence length {self.seq_len} is not divisible by cp_size = {self.size}: context parallelism "
                f"gives each rank an equal share. Pad or cut sequences to a multiple of {self.size}"
            )

    @property
    def num_chunks(self) -> int:
        if self.assignment is not None:
            return sum(len(c) for c in self.assignment)
        return load_balanced_chunks(self.size, self.load_balance)

    @property
    def chunk_len(self) -> int:
        return self.seq_len // self.num_chunks

    @property
    def local_len(self) -> int:
        return self.seq_len // self.size

    def chunk_ids(self, rank: int | None = None) -> tuple[int, ...]:
        """Global indices of the chunks `rank` (default: this rank) holds, in local order."""
        r = self.rank if rank is None else rank
        if self.assignment is not None:
            return self.assignment[r]
        return (r, self.num_chunks - 1 - r) if self.load_balance else (r,)

    def chunks(self, rank: int | None = None) -> list[tuple[int, int]]:
        """Global ``[start, end)`` of each chunk `rank` holds, in local order."""
        n = self.chunk_len
        return [(c * n, (c + 1) * n) for c in self.chunk_ids(rank)]

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of this rank's local rows (a LongTensor of `local_len`)."""
        return torch.cat([torch.arange(s, e, device=device) for s, e in self.chunks()])

    def shard(self, x: torch.Tensor, dim: int, rank: int | None = None) -> torch.Tensor:
        """`rank`'s part of a full-sequence tensor along `dim` (a new tensor when there are several chunks)."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"expected {self.seq_len} positions along dim {dim}, got shape {tuple(x.shape)}")
        parts = [x.narrow(dim, s, e - s) for s, e in self.chunks(rank)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    def unshard(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """The full-sequence tensor from every rank's local part (``parts[r]`` is rank r's), in global order."""
        n = self.chunk_len
        pieces: list[torch.Tensor | None] = [None] * self.num_chunks
        for r, part in enumerate(parts):
            for j, c in enumerate(self.chunk_ids(r)):
                pieces[c] = part.narrow(dim, j * n, n)
        return torch.cat(pieces, dim)  # type: ignore[arg-type]


@dataclass(frozen=True)
class SequenceShards:
    """A sequence sharded over ``cp x sp`` (Ulysses inside context parallelism, "unified sequence parallel").

    `cp` says which tokens this rank's cp rank holds (`SequenceChunking`, load-balanced or not); the ``sp`` ranks of
    that cp rank split its shard into `sp_size` contiguous pieces, sp rank s holding piece s. Ulysses' all-to-all
    over ``sp`` concatenates the pieces in sp order, so after it each rank holds its cp rank's whole shard, in the
    order context-parallel attention expects. With ``sp_size=1`` this is `cp` itself; with ``cp.size=1``, plain
    Ulysses (each sp rank a contiguous 1/sp of the sequence). Raises ValueError when the length does not split.
    """

    cp: SequenceChunking
    sp_size: int = 1
    sp_rank: int = 0

    def __post_init__(self) -> None:
        if self.sp_size < 1 or not 0 <= self.sp_rank < self.sp_size:
            raise ValueError(f"rank {self.sp_rank} is not in a group of {self.sp_size}")
        if self.cp.local_len % self.sp_size:
            need = self.cp.size * self.sp_size
            if (self.cp.load_balance or self.cp.assignment is not None) and self.cp.size > 1:
                need = math.lcm(need, self.cp.num_chunks)
            raise ValueError(
                f"sequence length {self.seq_len} does not split over cp_size={self.cp.size} x "
                f"sp_size={self.sp_size}: each cp rank's {self.cp.local_len} tokens must split into {self.sp_size} "
                f"equal sequence-parallel pieces. Pad or cut sequences to a multiple of {need}"
            )

    @classmethod
    def of(cls, seq_len: int, cp_size: int = 1, cp_rank: int = 0, load_balance: bool = True, sp_size: int = 1,
           sp_rank: int = 0) -> SequenceShards:
        return cls(SequenceChunking(seq_len, cp_size, cp_rank, load_balance and cp_size > 1), sp_size, sp_rank)

    @property
    def seq_len(self) -> int:
        return self.cp.seq_len

    @property
    def size(self) -> int:
        return self.cp.size * self.sp_size

    @property
    def local_len(self) -> int:
        return self.cp.local_len // self.sp_size

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of this rank's local rows."""
        return self.cp.positions(device).narrow(0, self.sp_rank * self.local_len, self.local_len)

    def shard(self, x: torch.Tensor, dim: int, sp_rank: int | None = None) -> torch.Tensor:
        """This rank's part (sp rank `sp_rank`, default this one, of this cp rank) of a full-sequence tensor."""
        s = self.sp_rank if sp_rank is None else sp_rank
        return self.cp.shard(x, dim).narrow(dim, s * self.local_len, self.local_len)
