"""ALST's and UPipe's published longest sequences beside `ndparallel plan --max-seq`'s prediction
(docs/long_context.md).

    python benchmarks/alst_compare.py [--host-memory-gib 1769]

ALST (Arctic Long Sequence Training, arXiv:2506.13996; snowflakedb/ArcticTraining projects/sequence-parallelism)
trained Llama-3.1-8B and -70B on H100 80GB nodes of 8 GPUs with "1.9TB CPU memory" (its README; 1,769 GiB),
DeepSpeed ZeRO-3 with the optimizer (and, on one GPU, the parameters) offloaded to the host, Ulysses over every GPU,
tiled MLPs and loss, checkpointed layer inputs offloaded to the host, Liger-Kernel's fused kernels and
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``; its abstract reports 500K tokens for Llama-3.1-8B on one H100,
3.7M on one node of 8 and over 15M on 4 nodes (32 GPUs). UPipe (Untied Ulysses, arXiv:2602.21196) reports 5M tokens
for Llama-3-8B on one 8xH100 node, chunking Ulysses attention head by head (the planner takes Llama-3.1-8B's config:
the same layers and widths). For each published row: the planner's longest sequence on the same GPUs and host memory
(every feature the library has -- head-chunked Ulysses attention where it lengthens the sequence, with the count the
library's "auto" picks, and under cp the all-gather or the ring attention (``cp_comm_strategy``), whichever lengthens
it -- and FSDP2's CPU offload where it helps), and at the published
length, for the planner's best layout, the predicted peak, how far over the budget it is, and the GPU terms the
library has no feature for (`planner.longest.missing_features`). Predictions only: no GPU ran them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ndparallel.planner import get_hardware, load_model  # noqa: E402
from ndparallel.planner.longest import QUANTUM, _setting, best_chunks, longest  # noqa: E402
from ndparallel.planner.footprint import estimate  # noqa: E402
from ndparallel.planner.offload import host_bytes  # noqa: E402
from ndparallel.planner.search import Request  # noqa: E402

GiB = 2**30
# (model, nodes, GPUs per node, the published length, who, where it is published)
ROWS = [
    ("llama-3.1-8b", 1, 1, 500_000, "ALST", "paper abstract; run-sp1-llama-8b.yml max_length 500000"),
    ("llama-3.1-8b", 1, 8, 3_700_000, "ALST", "paper abstract (3.7M); run-sp8-llama-8b.yml max_length 3800000"),
    ("llama-3.1-8b", 1, 8, 5_000_000, "UPipe", "arXiv:2602.21196 (Llama-3-8B, one 8xH100 node)"),
    ("llama-3.1-8b", 4, 8, 15_000_000, "ALST", "paper abstract ('over 15M'); run-sp32-llama-8b.yml max_length 15500000"),
    ("llama-3.1-70b", 8, 8, 10_000_000, "ALST", "run-sp64-llama-70b.yml max_length 10_000_000 ('ok'); paper not re-read"),
]


def compare(name: str, nodes: int, gpus: int, published: int, host_gib: float) -> dict:
    request = Request(load_model(name), get_hardware("h100"), nodes, gpus, 1024, 1024, host_memory_gib=host_gib)
    best = longest(request)[0]
    layout = best.layout
    step = QUANTUM * layout.sequence_divisor
    at = -(-published // step) * step  # ALST's length, rounded up to what the layout splits
    mem = estimate(request.model, layout, _setting("all", at, request.mixed_precision, request.optimizer,
                                                   best.offload_params, best.head_chunks, best.cp_strategy),
                   request.hardware.fragmentation)
    return {"name": name, "gpus": nodes * gpus, "published": published, "predicted": best.tokens["all"],
            "layout": layout.name, "offload_params": best.offload_params, "without": best.without_offload,
            "chunks": best_chunks(best, request) if best.head_chunks else 1,
            "ring": layout.cp > 1 and best.cp_strategy == "ring", "other": best.other_strategy,
            "at": at, "peak": mem.peak / GiB, "over": (mem.peak - request.budget_bytes) / GiB,
            "host": host_bytes(mem) / GiB, "host_budget": request.host_budget_bytes / GiB,
            "gathered": mem["unsharded_params"] / GiB, "fragmentation": mem["fragmentation"] / GiB}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host-memory-gib", type=float, default=1769.0, help="per node (ALST's 1.9 TB)")
    args = parser.parse_args(argv)
    print("| model, H100s | published (who) | planner --max-seq (layout) | ratio | without cpu_offload | at the "
          "published length: peak GiB (over 76.6) | host GiB per GPU (of) | gathered params | allocator reserve |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, nodes, gpus, published, who, _ in ROWS:
        r = compare(name, nodes, gpus, published, args.host_memory_gib)
        chunks = f", {r['chunks']} head chunks" if r["chunks"] > 1 else ""
        print(f"| {r['name']}, {r['gpus']} | {r['published']:,} ({who}) | {r['predicted']:,} ({r['layout']}"
              f"{', cpu_offload' if r['offload_params'] else ''}{chunks}"
              f"{', ring; all-gather ' + format(r['other'] or 0, ',') if r['ring'] else ''}) | "
              f"{r['predicted'] / published:.2f} | "
              f"{r['without'] or 0:,} | {r['peak']:.1f} ({r['over']:+.1f}) | {r['host']:.1f} ({r['host_budget']:.1f}) "
              f"| {r['gathered']:.1f} | {r['fragmentation']:.1f} |")


if __name__ == "__main__":
    main()
