"""This rank's part in sequence sharding over ``cp x sp``, built once, and the state attention reads while sequences
are sharded.

`SequenceSharding` is the one place that knows the geometry: built from the mesh and the
`TorchContextParallelConfig` when the Accelerator starts, it gives the shards of a sequence length (`shards`,
`positions`), counts the loss tokens of this rank's shard for the data loader (`count_loss_tokens`), shards buffers in
place for ``Accelerator.maybe_context_parallel`` (`sharded`), and computes attention over the shards (`attend`).

While a `sharded` block is open, the process-wide `active()` state says so, and `context_parallel_attention` -- the
entry point of every model's attention -- computes exact attention over the whole sequence. Why a process-wide state
rather than an argument: transformers calls a registered attention function by name, with no handle to ndparallel
objects, and autograd may run backward (and activation-checkpoint recomputation) on another thread, where context
variables are not visible. Only `SequenceSharding.sharded` sets it, for the duration of one ``with`` block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...configuration.handlers import TorchContextParallelConfig
from ...training.loss import count_loss_tokens
from ...distributed.layout import sequence_divisor
from ...distributed.mesh import ParallelMesh
from .attention import sequence_parallel_attention
from .positions import SequenceChunking, SequenceShards
from .masking import DocumentMask, balanced_assignment, document_ids


def describe_sizes(cp_size: int, sp_size: int) -> str:
    """The sizes that shard sequences, for messages: "cp_size=2", "sp_size=2", "cp_size=2 x sp_size=2"."""
    return " x ".join(f"{axis}_size={n}" for axis, n in (("cp", cp_size), ("sp", sp_size)) if n > 1) or "cp_size=1"


@dataclass(frozen=True)
class SequenceSharding:
    """This rank's coordinates and groups on ``cp`` and ``sp``, and how it attends over sharded sequences."""

    cp_size: int = 1
    cp_rank: int = 0
    sp_size: int = 1
    sp_rank: int = 0
    load_balance: bool = True
    strategy: str = "allgather"  # a key of `CP_ATTENTION` (validated by TorchContextParallelConfig)
    cp_group: dist.ProcessGroup | None = None
    sp_group: dist.ProcessGroup | None = None
    balance_documents: bool = False  # deal packed rows' chunks over cp by attention work (`plan`)
    head_chunks: int | str | None = None  # Ulysses over groups of heads (`MemoryKwargs.ulysses_head_chunks`)

    @classmethod
    def from_mesh(cls, mesh: ParallelMesh, handler: TorchContextParallelConfig,
                  head_chunks: int | str | None = None) -> SequenceSharding | None:
        """This rank's sharding on `mesh`, with the settings of `handler` and Ulysses' `head_chunks`; None without CP
        or SP."""
        cp, sp = mesh.size("cp"), mesh.size("sp")
        if cp == 1 and sp == 1:
            return None
        return cls(cp, mesh.rank("cp"), sp, mesh.rank("sp"), handler.load_balance, handler.cp_comm_strategy,
                   mesh.group("cp") if cp > 1 else None, mesh.group("sp") if sp > 1 else None,
                   handler.balance_documents, head_chunks)

    @property
    def sizes(self) -> str:
        return describe_sizes(self.cp_size, self.sp_size)

    def shards(self, seq_len: int) -> SequenceShards:
        """Which positions of a `seq_len`-token sequence this rank holds; ValueError when the length does not split."""
        return SequenceShards.of(seq_len, self.cp_size, self.cp_rank, self.load_balance, self.sp_size, self.sp_rank)

    def fitting_length(self, seq_len: int) -> int:
        """The shortest length >= `seq_len` that splits over these ranks (`Layout.sequence_divisor` at most away)."""
        for length in range(seq_len, seq_len + sequence_divisor(self.cp_size, self.sp_size) + 1):
            try:
                self.shards(length)
                return length
            except ValueError:
                continue
        raise ValueError(f"no sequence length from {seq_len} splits over {self.sizes}")

    def plan(self, batch: Any) -> SequenceShards | None:
        """The shards of `batch` when they depend on the batch: with ``balance_documents``, packed or padded rows
        (``position_ids`` restarting at 0, a 2-D ``attention_mask``) whose chunks deal more evenly over cp by
        attention work than the load-balanced chunks (`masking.balanced_assignment`); else None (the default).
        The same on every rank of cp and sp: it reads only the whole batch."""
        if not self.balance_documents or self.cp_size == 1 or not isinstance(batch, Mapping):
            return None
        positions, mask = batch.get("position_ids"), batch.get("attention_mask")
        ids = batch.get("input_ids", batch.get("shift_labels"))
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or (positions is None and mask is None):
            return None
        try:
            doc = document_ids(positions, mask, tuple(ids.shape))
        except ValueError:
            return None  # the model's input check says what is wrong, at the first forward
        if doc is None:
            return None
        assignment = balanced_assignment(doc.cpu(), self.cp_size)
        if assignment is None:
            return None
        chunking = SequenceChunking(ids.shape[1], self.cp_size, self.cp_rank, assignment=assignment)
        return SequenceShards(chunking, self.sp_size, self.sp_rank)

    def count_loss_tokens(self, batch: Any) -> int | None:
        """Loss tokens of this rank's shard of `batch` (`ndparallel.training.loss.count_loss_tokens`): what its loss
        averages over. None when the batch has no labels, or a length that does not split (such a batch cannot be
        sharded; evaluation may still use it whole, and `sharded` refuses it for training)."""
        planned = self.plan(batch)
        return count_loss_tokens(batch, shard=lambda labels: self._shard_labels(labels, planned))

    def _shard_labels(self, labels: torch.Tensor, planned: SequenceShards | None = None) -> torch.Tensor | None:
        if planned is not None and planned.seq_len == labels.shape[-1]:
            return planned.shard(labels, -1)
        try:
            shards = self.shards(labels.shape[-1])
        except ValueError:
            return None
        return shards.shard(labels, -1)

    def attend(self, shards: SequenceShards, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               is_causal: bool, scale: float | None, doc: DocumentMask | None = None) -> torch.Tensor:
        return sequence_parallel_attention(query, key, value, shards, cp_group=self.cp_group, sp_group=self.sp_group,
                                           strategy=self.strategy, is_causal=is_causal, scale=scale, doc=doc,
                                           head_chunks=self.head_chunks)

    @contextlib.contextmanager
    def sharded(self, buffers: list[torch.Tensor] | None, seq_dims: list[int] | None,
                no_restore: set[torch.Tensor] | None = None, expected_tokens: int | None = None,
                shards: SequenceShards | None = None) -> Iterator[ShardedSequence]:
        """Shard `buffers` in place along their `seq_dims` for the duration of the block; on exit restore those not
        in `no_restore`. `expected_tokens` is this shard's loss-token count as the prepared data loader counted it
        (checked against the model's ``shift_labels``); `shards`, the shards it chose for the batch (`plan`), used
        when the buffers have its length. Every check comes before anything is changed, and nothing here
        communicates."""
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("maybe_context_parallel blocks cannot be nested")
        shards = self._check_buffers(buffers, seq_dims, shards)
        unique = list({id(b): (b, d) for b, d in zip(buffers, seq_dims)}.values())
        storages = [b.untyped_storage().data_ptr() for b, _ in unique]
        if len(set(storages)) < len(storages):
            raise ValueError("maybe_context_parallel: two buffers share memory (one is a view of the other); sharding "
                             "one in place would corrupt the other -- pass copies (.clone())")
        keep = {id(b) for b in (no_restore or ())}
        full = {id(b): b.clone() for b, _ in unique}
        for buf, dim in unique:
            part = shards.shard(full[id(buf)], dim)
            buf.resize_(part.shape)  # in place, as torch's context_parallel does: the caller's batch sees the shard
            buf.copy_(part)
        state = ShardedSequence(self, shards, full, expected_tokens)
        _ACTIVE = state
        failed = False
        try:
            yield state
        except BaseException:
            failed = True
            raise
        finally:
            _ACTIVE = None
            for buf, _ in unique:
                if id(buf) not in keep:
                    buf.resize_(full[id(buf)].shape)
                    buf.copy_(full[id(buf)])
            if not failed and state.forwards and not state.attention_calls:
                raise RuntimeError(
                    "maybe_context_parallel: the model ran on sharded sequences, but none of its attention went "
                    "through ndparallel's context-parallel attention, so each rank attended only to its own shard. "
                    "Hugging Face models need attn_implementation='sdpa' or 'eager'; other models must call "
                    "ndparallel.context_parallel_attention in place of scaled_dot_product_attention"
                )

    def _check_buffers(self, buffers: list[torch.Tensor] | None, seq_dims: list[int] | None,
                       planned: SequenceShards | None = None) -> SequenceShards:
        if not buffers:
            raise ValueError(
                f"maybe_context_parallel() with {self.sizes} needs the batch's sequence tensors: pass "
                "buffers=[batch['input_ids'], batch['shift_labels'], batch['position_ids']] and "
                "buffer_seq_dims=[1, 1, 1]"
            )
        if seq_dims is None:
            raise ValueError("maybe_context_parallel(buffers=...) needs buffer_seq_dims: the sequence dimension of "
                             "each buffer, e.g. [1, 1, 1] for [batch, seq] tensors")
        for i, buf in enumerate(buffers):
            if not isinstance(buf, torch.Tensor):
                raise TypeError(f"maybe_context_parallel: buffers[{i}] is a {type(buf).__name__}, not a tensor")
            if buf.requires_grad:
                raise ValueError(f"maybe_context_parallel: buffers[{i}] requires grad and cannot be sharded in place; "
                                 "shard inputs (ids, labels, positions), not tensors autograd tracks")
        for i, (buf, dim) in enumerate(zip(buffers, seq_dims)):
            if not -buf.dim() <= dim < buf.dim():
                raise ValueError(f"maybe_context_parallel: buffer_seq_dims[{i}]={dim} is out of range for a buffer of "
                                 f"shape {tuple(buf.shape)}")
        lengths = {buf.shape[dim] for buf, dim in zip(buffers, seq_dims)}
        if len(lengths) > 1:
            shapes = ", ".join(f"{tuple(b.shape)} (dim {d})" for b, d in zip(buffers, seq_dims))
            raise ValueError(f"maybe_context_parallel: the buffers' sequence lengths differ: {shapes}")
        length = lengths.pop()
        return planned if planned is not None and planned.seq_len == length else self.shards(length)


