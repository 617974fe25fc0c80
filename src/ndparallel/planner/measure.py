"""``ndparallel plan --measure SCRIPT [ARGS]``: run the top predicted layouts on this machine and put what they
measure next to what was predicted.

Each layout runs ``ndparallel launch --nproc-per-node G --<axis>-size N ... SCRIPT ARGS`` (one node: the machines
at hand) with ``NDPARALLEL_METRICS_FILE`` set; the script's Accelerator writes, per rank at ``end_training``, the
step metrics of its ``accelerator.step_timer(...)`` and its peak memory (`ndparallel.training.run_metrics`).
Measured tokens/s per GPU is the timer's median tokens/s over the world; measured peak memory is the largest
rank's (CUDA allocated memory on GPUs, peak RSS on CPUs). The script's own batch size and sequence length are what
run: the planner's micro-batch and accumulation are not passed to it, mixed precision is (``--mixed-precision``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from ..configuration.handlers import CP_STRATEGY_ENV
from ..configuration.parallelism import SIZE_FIELDS
from ..training.run_metrics import METRICS_ENV, read_rank_files
from .search import Row

SIZE_FLAGS = {field.removesuffix("_size"): "--" + field.replace("_", "-") for field in SIZE_FIELDS}  # --tp-size...


def launch_command(row: Row, gpus_per_node: int, script: list[str], mixed_precision: str) -> list[str]:
    """The ``ndparallel launch`` command line of one layout."""
    sizes = [arg for axis, flag in SIZE_FLAGS.items() for arg in (flag, str(getattr(row.layout, axis)))]
    precision = "bf16" if mixed_precision == "bf16" else "no"
    return [sys.executable, "-m", "ndparallel.cli", "launch", "--nproc-per-node", str(gpus_per_node), *sizes,
            "--mixed-precision", precision, *script]


def read_metrics(prefix: str, world: int) -> dict[str, Any]:
    """Tokens/s per GPU and the largest peak memory from the ranks' files (raises when the script wrote none)."""
    ranks = read_rank_files(prefix, world)
    steps = ranks[0]["step_metrics"]
    if steps is None:
        raise ValueError("the script timed no steps: wrap each training step in `with timer.step(tokens=...)` of "
                         "timer = accelerator.step_timer(model, seq_len=...)")
    peak = max(r["peak_memory_bytes"] for r in ranks)
    return {"tokens_per_s_per_gpu": steps["tokens_per_s"] / world, "peak_memory_bytes": peak,
            "peak_memory_kind": ranks[0]["peak_memory_kind"], "steps": steps["steps"]}


def measure(rows: list[Row], gpus_per_node: int, script: list[str], mixed_precision: str,
            progress: Callable[[str], None], timeout: float = 3600) -> list[dict[str, Any]]:
    """Run each row's layout with `script`; one result per row: the measured figures, or the failure."""
    results = []
    with tempfile.TemporaryDirectory(prefix="ndparallel-measure-") as tmp:
        for i, row in enumerate(rows, 1):
            progress(f"measuring {i}/{len(rows)}: {row.layout.name} ...")
            prefix = os.path.join(tmp, f"layout{i}")
            env = {**os.environ, METRICS_ENV: prefix}
            if row.layout.cp > 1:  # the cp attention the row was predicted with, for a script that leaves it unset
                env[CP_STRATEGY_ENV] = row.recipe.cp_strategy
            result: dict[str, Any] = {"layout": row.layout.name, "row": row}
            try:
                done = subprocess.run(launch_command(row, gpus_per_node, script, mixed_precision), env=env,
                                      capture_output=True, text=True, timeout=timeout)
                if done.returncode != 0:
                    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                    raise ValueError(f"exit code {done.returncode}: " + " | ".join(tail))
                result.update(read_metrics(prefix, row.layout.world))
            except (ValueError, subprocess.TimeoutExpired) as exc:
                result["error"] = str(exc)
            results.append(result)
            progress(f"  {result.get('error') or 'done'}")
    return results


def table(results: list[dict[str, Any]]) -> str:
    """Predicted next to measured, ranked by measured tokens/s per GPU (failed runs last)."""
    ok = sorted((r for r in results if "error" not in r), key=lambda r: -r["tokens_per_s_per_gpu"])
    lines = ["#  layout                          predicted tok/s/GPU  measured tok/s/GPU  predicted peak GiB  "
             "measured peak GiB",
             "-  ------------------------------  -------------------  ------------------  ------------------  "
             "-----------------"]
    for i, r in enumerate(ok, 1):
        row = r["row"]
        lines.append(f"{i:<2} {r['layout']:<30}  {row.timing.tokens_per_s_per_gpu:>19,.0f}  "
                     f"{r['tokens_per_s_per_gpu']:>18,.0f}  {row.memory.peak / 2**30:>18.2f}  "
                     f"{r['peak_memory_bytes'] / 2**30:>10.2f} ({r['peak_memory_kind']})")
    for r in results:
        if "error" in r:
            lines.append(f"-  {r['layout']:<30}  failed: {r['error']}")
    return "\n".join(lines)
