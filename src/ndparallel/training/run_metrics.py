"""The files a launched run leaves for ``ndparallel plan --measure`` (`ndparallel.planner.measure`): with
``$NDPARALLEL_METRICS_FILE`` set, each rank's Accelerator writes its peak memory and its step timer's medians at
``end_training`` to ``<value>.rank<r>.json``; the planner reads them back. Both sides go through this module."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from .metrics import StepTimer

METRICS_ENV = "NDPARALLEL_METRICS_FILE"  # set by `ndparallel plan --measure`: each rank writes <value>.rank<r>.json


def peak_memory(device: torch.device) -> tuple[int, str]:
    """This process's peak memory: allocated CUDA memory on a GPU, else the peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated"
    import resource  # Unix only

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return (rss if sys.platform == "darwin" else rss * 1024), "peak RSS"


def write_run_metrics(timer: StepTimer | None, rank: int, world: int, device: torch.device,
                      environ: Any = None) -> str | None:
    """When ``$NDPARALLEL_METRICS_FILE`` is set, write this rank's peak memory and (if `timer` timed steps) its
    step metrics, medians after up to 2 warm-up steps, to ``<file>.rank<rank>.json``; return the path."""
    prefix = (os.environ if environ is None else environ).get(METRICS_ENV)
    if not prefix:
        return None
    peak, kind = peak_memory(device)
    steps = None
    if timer is not None and timer.times:
        steps = timer.summary(skip=min(2, len(timer.times) - 1))
    path = rank_file(prefix, rank)
    with open(path, "w") as f:
        json.dump({"rank": rank, "world": world, "peak_memory_bytes": peak, "peak_memory_kind": kind,
                   "step_metrics": steps}, f)
    return path


def rank_file(prefix: str, rank: int) -> str:
    """The file rank `rank` of a run writes its metrics to."""
    return f"{prefix}.rank{rank}.json"


def read_rank_files(prefix: str, world: int) -> list[dict[str, Any]]:
    """Every rank's metrics of a run, in rank order (raises naming the first rank that wrote none)."""
    ranks = []
    for rank in range(world):
        path = Path(rank_file(prefix, rank))
        if not path.exists():
            raise ValueError(f"rank {rank} wrote no metrics ({path}): the script must end with "
                             "accelerator.end_training()")
        ranks.append(json.loads(path.read_text()))
    return ranks