@dataclass
class ShardedSequence:
    """What attention and the model's input checks need to know while the sequence is sharded."""

    sharding: SequenceSharding
    shards: SequenceShards  # this rank's part: cp chunks, then its sp piece
    full: Mapping[int, torch.Tensor]  # id(buffer) -> the buffer's full-sequence copy, for input checks
    expected_tokens: int | None = None  # loss tokens of this shard, as counted by the prepared data loader
    forwards: int = 0  # forwards of prepared models inside the block
    attention_calls: int = 0
    documents: DocumentMask | None = None  # padded or packed rows (set by the model's input check), else None
    _windowed: dict = field(default_factory=dict, repr=False)

    def set_documents(self, documents: DocumentMask | None) -> None:
        self.documents, self._windowed = documents, {}

    def visibility(self, window: int | None) -> DocumentMask | None:
        """The batch's document mask with a sliding window (None: none), one object per window for the batch so
        each block's kind is worked out once, not once per layer."""
        if window is not None and window >= self.shards.seq_len:
            window = None  # a window covering the sequence is plain causal attention
        if window is None:
            return self.documents
        if window not in self._windowed:
            self._windowed[window] = (self.documents or DocumentMask(None)).with_window(window)
        return self._windowed[window]


_ACTIVE: ShardedSequence | None = None


