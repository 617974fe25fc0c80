"""Per-rank parameter memory under tensor parallelism, next to the plan's ideal.

    python benchmarks/tensor_parallel_memory.py [--hidden 512 --layers 4 --vocab 8192]

For tp = 1, 2, 4 it forks tp ranks (gloo, CPU), builds the same Llama on each from one seed, prepares it with
`ParallelismConfig(tp_size=tp)` (pure TP, no FSDP) and counts, on every rank, the bytes of the storages that
back the parameters (distinct storages, so a shard that is a view of the full weight would show as the full
weight). The ideal comes from the plan and the unsharded model alone: bytes of the parameters the plan splits,
divided by tp, plus the bytes of the parameters it leaves whole. It prints both and their ratio per rank.
"""

from __future__ import annotations

import argparse

import torch  # noqa: E402

torch.set_num_threads(1)  # forked ranks share the cores

from common import llama  # noqa: E402

from ndparallel.parallel.tensor import choose_plan, resolve_plan  # noqa: E402
from ndparallel.test_utils import run_ranks  # noqa: E402


def build(args: argparse.Namespace):
    return llama(vocab=args.vocab, hidden=args.hidden, layers=args.layers, intermediate=args.hidden * 11 // 4,
                 max_positions=2048)


def ideal_bytes(args: argparse.Namespace, tp: int) -> tuple[int, int, int]:
    """(ideal bytes per rank, bytes the plan splits, bytes it leaves whole), from the unsharded model."""
    model = build(args)
    plan, source = choose_plan(model)
    split_modules = {name for name, style in resolve_plan(model, plan, source).items()
                     if style not in ("replicate", "sequence_parallel", "gather_sequence")}
    split = whole = 0
    for module_name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if module_name in split_modules:
                split += p.numel() * p.element_size()
            else:
                whole += p.numel() * p.element_size()
    return split // tp + whole, split, whole


def measure(args: argparse.Namespace, tp: int) -> int:
    from torch.distributed.tensor import DTensor

    from ndparallel import Accelerator, ParallelismConfig

    accelerator = Accelerator(parallelism_config=ParallelismConfig(tp_size=tp), cpu=True)
    model = accelerator.prepare(build(args))
    storages = {}
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    accelerator.end_training()
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    print(f"Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab}, fp32, the model's own TP plan")
    print(f"{'tp':>3} {'rank':>4} {'measured MiB':>13} {'ideal MiB':>10} {'measured/ideal':>15}")
    worst = 0.0
    for tp in (1, 2, 4):
        ideal, split, whole = ideal_bytes(args, tp)
        per_rank = run_ranks(measure, tp, args, tp, timeout=600)
        for rank, measured in enumerate(per_rank):
            ratio = measured / ideal
            worst = max(worst, abs(ratio - 1))
            print(f"{tp:>3} {rank:>4} {measured / 2**20:>13.2f} {ideal / 2**20:>10.2f} {ratio:>15.4f}")
    print(f"split by the plan: {split / 2**20:.2f} MiB, left whole: {whole / 2**20:.2f} MiB; "
          f"largest deviation from ideal: {worst:.2%}")


if __name__ == "__main__":
    main()
