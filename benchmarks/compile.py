"""Compilation: cold-start time of whole-model against regional compilation, and step time compiled / eager per
layout. Prints one table; writes it and the raw figures to --out.

    python benchmarks/compile.py [--layers 8] [--hidden 256] [--backend inductor] [--layouts fsdp2 tp2 cp2 sp2]

Cold start: one process, a Llama of --layers blocks; the first training step (forward + backward) with
`TorchDynamoPlugin(backend, use_regional_compilation=...)` minus the first eager step, each in a fresh forked process
with inductor's on-disk caches off, so nothing is reused between runs. Step time: per layout (forked gloo ranks,
fp32), the median of --steps steps after --warmup, regional compilation against eager, same model and data.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from common import config_sizes, llama, write_results  # noqa: E402

from ndparallel.distributed.layout import Layout  # noqa: E402
from ndparallel.test_utils import run_ranks  # noqa: E402

LAYOUTS = {"single": Layout(), "fsdp2": Layout(dp_shard=2), "tp2": Layout(tp=2), "cp2": Layout(cp=2),
           "sp2": Layout(sp=2)}


def _run(sizes: dict, backend: str | None, regional: bool, layers: int, hidden: int, seq: int, steps: int) -> list:
    """Seconds of each training step on this rank (the first includes compilation)."""
    os.environ.update(TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    import torch.nn.functional as F

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig, TorchDynamoPlugin

    plugin = TorchDynamoPlugin(backend=backend, use_regional_compilation=regional) if backend else None
    acc = Accelerator(parallelism_config=ParallelismConfig(**sizes), fsdp_plugin=FullyShardedDataParallelPlugin(),
                      dynamo_plugin=plugin)
    model = llama(vocab=512, hidden=hidden, layers=layers, intermediate=4 * hidden, heads=8, kv_heads=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    g = torch.Generator().manual_seed(1)
    times = []
    for _ in range(steps):
        ids = torch.randint(0, 512, (2, seq), generator=g)
        batch = {"input_ids": ids, "labels": ids.clone(), "shift_labels": F.pad(ids[:, 1:], (0, 1), value=-100),
                 "position_ids": torch.arange(seq).repeat(2, 1)}
        buffers = list(batch.values())
        start = time.perf_counter()
        with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * 4, no_restore_buffers=set(buffers)):
            loss = model(**batch).loss
            acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    acc.end_training()
    return times


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--layouts", nargs="+", default=["single", "fsdp2", "tp2", "cp2", "sp2"], choices=list(LAYOUTS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    args = p.parse_args(argv)
    common = (args.layers, args.hidden, args.seq)

    eager_first = run_ranks(_run, 1, {}, None, False, *common, 1, timeout=3600)[0][0]
    cold = {}
    for name, regional in (("whole", False), ("regional", True)):
        first = run_ranks(_run, 1, {}, args.backend, regional, *common, 1, timeout=3600)[0][0]
        cold[name] = first - eager_first
        print(f"cold start, {name} model: {cold[name]:.1f} s of compilation", flush=True)
    rows = []
    total = args.warmup + args.steps
    for layout in args.layouts:
        sizes, world = config_sizes(LAYOUTS[layout]), LAYOUTS[layout].world
        eager = statistics.median(run_ranks(_run, world, sizes, None, False, *common, total, timeout=3600)[0]
                                  [args.warmup:])
        compiled = statistics.median(run_ranks(_run, world, sizes, args.backend, True, *common, total,
                                               timeout=3600)[0][args.warmup:])
        rows.append({"layout": layout, "eager_s": eager, "compiled_s": compiled, "ratio": compiled / eager})
        print(f"{layout}: eager {eager * 1e3:.1f} ms, regional {args.backend} {compiled * 1e3:.1f} ms "
              f"({compiled / eager:.2f}x)", flush=True)
    lines = [f"Compilation, {args.backend}: Llama of {args.layers} blocks, hidden {args.hidden}, sequence {args.seq}, "
             f"batch 2, fp32, this CPU (torch {torch.__version__})", "",
             "| cold start | compile time (s) |", "|---|---|",
             f"| whole model | {cold['whole']:.1f} |", f"| regional | {cold['regional']:.1f} |",
             f"| regional / whole | {cold['regional'] / cold['whole']:.2f} |", "",
             "| layout | eager step (ms) | regional compiled step (ms) | compiled / eager |", "|---|---|---|---|"]
    lines += [f"| {r['layout']} | {r['eager_s'] * 1e3:.1f} | {r['compiled_s'] * 1e3:.1f} | {r['ratio']:.2f} |"
              for r in rows]
    table = "\n".join(lines) + "\n"
    return write_results(args.out, "compile", table, {"cold_start_s": cold, "steps": rows}, show=True)


if __name__ == "__main__":
    main()
