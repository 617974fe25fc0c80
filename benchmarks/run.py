"""Step time, bytes sent per collective and memory per rank, for a matrix of layouts: ndparallel side by side with
plain PyTorch (and Hugging Face Accelerate when installed). See docs/benchmarks.md for the formulas.

    pip install -e .[bench]
    python benchmarks/run.py [--layouts fsdp2 hsdp tp fsdp2_tp cp sp cp_sp] [--out bench_out] [--hidden 512 ...]
                             [--pipeline [pipeline.py's arguments]]   # pipeline stages: benchmarks/pipeline.py

Each layout forks its ranks (one OpenMP thread each, as torchrun gives ranks that share a node; gloo on CPU in
fp32; NCCL on CUDA in bf16, one GPU per rank -- the command is unchanged), builds the same Llama for the library
and for a hand-written plain-PyTorch version of the layout, and alternates blocks of `--steps` timed steps between
them `--repeats` times after `--warmup` steps each, so machine noise hits both alike. Then one counted step of
each: bytes every collective sends (CollectiveCounter), the model states held per rank, and the gap
between the two runs' losses (the check that the baseline computes the same thing). Writes results.json,
results.md and three PNG plots to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

# Ask NVML, not the CUDA driver, how many GPUs there are: ranks are forked, and a parent that initialised the
# driver cannot fork children that use CUDA.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from common import HEADS, KV_HEADS, LAYOUTS, layout_record, workload_config, workload_model  # noqa: E402
from workloads import TP_STYLES, accelerate_row, measure  # noqa: E402

from ndparallel.distributed.layout import Layout  # noqa: E402
from ndparallel.test_utils import run_ranks  # noqa: E402

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")


def need_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("benchmarks/run.py needs matplotlib for its plots: pip install -e '.[bench]' (or pip install "
                 "matplotlib)")
    return plt


# ---- analytic minimum ----------------------------------------------------------------------------------------
def model_sizes(args) -> dict[str, int]:
    """Parameter bytes of the unsharded model: total, inside decoder layers, inside the TP plan's modules, and inside
    the plan's modules outside the decoder layers (the LM head)."""
    import fnmatch

    model = workload_model(args)
    bytes_of = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    patterns = [k.replace("*", "[0-9]*") + "." for k in TP_STYLES]
    split = {n for n in bytes_of if any(fnmatch.fnmatch(n, pat + "*") for pat in patterns)}
    return {"total": sum(bytes_of.values()), "blocks": sum(b for n, b in bytes_of.items() if ".layers." in n),
            "tp_split": sum(bytes_of[n] for n in split),
            "tp_split_root": sum(bytes_of[n] for n in split if ".layers." not in n)}


