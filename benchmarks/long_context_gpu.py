"""Long sequences on one CUDA GPU: the GPU rows of issue 29, and the planner's memory checked against the allocator.

    python benchmarks/long_context_gpu.py [--out gpu_check_out] [--models 1b 3b] [--seqs 8192 32768]
                                          [--max-seq 131072]
    python benchmarks/long_context_gpu.py --issue50     # (c): issue 50's features and the allocator's reserve
    python benchmarks/long_context.py --gpu               # the same, with the defaults
    bash scripts/gpu_check.sh                             # the GPU check runs it after benchmarks/gpu.py

A ~1B and a ~3B Llama (Llama 3.2 1B's and 3B's shapes, random init from a config, vocabulary 128256, tied head),
bf16 mixed precision with fp32 master weights, AdamW, one sequence per step, through `Accelerator.prepare` on one
GPU (FSDP2 over one rank), in two settings: **all** -- activation checkpointing with offloading, the chunked loss,
tiled MLPs -- and **plain** -- FSDP2 with activation checkpointing and the model's own loss:

(a) at each --seqs length: ``torch.cuda.max_memory_reserved`` and ``max_memory_allocated`` over one step (after a
    warm-up step that creates the optimizer's state), against the planner's predicted peak and allocated
    (`ndparallel.planner.footprint.estimate` with this GPU's profile, its fragmentation constant included), and the
    tokens/s of --timed steps (median);
(b) the longest sequence, a multiple of 4096 up to --max-seq, whose step runs without a CUDA out-of-memory error,
    for each setting (doubling, then --bisect halvings).
(c) ``--issue50`` instead: the 1B and an **8B-shaped** Llama (Llama 3.1 8B's widths -- hidden 4096, MLP 14336, 32 /
    8 heads of 128 -- and 4 of its 32 layers) at 32,768 tokens, in **all** and in **all + issue 50** (the fused
    RMSNorm, and FSDP2's CPU offload of parameters, gradients and optimizer state: a one-rank shard group resharded
    after forward, offloaded activations in the host pool), each under the default allocator and under
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (set in the measuring process before CUDA starts): the
    measured peak beside the planner's, and the allocator's reserve (max reserved - max allocated), which the planner's
    `Hardware.fragmentation` constant stands for and which it does not know under expandable segments. No
    longest-sequence search (b) in this mode.

Each measurement runs in a fresh process (ndparallel.test_utils.run_ranks, one rank), so an out-of-memory error or the allocator's
cache of one run does not reach the next; this process never touches CUDA (a forked child tells it the GPU's name),
since a parent that initialised CUDA cannot fork children that use it. ``--device cpu`` runs a tiny model only to check that the program runs
(no memory figures there). Prints a Markdown table and writes it (long_context_gpu.md) and the raw figures
(long_context_gpu.json) to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

# This process forks the ranks that measure (ndparallel.test_utils.run_ranks) and must not initialise CUDA before it
# does; asked how many GPUs there are, torch then asks NVML rather than the CUDA driver.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # noqa: E402

from common import write_results  # noqa: E402

from ndparallel.test_utils import run_ranks  # noqa: E402

GiB = 2**30
MODELS = {  # name -> LlamaConfig fields (Llama 3.2 1B and 3B shapes)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128),
    "8b-shaped": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
}
SETTINGS = {  # name -> (MemoryKwargs fields, activation_checkpointing, FSDP2 cpu_offload), and the planner's flags
    "all": ({"chunked_loss": True, "tiled_mlp": True}, {"every": 1, "offload": True}, False),
    "plain": ({"chunked_loss": False}, True, False),
    "all + issue 50": ({"chunked_loss": True, "tiled_mlp": True, "fused_rms_norm": True}, {"every": 1, "offload": True},
                       True),
}
FEATURES = {"all": dict(chunked_loss=True, tiled_mlp=True, offload=True), "plain": dict(chunked_loss=False),
            "all + issue 50": dict(chunked_loss=True, tiled_mlp=True, offload=True, fused_norms=True,
                                   offload_params=True)}
ALLOCATORS = {"default": {}, "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
ISSUE50 = {"models": ["1b", "8b-shaped"], "seqs": [32768], "settings": ["all", "all + issue 50"],
           "allocators": ["default", "expandable"], "timed": 1}
QUANTUM = 4096


def config(model: str, seq: int, vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(**MODELS[model], vocab_size=vocab, max_position_embeddings=max(seq, 8192), use_cache=False,
                       tie_word_embeddings=True, attn_implementation="sdpa")


def _run(model: str, setting: str, seq: int, vocab: int, timed: int, cpu: bool) -> dict | None:
    """On the one rank: warm-up step, a step whose peak is read, `timed` steps; None on out-of-memory."""
    from transformers import LlamaForCausalLM

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, MemoryKwargs

    fields, checkpointing, cpu_offload = SETTINGS[setting]
    accelerator = Accelerator(mixed_precision="bf16", cpu=cpu, kwargs_handlers=[MemoryKwargs(**fields)],
                              fsdp_plugin=FullyShardedDataParallelPlugin(activation_checkpointing=checkpointing,
                                                                         cpu_offload=cpu_offload))
    cuda = accelerator.device.type == "cuda"
    torch.manual_seed(0)
    net = LlamaForCausalLM(config(model, seq, vocab))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-5)
    net, optimizer = accelerator.prepare(net, optimizer)
    net.train()
    g = torch.Generator().manual_seed(1)

    def step(length: int) -> None:
        ids = torch.randint(0, vocab, (1, length), generator=g).to(accelerator.device)
        accelerator.backward(net(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    try:
        step(min(seq, 1024))
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        step(seq)
        sync()
        reserved = torch.cuda.max_memory_reserved() if cuda else 0
        allocated = torch.cuda.max_memory_allocated() if cuda else 0
        times = []
        for _ in range(timed):
            start = time.perf_counter()
            step(seq)
            sync()
            times.append(time.perf_counter() - start)
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        accelerator.end_training()
    return {"reserved": reserved, "allocated": allocated,
            "tokens_per_s": seq / statistics.median(times) if times else None}


def run(model: str, setting: str, seq: int, args: argparse.Namespace, timed: int = 0,
        allocator: str = "default") -> dict | None:
    """`_run` in a fresh process; `allocator` names the CUDA allocator's settings (`ALLOCATORS`), which the process
    has in its environment before CUDA starts."""
    return run_ranks(_run, 1, model, setting, seq, args.vocab, timed, args.device == "cpu", timeout=3600,
                     env=ALLOCATORS[allocator])[0]


def predicted(model: str, setting: str, seq: int, vocab: int, gpu: str) -> tuple[float, float]:
    """(predicted peak, allocated) bytes of one step on one GPU (the planner's `estimate`)."""
    from ndparallel.planner import Layout, Recipe, get_hardware, spec_from_config
    from ndparallel.planner.footprint import estimate

    spec = spec_from_config(config(model, seq, vocab).to_dict(), model)
    memory = estimate(spec, Layout(), Recipe(seq, 1, 1, "bf16", True, **FEATURES[setting]),
                      get_hardware(gpu).fragmentation)
    return memory.peak, memory["allocated"]


def profile_name(name: str, total_memory: int) -> str:
    """The planner's hardware profile for a GPU of this name and memory (the H100's for one it does not know)."""
    for key, profile in (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80g")):
        if key in name:
            if profile == "a100-80g" and total_memory < 60 * GiB:
                return "a100-40g"
            return profile
    return "h100"  # an unknown GPU is compared with the H100's constants (said in the table's title)


def _gpu_facts(device: str) -> dict:
    """In a forked child (`gpu_facts`): whether the device is there, its name and its planner profile."""
    if device != "cuda":
        return {"available": True, "name": "CPU", "profile": "h100"}
    if not torch.cuda.is_available():
        return {"available": False, "name": "", "profile": "h100"}
    name = torch.cuda.get_device_name()
    return {"available": True, "name": name,
            "profile": profile_name(name, torch.cuda.get_device_properties(0).total_memory)}


def gpu_facts(device: str) -> dict:
    """What `_gpu_facts` finds, asked in a child process: a parent that initialised CUDA could not fork the ranks
    that use it ("Cannot re-initialize CUDA in forked subprocess"), so this process never touches torch.cuda."""
    return run_ranks(_gpu_facts, 1, device, timeout=600)[0]


def longest(model: str, setting: str, args: argparse.Namespace) -> int:
    fits, length = 0, QUANTUM
    while length <= args.max_seq and run(model, setting, length, args) is not None:
        fits, length = length, 2 * length
    if length > args.max_seq or not fits:
        return fits
    lo, hi = fits, length
    for _ in range(args.bisect):
        mid = (lo + hi) // 2 // QUANTUM * QUANTUM
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if run(model, setting, mid, args) is not None else (lo, mid)
    return lo


def gpu_rows(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["1b", "3b"])
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--max-seq", type=int, default=131072, help="longer: attention time grows as its square")
    p.add_argument("--bisect", type=int, default=3)
    p.add_argument("--timed", type=int, default=3)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a tiny model, no memory figures")
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=["all", "plain"])
    p.add_argument("--allocators", nargs="+", choices=list(ALLOCATORS), default=["default"],
                   help="expandable: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the measuring process")
    p.add_argument("--issue50", action="store_true",
                   help="(c): " + ", ".join(f"{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                                            for k, v in ISSUE50.items()) +
                        "; no longest-sequence search")
    args = p.parse_args(argv)
    if args.issue50:
        for name, value in ISSUE50.items():
            setattr(args, name, value)
    facts = gpu_facts(args.device)  # in a child: this process forks the measuring ranks, so it never touches CUDA
    if not facts["available"]:
        raise SystemExit("long_context_gpu: no CUDA GPU (--device cpu checks that the program runs)")
    if args.device == "cpu":
        args.models, args.seqs, args.vocab, args.max_seq, args.bisect, args.timed = ["tiny"], [256], 512, 8192, 1, 1
    gpu = facts["profile"]
    rows, lines = [], [f"### Long sequences on one {facts['name']} (planner profile {gpu})", "",
                       "| model | setting | allocator | seq | reserved GiB, measured / predicted | allocated GiB, "
                       "measured / predicted | reserve GiB, measured / predicted | tokens/s |",
                       "|---|---|---|---|---|---|---|---|"]
    for model in args.models:
        for seq in args.seqs:
            for setting in args.settings:
                for allocator in args.allocators:
                    r = run(model, setting, seq, args, args.timed, allocator)
                    peak, allocated = predicted(model, setting, seq, args.vocab, gpu)
                    rows.append({"model": model, "setting": setting, "allocator": allocator, "seq": seq,
                                 "measured": r, "predicted": {"peak": peak, "allocated": allocated}})
                    cells = ("out of memory",) * 3 + ("-",) if r is None else (
                        f"{r['reserved'] / GiB:.1f} / {peak / GiB:.1f} ({r['reserved'] / peak - 1:+.0%})",
                        f"{r['allocated'] / GiB:.1f} / {allocated / GiB:.1f} ({r['allocated'] / allocated - 1:+.0%})",
                        f"{(r['reserved'] - r['allocated']) / GiB:.2f} / {(peak - allocated) / GiB:.2f}",
                        f"{r['tokens_per_s']:,.0f}")
                    lines.append(f"| {model} | {setting} | {allocator} | {seq} | " + " | ".join(cells) + " |")
                    print(lines[-1], flush=True)
    if args.issue50:
        result = {"gpu": gpu, "rows": rows}
        write_results(args.out, "long_context_gpu_issue50", "\n".join(lines) + "\n", result, indent=1)
        return result
    first, second = args.settings[0], args.settings[-1]
    lines += ["", f"| model | longest sequence, {first} | {second} | ratio |", "|---|---|---|---|"]
    longest_rows = {}
    for model in args.models:
        found = {setting: longest(model, setting, args) for setting in args.settings}
        longest_rows[model] = found
        ratio = f"{found[first] / found[second]:.1f}x" if found[second] else "-"
        lines.append(f"| {model} | {found[first]:,} | {found[second]:,} | {ratio} |")
        print(lines[-1], flush=True)
    result = {"gpu": gpu, "rows": rows, "longest": longest_rows}
    write_results(args.out, "long_context_gpu", "\n".join(lines) + "\n", result, indent=1)
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    gpu_rows()