def active() -> ShardedSequence | None:
    """The sharded-sequence state of this process, or None outside ``maybe_context_parallel``."""
    return _ACTIVE


@torch.compiler.disable  # collectives and the per-batch sharding state: kept out of compiled graphs
def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                               is_causal: bool = True, scale: float | None = None,
                               sliding_window: int | None = None) -> torch.Tensor:
    """`scaled_dot_product_attention` for models run under context/sequence parallelism; the entry point for models
    that are not Hugging Face ``sdpa``/``eager`` models.

    Takes ``[batch, heads, seq, head_dim]`` query, key and value (key/value may have fewer heads: GQA). Inside
    ``maybe_context_parallel`` ``seq`` is this rank's shard and the result is exact attention over the whole
    sequence (causal by global position, or full), within the batch's documents where a Hugging Face model's
    padded or packed inputs set them, and within `sliding_window` (query q sees key k when q - window < k);
    outside, it is plain SDPA. No attention mask or dropout.
    """
    state = _ACTIVE
    if state is None:
        if sliding_window is not None and sliding_window < query.shape[2]:
            raise ValueError("context_parallel_attention: a sliding window outside maybe_context_parallel needs the "
                             "model's own masked attention")
        gqa = {"enable_gqa": True} if query.shape[1] != key.shape[1] else {}
        return F.scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale, **gqa)
    state.attention_calls += 1
    return state.sharding.attend(state.shards, query, key, value, is_causal, scale, state.visibility(sliding_window))