def minimum_bytes(layout: Layout, args, sizes: dict[str, int], elem: int = 4) -> dict[str, float]:
    """Bytes one rank must send per step (docs/benchmarks.md). elem: bytes of an activation element."""
    r, s, t, cp, sp = layout.dp_replicate, layout.fsdp, layout.tp, layout.cp, layout.sp
    params = sizes["tp_split"] / t + (sizes["total"] - sizes["tp_split"])  # per TP rank
    root = sizes["tp_split_root"] / t + (sizes["total"] - sizes["blocks"] - sizes["tp_split_root"])  # outside blocks
    out = dict.fromkeys(KINDS, 0.0)
    if s > 1:  # FSDP2 (ZeRO-3) over dp_shard x cp x sp: gather every block's parameters for forward and again for
        # backward, the root's (embedding, final norm, LM head) once: backward starts with them
        out["all_gather"] += (s - 1) / s * (2 * params - root)
        out["reduce_scatter"] += (s - 1) / s * params
    if r > 1:  # replicas all-reduce their (sharded) gradients
        out["all_reduce"] += 2 * (r - 1) / r * params / s
    if t > 1:  # Megatron: per layer 2 forward + 2 backward all-reduces of activations, + the LM head's input grad
        act = args.batch * args.seq * args.hidden * elem
        out["all_reduce"] += 2 * (t - 1) / t * act * (4 * args.layers + 1)
        out["all_gather"] += (t - 1) / t * args.batch * args.seq * args.vocab * elem  # replicated logits
    heads, kv_heads = HEADS // t, KV_HEADS // t  # this tp rank's attention heads
    if sp > 1 and kv_heads % sp:
        kv_heads = math.lcm(kv_heads, sp)  # Ulysses repeats K/V heads until sp divides them
    head_bytes = args.batch * args.seq * (args.hidden // HEADS) * elem  # one head over the whole sequence
    if sp > 1:  # Ulysses: q, k, v and the output all-to-all'd forward, their gradients backward
        out["all_to_all"] += 2 * args.layers * (sp - 1) / sp * (2 * heads + 2 * kv_heads) * head_bytes / (cp * sp)
    if cp > 1:  # K and V of a cp rank's shard (its sp ranks' heads) gathered forward, gradients scattered backward
        kv_local = 2 * kv_heads / sp * head_bytes / cp
        out["all_gather"] += args.layers * (cp - 1) * kv_local
        out["reduce_scatter"] += args.layers * (cp - 1) * kv_local
    return out


def ideal_states(layout: Layout, sizes: dict[str, int]) -> float:
    """Params + grads + AdamW's two moments, split as the layout allows: 4 x parameter bytes / shards."""
    t, s = layout.tp, layout.fsdp
    per_rank_params = (sizes["tp_split"] / t + sizes["total"] - sizes["tp_split"]) / s
    return 4 * per_rank_params


# ---- running and reporting -----------------------------------------------------------------------------------
def summarise(name: str, layout: Layout, ranks: list[dict], args, sizes) -> dict:
    r0 = ranks[0]
    med = {k: statistics.median(t for block in v for t in block) for k, v in r0["times"].items()}
    per_repeat = [statistics.median(a) / statistics.median(b)
                  for a, b in zip(r0["times"]["library"], r0["times"]["plain"])]
    cpu = {k: statistics.median(t for rk in ranks for block in rk["cpu"][k] for t in block) for k in med}
    cpu_per_repeat = [statistics.median(t for rk in ranks for t in rk["cpu"]["library"][i])
                      / statistics.median(t for rk in ranks for t in rk["cpu"]["plain"][i])
                      for i in range(len(r0["cpu"]["library"]))]  # every rank's steps of repeat i
    minimum = minimum_bytes(layout, args, sizes)
    tokens_per_s = {k: r0["tokens_per_step"] / v for k, v in med.items()}
    mfu = None
    if r0["peak_flops"] is not None:
        from ndparallel.training.metrics import flops_per_token

        # One device per rank; on a CPU each rank runs one thread and the peak is one thread's measured matmul
        # rate, so the ranks together can use at most as many as there are cores.
        per_device, source = r0["peak_flops"]
        devices = layout.world if r0["device"].startswith("cuda") else min(layout.world, os.cpu_count() or 1)
        fpt = flops_per_token(workload_config(args), args.seq)
        mfu = {"library": tokens_per_s["library"] * fpt / (per_device * devices),
               "plain": tokens_per_s["plain"] * fpt / (per_device * devices),
               "flops_per_token": fpt, "peak_per_device": per_device, "devices": devices, "peak_source": source}
    states = {impl: [rk["counted"][impl]["states"] for rk in ranks] for impl in ("library", "plain")}
    return {
        "layout": layout_record(name, layout),
        "step_s": med, "ratio": med["library"] / med["plain"],
        "ratio_per_repeat": per_repeat, "ratio_median_of_repeats": statistics.median(per_repeat),
        "cpu_s": cpu, "cpu_ratio": cpu["library"] / cpu["plain"], "cpu_ratio_per_repeat": cpu_per_repeat,
        "tokens_per_s": tokens_per_s, "mfu": mfu, "param_gap": [rk["param_gap"] for rk in ranks],
        "loss_gap": [rk["loss_gap"] for rk in ranks],
        "bytes": {impl: r0["counted"][impl]["bytes"] for impl in ("library", "plain")},
        "calls": {impl: r0["counted"][impl]["calls"] for impl in ("library", "plain")},
        "bytes_minimum": minimum,
        "states": states, "states_ideal": ideal_states(layout, sizes),
        "saved_for_backward": {impl: [rk["counted"][impl]["saved_bytes"] for rk in ranks] for impl in states},
        "peak_rss": [rk["counted"]["library"]["peak_rss"] for rk in ranks],
        "peak_allocated": [rk["counted"]["library"].get("peak_allocated") for rk in ranks],
        "device": r0["device"],
    }


MiB = 2**20


def markdown(results: list[dict], args, sizes, command: str) -> str:
    lines = [f"# ndparallel benchmarks\n\n`{command}`\n",
             f"Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab} seq={args.seq} "
             f"batch/rank={args.batch}, {sizes['total'] / 4 / 1e6:.1f} M params, device {results[0]['device']}; "
             f"{args.repeats} interleaved repeats x {args.steps} steps after {args.warmup} warm-up.\n",
             "## Step time (median), library / plain PyTorch\n",
             "| layout | world | library s | plain s | ratio | per-repeat ratios: median (min..max) | CPU-time ratio "
             "(per-repeat min..max) | library tok/s | MFU library / plain | loss gap (param gap) | Accelerate |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        acc = r.get("accelerate") or {"status": "skipped", "error": "--no-accelerate"}
        if acc.get("status") == "ran":
            acc_text = f"{acc['median_step_s']:.3f} s ({acc['median_step_s'] / r['step_s']['plain']:.2f}x plain, " \
                       "not interleaved)"
        else:
            acc_text = f"{acc.get('status')}: {acc.get('error', '')}"
        rr, cr = r["ratio_per_repeat"], r["cpu_ratio_per_repeat"]
        mfu = f"{r['mfu']['library']:.1%} / {r['mfu']['plain']:.1%}" if r.get("mfu") else "n/a"
        gaps = r["param_gap"]
        gap = f"{max(r['loss_gap']):.1e} ({'n/a' if None in gaps else f'{max(gaps):.1e}'})"
        lines.append(f"| {r['layout']['name']} | {r['layout']['world']} | {r['step_s']['library']:.3f} | "
                     f"{r['step_s']['plain']:.3f} | **{r['ratio']:.3f}** | "
                     f"{statistics.median(rr):.3f} ({min(rr):.3f}..{max(rr):.3f}) | "
                     f"**{r['cpu_ratio']:.3f}** ({min(cr):.3f}..{max(cr):.3f}) | "
                     f"{r['tokens_per_s']['library']:.0f} | {mfu} | {gap} | {acc_text.replace('|', '/')} |")
    with_mfu = [r for r in results if r.get("mfu")]
    if with_mfu:
        m = with_mfu[0]["mfu"]
        lines.append(f"\nMFU = tokens/s x {m['flops_per_token'] / 1e6:.1f} MFLOP per token / (peak x devices); peak "
                     f"{m['peak_per_device'] / 1e9:.1f} GFLOP/s per device ({m['peak_source']}); devices: "
                     + ", ".join(f"{r['layout']['name']} {r['mfu']['devices']}" for r in with_mfu) + ". "
                     "Loss gap: largest |library - plain| over the ranks of the last step's loss (mean over the "
                     "rank's tokens), after both trained the same steps on the same data; param gap: the same for "
                     "the local parameters (AdamW turns rounding-level gradient differences near zero into up to "
                     "lr-sized steps, so this one is the looser check).")
    lines += ["\n## Bytes sent per rank per step (rank 0), counted vs analytic minimum\n",
              "| layout | collective | library MiB (calls) | plain MiB (calls) | minimum MiB | library / minimum |",
              "|---|---|---|---|---|---|"]
    for r in results:
        for kind in KINDS:
            lib, plain, mn = r["bytes"]["library"].get(kind, 0), r["bytes"]["plain"].get(kind, 0), \
                r["bytes_minimum"][kind]
            if not (lib or plain or mn):
                continue
            ratio = f"{lib / mn:.4f}" if mn else "n/a (minimum 0)"
            lines.append(f"| {r['layout']['name']} | {kind} | {lib / MiB:.3f} ({r['calls']['library'].get(kind, 0)}) "
                         f"| {plain / MiB:.3f} ({r['calls']['plain'].get(kind, 0)}) | {mn / MiB:.3f} | {ratio} |")
        lib_t, mn_t = sum(r["bytes"]["library"].values()), sum(r["bytes_minimum"].values())
        lines.append(f"| {r['layout']['name']} | **total** | {lib_t / MiB:.3f} | "
                     f"{sum(r['bytes']['plain'].values()) / MiB:.3f} | {mn_t / MiB:.3f} | **{lib_t / mn_t:.4f}** |")
    lines += ["\n## Memory per rank: model states (params + grads + AdamW), library\n",
              "| layout | rank | params MiB | grads MiB | optimizer MiB | total MiB | ideal MiB | total / ideal | "
              "saved for backward MiB, library / plain | peak RSS MiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for rank, st in enumerate(r["states"]["library"]):
            total = sum(st.values())
            lines.append(f"| {r['layout']['name']} | {rank} | {st['params'] / MiB:.2f} | {st['grads'] / MiB:.2f} | "
                         f"{st['optimizer'] / MiB:.2f} | {total / MiB:.2f} | {r['states_ideal'] / MiB:.2f} | "
                         f"**{total / r['states_ideal']:.4f}** | {r['saved_for_backward']['library'][rank] / MiB:.1f} / "
                         f"{r['saved_for_backward']['plain'][rank] / MiB:.1f} "
                         f"| {r['peak_rss'][rank] / MiB:.0f} |")
    return "\n".join(lines) + "\n"


def plots(plt, results: list[dict], out: Path) -> list[str]:
    names = [r["layout"]["name"] for r in results]
    x = range(len(names))
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - 0.2 for i in x], [r["step_s"]["library"] for r in results], 0.4, label="ndparallel")
    ax.bar([i + 0.2 for i in x], [r["step_s"]["plain"] for r in results], 0.4, label="plain PyTorch")
    ax.set_xticks(list(x), [f"{n}\n{r['ratio']:.3f}x" for n, r in zip(names, results)])
    ax.set_ylabel("median step time (s)")
    ax.legend()
    paths.append(out / "step_time.png")
    fig.tight_layout(), fig.savefig(paths[-1]), plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(KINDS)
    for k, kind in enumerate(KINDS):
        counted = [r["bytes"]["library"].get(kind, 0) / MiB for r in results]
        if not any(counted):
            continue
        ax.bar([i - 0.4 + (k + 0.5) * width for i in x], counted, width, label=f"{kind} counted")
        ax.scatter([i - 0.4 + (k + 0.5) * width for i in x], [r["bytes_minimum"][kind] / MiB for r in results],
                   marker="_", s=200, color="black")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("MiB sent per rank per step (black: minimum)")
    ax.legend(fontsize=8)
    paths.append(out / "bytes.png")
    fig.tight_layout(), fig.savefig(paths[-1]), plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    bottoms = [0.0] * len(results)
    for part in ("params", "grads", "optimizer"):
        vals = [r["states"]["library"][0][part] / MiB for r in results]
        ax.bar(list(x), vals, 0.5, bottom=bottoms, label=part)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.scatter(list(x), [r["states_ideal"] / MiB for r in results], marker="_", s=600, color="black", label="ideal")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("model states on rank 0 (MiB)")
    ax.legend()
    paths.append(out / "memory.png")
    fig.tight_layout(), fig.savefig(paths[-1]), plt.close(fig)
    return [str(p) for p in paths]


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--pipeline", nargs=argparse.REMAINDER, default=None, metavar="ARGS",
                   help="then the pipeline layouts: benchmarks/pipeline.py with ARGS (last on the line)")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2, help="samples per data-parallel rank per step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=1, help="timed steps per block")
    p.add_argument("--repeats", type=int, default=16, help="library/plain blocks, alternating")
    p.add_argument("--no-accelerate", action="store_true", help="skip the Hugging Face Accelerate rows")
    p.add_argument("--no-plots", action="store_true", help="JSON and markdown only (no matplotlib needed)")
    p.add_argument("--cpu", action="store_true", help="CPU and gloo even where CUDA is available")
    p.add_argument("--timeout", type=float, default=1200)
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse(argv)
    plt = None if args.no_plots else need_matplotlib()  # before any work: a missing matplotlib fails at once
    command = "python benchmarks/run.py " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = model_sizes(args)
    results: list[dict] = []
    failures: dict[str, str] = {}
    for name in args.layouts:
        layout = LAYOUTS[name]
        if torch.cuda.is_available() and not args.cpu and torch.cuda.device_count() < layout.world:
            print(f"{name}: needs {layout.world} GPUs, {torch.cuda.device_count()} here; skipped")
            continue
        print(f"{name}: {layout.world} ranks ...", flush=True)
        try:
            ranks = run_ranks(measure, layout.world, layout, args, timeout=args.timeout)
        except (AssertionError, TimeoutError) as exc:  # a rank raised, died or hung: keep the other layouts' figures
            failures[name] = str(exc)
            print(f"  {name} FAILED (the other layouts go on):\n{exc}", flush=True)
            continue
        result = summarise(name, layout, ranks, args, sizes)
        if not args.no_accelerate:
            result["accelerate"] = run_ranks(accelerate_row, layout.world, layout, args, timeout=args.timeout)[0]
        print(f"  library/plain {result['ratio']:.3f}  "
              f"(per repeat {', '.join(f'{x:.3f}' for x in result['ratio_per_repeat'])})", flush=True)
        results.append(result)
    (args.out / "results.json").write_text(json.dumps(
        {"command": command, "args": {k: str(v) for k, v in vars(args).items()}, "sizes": sizes,
         "results": results, "failures": failures}, indent=1))
    text = markdown(results, args, sizes, command) if results else ""
    if plt is not None and results:
        text += "\nPlots: " + ", ".join(plots(plt, results, args.out)) + "\n"
    for name, error in failures.items():
        text += f"\n**{name} failed:**\n\n```\n{error.strip()[-2000:]}\n```\n"
    (args.out / "results.md").write_text(text)
    print(text)
    if args.pipeline is not None:  # pipeline stages: their own comparison (benchmarks/pipeline.py, docs/pipeline.md)
        import pipeline

        pipeline_rows = pipeline.main(args.pipeline)
        (args.out / "pipeline.md").write_text(pipeline.markdown(pipeline_rows, "python benchmarks/pipeline.py " +
                                                               " ".join(args.pipeline)))
    if failures:
        raise SystemExit(f"{len(failures)} layout(s) failed: {', '.join(failures)}; the others' results are in "
                         f"{args.out}")
    return results


if __name__ == "__main__":
    main()
