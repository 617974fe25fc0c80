"""The per-parallelism handlers of `ParallelismConfig` (Accelerate's names): tensor, context and pipeline
parallelism's options.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TorchTensorParallelConfig:
    """How tensor parallelism is applied.

    Attributes:
        plan: a dict from module-name pattern to style (see `ndparallel.parallel.tensor`); None means the model's
            own or a built-in plan.
        sequence_parallel: Megatron-style sequence parallelism of norms and dropout between TP regions.
        loss_parallel: keep the LM head's logits split over the vocabulary and compute the cross-entropy on the
            shards (torch's ``loss_parallel``): no rank ever holds the full (batch, seq, vocab) logits. The model's
            ``logits`` output is then a DTensor sharded on its last dimension.
        enable_async_tp: Accelerate's field; accepted and ignored with a warning (no asynchronous TP here).
    """

    plan: dict[str, str] | None = None
    sequence_parallel: bool = False
    loss_parallel: bool = False
    enable_async_tp: bool = False

    def __post_init__(self) -> None:
        if self.plan is not None and not isinstance(self.plan, dict):
            raise TypeError("TorchTensorParallelConfig.plan must be a dict of pattern -> style, got "
                            f"{type(self.plan).__name__}")
        if self.enable_async_tp:
            warnings.warn("TorchTensorParallelConfig(enable_async_tp=True): asynchronous tensor parallelism is not "
                          "supported; ignoring it", stacklevel=3)


# Context-parallel strategies; Accelerate's "alltoall" (torch's rotation of K/V blocks between the cp ranks) is
# ndparallel's ring.
CP_STRATEGIES = ("allgather", "ring", "alltoall")

CP_STRATEGY_ENV = "PARALLELISM_CONFIG_CP_COMM_STRATEGY"  # what `accelerate launch` exports


def strategy_from_env(environ: Mapping[str, str]) -> str:
    """The context-parallel strategy `environ` sets (``PARALLELISM_CONFIG_CP_COMM_STRATEGY``), else "allgather"."""
    strategy = environ.get(CP_STRATEGY_ENV) or "allgather"
    if strategy not in CP_STRATEGIES:
        raise ValueError(f"Invalid cp_comm_strategy: {strategy} (from ${CP_STRATEGY_ENV}). Must be one of "
                         f"{list(CP_STRATEGIES)}")
    return strategy


@dataclass
class TorchContextParallelConfig:
    """How context parallelism (cp_size > 1) shards sequences and computes attention over them.

    Attributes:
        cp_comm_strategy: "allgather" (default: all-gather K/V over cp; their gradients are reduce-scattered back)
            or "ring" (pass K/V blocks around the ring with point-to-point sends, merge partial results by
            log-sum-exp; memory stays 1/cp of the sequence; Accelerate's name for it is "alltoall"). Both are exact;
            see `ndparallel.parallel.sequence`.
        load_balance: rank r holds chunks r and ``2*cp-1-r`` of ``2*cp`` equal chunks, so causal attention costs
            every rank the same (sequence length must be a multiple of ``2*cp``); False: rank r holds chunk r of cp
            (a multiple of cp).
        balance_documents: for packed or padded rows (whose attention work the load-balanced layout does not even
            out), deal ``4*cp`` equal chunks of each batch over the cp ranks by their attention work instead, when
            that is more even (`ndparallel.parallel.sequence.masking.balanced_assignment`; batches from the prepared
            data loader, sequence length a multiple of ``4*cp``). Exact either way; only the balance changes.
    """

    cp_comm_strategy: str | None = None
    load_balance: bool = True
    balance_documents: bool = False

    def __post_init__(self) -> None:
        if self.cp_comm_strategy is None:  # as Accelerate's: what `accelerate launch` exported, else all-gather
            self.cp_comm_strategy = strategy_from_env(os.environ)
        elif self.cp_comm_strategy not in CP_STRATEGIES:
            raise ValueError(f"Invalid cp_comm_strategy: {self.cp_comm_strategy}. Must be one of {list(CP_STRATEGIES)}")
        if not isinstance(self.load_balance, bool):
            raise TypeError(f"load_balance must be a bool, got {self.load_balance!r}")
        if not isinstance(self.balance_documents, bool):
            raise TypeError(f"balance_documents must be a bool, got {self.balance_documents!r}")


# Pipeline schedules by name -> (torch.distributed.pipelining class, stages per rank it takes: 1, or "2+", or 2).
PP_SCHEDULES: dict[str, tuple[str, str]] = {
    "gpipe": ("ScheduleGPipe", "1"),
    "1f1b": ("Schedule1F1B", "1"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "2+"),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", "2+"),
    "zbv": ("ScheduleZBVZeroBubble", "2"),
}


@dataclass
class PipelineParallelConfig:
    """How pipeline parallelism (pp_size > 1) splits the model and schedules its micro-batches
    (`ndparallel.parallel.pipeline`).

    Attributes:
        schedule: "1f1b" (default), "gpipe", "interleaved_1f1b", "zero_bubble" (interleaved, backward split into
            input and weight gradients) or "zbv" (zero bubble over two stages per rank in a V), torch's schedules.
        microbatches: micro-batches each rank's batch is cut into (its rows must divide by it); None: one per stage
            of the pipeline (pp_size * stages_per_rank), the fewest that keep every stage busy.
        stages_per_rank: model chunks each rank holds (virtual stages); None: 1, or 2 for the interleaved schedules.
        split: where stages begin -- None: balanced by parameter count; a list of decoder-layer indices (a Hugging
            Face causal LM: stage s > 0 begins at layer ``split[s-1]``); or a list of module names (any model whose
            forward runs its top-level children in order, such as an ``nn.Sequential``: stage s > 0 begins at child
            ``split[s-1]``). One entry fewer than the pipeline's stages.
        loss_fn: ``loss_fn(output, labels) -> mean loss`` for models that compute no loss of their own (not needed
            for Hugging Face causal LMs, whose own loss function is used).
    """

    schedule: str = "1f1b"
    microbatches: int | None = None
    stages_per_rank: int | None = None
    split: list[int] | list[str] | None = None
    loss_fn: Any = None

    def __post_init__(self) -> None:
        if self.schedule not in PP_SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {self.schedule!r}; use one of {list(PP_SCHEDULES)}")
        takes = PP_SCHEDULES[self.schedule][1]
        if self.stages_per_rank is None:
            self.stages_per_rank = 1 if takes == "1" else 2
        if isinstance(self.stages_per_rank, bool) or not isinstance(self.stages_per_rank, int) or (
                self.stages_per_rank < 1):
            raise ValueError(f"stages_per_rank must be an int >= 1, got {self.stages_per_rank!r}")
        ok = {"1": self.stages_per_rank == 1, "2": self.stages_per_rank == 2, "2+": self.stages_per_rank >= 2}[takes]
        if not ok:
            want = {"1": "1", "2": "2", "2+": "2 or more"}[takes]
            raise ValueError(f"schedule {self.schedule!r} runs {want} stage(s) per rank, got stages_per_rank="
                             f"{self.stages_per_rank}; single-stage schedules: gpipe, 1f1b; interleaved: "
                             "interleaved_1f1b, zero_bubble (2 or more), zbv (2)")
        if self.microbatches is not None and (isinstance(self.microbatches, bool) or not isinstance(
                self.microbatches, int) or self.microbatches < 1):
            raise ValueError(f"microbatches must be an int >= 1 (or None: one per stage), got {self.microbatches!r}")
        if self.split is not None:
            if not isinstance(self.split, (list, tuple)) or not (
                    all(isinstance(x, int) and not isinstance(x, bool) for x in self.split)
                    or all(isinstance(x, str) for x in self.split)):
                raise TypeError("split must be a list of layer indices or a list of module names, got "
                                f"{self.split!r}")
            self.split = list(self.split)
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(output, labels), got {type(self.loss_fn).__name__}")
