"""One-GPU figures: CP/SP attention's block path against SDPA's fused kernel, and training through the library
against plain PyTorch. Prints one table and writes it (Markdown) and the raw figures (JSON) to --out.

    python benchmarks/gpu.py [--out gpu_check_out] [--seq-lens 8192 32768 131072] [--model-layers 16]
    bash scripts/gpu_check.sh            # the GPU test tier, then this

(a) Attention, forward + backward, bf16, batch 1, 32 query heads / 8 K/V heads, head dim 128, causal. The block
    path is ring attention over a one-rank group with the load-balanced layout -- two chunks: a causal block for
    each and a full block between them, merged by log-sum-exp -- i.e. exactly the kernels and merges one rank of a
    context-parallel group runs, with nothing to communicate. SDPA runs on the whole sequence (it picks its fused
    kernel). Medians of --repeats timed runs after a warm-up; peak memory above what the inputs hold.
(b) Training a Llama of about 1B parameters (random init from a config; hidden 2048, 16 layers, 32/8 heads,
    vocabulary 32000), bf16 autocast with fp32 master weights, AdamW, sequence 4096, batch 1, activation
    checkpointing off and on: `Accelerator.prepare` on one process against the same loop in plain PyTorch,
    --train-rounds alternating runs of each. Tokens/s (median of the pooled steps after warm-up), their ratio, and
    MFU against this GPU's *measured* bf16 matmul rate (8192^3 matmuls), also reported.
(c) The same model through `prepare` with mixed_precision="fp8" (torchao float8 layers) against "bf16", when
    torchao is installed: tokens/s ratio and the largest gap between the two loss curves.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from common import llama, write_results


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured_bf16_peak(device: torch.device, n: int = 8192, reps: int = 20) -> float:
    n = n if device.type == "cuda" else 256  # --device cpu only checks that the program runs
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def timed(fn, repeats: int, device: torch.device) -> tuple[float, int]:
    """(median seconds, peak bytes allocated above the level before the first call; 0 off CUDA) of `fn()`."""
    fn()  # warm-up (kernel selection, allocator)
    sync(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), (torch.cuda.max_memory_allocated(device) - base) if cuda else 0


# ---- (a) attention -------------------------------------------------------------------------------------------------
def attention_rows(seq_lens: list[int], repeats: int, device: torch.device, heads: int = 32,
                   kv_heads: int = 8) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from ndparallel.parallel.sequence import SequenceChunking, kernels
    from ndparallel.parallel.sequence.ring import ring_attention

    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if cuda else None)
    rows = []
    try:
        for seq in seq_lens:
            g = torch.Generator(device).manual_seed(seq)
            q, dout = (torch.randn(1, heads, seq, 128, device=device, generator=g, dtype=torch.bfloat16)
                       for _ in range(2))
            k, v = (torch.randn(1, kv_heads, seq, 128, device=device, generator=g, dtype=torch.bfloat16)
                    for _ in range(2))
            leaves = [t.requires_grad_() for t in (q, k, v)]
            chunking = SequenceChunking(seq, 1, 0, load_balance=True)
            scale = 128 ** -0.5

            def block_path():
                ring_attention(*leaves, chunking, dist.group.WORLD, True, scale).backward(dout)

            def sdpa():
                F.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale, enable_gqa=True).backward(dout)

            block_s, block_mem = timed(block_path, repeats, device)
            sdpa_s, sdpa_mem = timed(sdpa, repeats, device)
            backend = kernels.choose_backend(device.type, q.dtype, 128,
                                             torch.cuda.get_device_capability(device) if cuda else None)
            rows.append({"seq_len": seq, "block_kernel": backend, "block_s": block_s, "sdpa_s": sdpa_s,
                         "time_ratio": block_s / sdpa_s, "block_peak_bytes": block_mem, "sdpa_peak_bytes": sdpa_mem,
                         "memory_ratio": block_mem / max(sdpa_mem, 1)})
            for t in leaves:
                t.grad = None
            print(f"attention {seq:>7}: block path {block_s * 1e3:8.1f} ms, SDPA {sdpa_s * 1e3:8.1f} ms "
                  f"({block_s / sdpa_s:.2f}x); peak {block_mem / 2**30:.2f} / {sdpa_mem / 2**30:.2f} GiB", flush=True)
    finally:
        dist.destroy_process_group()
    return rows


# ---- (b) training --------------------------------------------------------------------------------------------------
def llama_1b(layers: int, hidden: int = 2048, seq: int = 4096):
    return llama(vocab=32000, hidden=hidden, layers=layers, intermediate=4 * hidden, heads=32, kv_heads=8,
                 max_positions=seq, use_cache=False)


def train_step_times(use_library: bool, checkpointing: bool, layers: int, hidden: int, seq: int, steps: int,
                     device: torch.device, precision: str = "bf16") -> tuple[list[float], list[float]]:
    """(seconds of each step after 3 warm-up steps, every step's loss) of `steps` steps on random tokens; the
    library runs in `precision` ("bf16", or "fp8": torchao float8 layers)."""
    model = llama_1b(layers, hidden, seq)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 32000, (1, seq), generator=g) for _ in range(steps)]
    if use_library:
        from ndparallel import Accelerator, FullyShardedDataParallelPlugin

        accelerator = Accelerator(mixed_precision=precision, fsdp_plugin=FullyShardedDataParallelPlugin(
            activation_checkpointing=checkpointing))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = accelerator.prepare(model, optimizer)
        backward, context = accelerator.backward, contextlib.nullcontext()  # prepare() casts
    else:
        model = model.to(device)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        backward, context = (lambda loss: loss.backward()), torch.autocast(device.type, dtype=torch.bfloat16)
    model.train()
    times, losses = [], []
    for ids in batches:
        ids = ids.to(device)
        sync(device)
        start = time.perf_counter()
        with context:
            loss = model(input_ids=ids, labels=ids).loss
        backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    if use_library:
        accelerator.end_training()
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times[3:], losses


def training_rows(layers: int, hidden: int, seq: int, steps: int, device: torch.device, peak: float,
                  rounds: int = 2) -> list[dict[str, Any]]:
    """Plain and library runs alternate `rounds` times (a fresh model each): step times on a GPU whose host CPU is
    the bottleneck (activation checkpointing's Python hooks, seen on an H100 host) vary by +-15% from run to run, so
    one run of each can differ by that much with no cause in the code. Tokens/s: seq / the median pooled step."""
    from ndparallel.training.metrics import flops_per_token

    per_token = flops_per_token(llama_1b(layers, hidden, seq).config, seq)
    rows = []
    for checkpointing in (False, True):
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(rounds):
            for use_library in (False, True):
                step_times, losses = train_step_times(use_library, checkpointing, layers, hidden, seq, steps, device)
                times[use_library] += step_times
                if use_library:
                    lib_loss = losses[-1]
                else:
                    plain_loss = losses[-1]
        plain, lib = (seq / statistics.median(times[use]) for use in (False, True))
        rows.append({"activation_checkpointing": checkpointing, "plain_tokens_per_s": plain,
                     "library_tokens_per_s": lib, "ratio": lib / plain, "plain_mfu": plain * per_token / peak,
                     "library_mfu": lib * per_token / peak, "plain_final_loss": plain_loss,
                     "library_final_loss": lib_loss})
        print(f"training AC={'on' if checkpointing else 'off'}: library {lib:,.0f} tokens/s, plain {plain:,.0f} "
              f"({lib / plain:.3f}x); MFU {lib * per_token / peak:.1%} / {plain * per_token / peak:.1%}", flush=True)
    return rows


def fp8_rows(layers: int, hidden: int, seq: int, steps: int, device: torch.device, peak: float,
             rounds: int = 2) -> list[dict[str, Any]]:
    """The library in fp8 (torchao float8 layers, `mixed_precision="fp8"`) against itself in bf16, alternating
    `rounds` runs each, activation checkpointing off: tokens/s, and how far the fp8 losses stray from bf16's (same
    model, data and optimizer)."""
    import importlib.util

    from ndparallel.training.metrics import flops_per_token

    if importlib.util.find_spec("torchao") is None:
        print("fp8: skipped (torchao is not installed)", flush=True)
        return []
    per_token = flops_per_token(llama_1b(layers, hidden, seq).config, seq)
    times: dict[str, list[float]] = {"bf16": [], "fp8": []}
    curves: dict[str, list[float]] = {}
    for _ in range(rounds):
        for precision in ("bf16", "fp8"):
            step_times, losses = train_step_times(True, False, layers, hidden, seq, steps, device, precision)
            times[precision] += step_times
            curves.setdefault(precision, losses)
    bf16, fp8 = (seq / statistics.median(times[p]) for p in ("bf16", "fp8"))
    gap = max(abs(a - b) for a, b in zip(curves["bf16"], curves["fp8"]))
    print(f"training fp8: {fp8:,.0f} tokens/s, bf16 {bf16:,.0f} ({fp8 / bf16:.3f}x); largest loss gap {gap:.4f} "
          f"over {steps} steps", flush=True)
    return [{"bf16_tokens_per_s": bf16, "fp8_tokens_per_s": fp8, "ratio": fp8 / bf16, "max_loss_gap": gap,
             "bf16_mfu": bf16 * per_token / peak, "fp8_mfu_of_bf16_peak": fp8 * per_token / peak,
             "bf16_losses": curves["bf16"], "fp8_losses": curves["fp8"]}]


def markdown(info: dict[str, Any], attention: list[dict], training: list[dict], fp8: list[dict] = ()) -> str:
    lines = [f"GPU check: {info['device']}, torch {info['torch']}, {info['date']}; measured bf16 matmul "
             f"{info['measured_bf16_tflops']:.0f} TFLOP/s", "",
             "| seq len | block kernel | block path ms | SDPA ms | time ratio (<= 1.10) | block peak GiB | "
             "SDPA peak GiB | memory ratio (<= 1.10) |", "|---|---|---|---|---|---|---|---|"]
    for r in attention:
        lines.append(f"| {r['seq_len']} | {r['block_kernel']} | {r['block_s'] * 1e3:.1f} | {r['sdpa_s'] * 1e3:.1f} | "
                     f"{r['time_ratio']:.2f} | {r['block_peak_bytes'] / 2**30:.2f} | "
                     f"{r['sdpa_peak_bytes'] / 2**30:.2f} | {r['memory_ratio']:.2f} |")
    lines += ["", "| activation checkpointing | library tokens/s | plain tokens/s | ratio (>= 0.98) | library MFU | "
              "plain MFU |", "|---|---|---|---|---|---|"]
    for r in training:
        lines.append(f"| {'on' if r['activation_checkpointing'] else 'off'} | {r['library_tokens_per_s']:,.0f} | "
                     f"{r['plain_tokens_per_s']:,.0f} | {r['ratio']:.3f} | {r['library_mfu']:.1%} | "
                     f"{r['plain_mfu']:.1%} |")
    if fp8:
        lines += ["", "| library fp8 tokens/s | library bf16 tokens/s | fp8 / bf16 | largest loss gap | "
                  "bf16 MFU |", "|---|---|---|---|---|"]
        for r in fp8:
            lines.append(f"| {r['fp8_tokens_per_s']:,.0f} | {r['bf16_tokens_per_s']:,.0f} | {r['ratio']:.3f} | "
                         f"{r['max_loss_gap']:.4f} | {r['bf16_mfu']:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    p.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model-layers", type=int, default=16, help="16: about 1.1B parameters")
    p.add_argument("--train-seq-len", type=int, default=4096)
    p.add_argument("--train-steps", type=int, default=10)
    p.add_argument("--train-rounds", type=int, default=2, help="alternating plain/library runs per setting")
    p.add_argument("--skip", choices=["attention", "training", "fp8"], action="append", default=[])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: only checks that the program runs (tests do, with tiny sizes); figures mean nothing")
    p.add_argument("--model-hidden", type=int, default=2048, help=argparse.SUPPRESS)  # tiny for the CPU check
    p.add_argument("--attention-heads", type=int, nargs=2, default=[32, 8], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU; none is visible to torch")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    peak = measured_bf16_peak(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (a program check, not figures)"
    info = {"device": name, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "measured_bf16_tflops": peak / 1e12}
    print(f"{info['device']}, torch {info['torch']}: measured bf16 matmul {peak / 1e12:.0f} TFLOP/s", flush=True)
    attention = [] if "attention" in args.skip else attention_rows(args.seq_lens, args.repeats, device,
                                                                    *args.attention_heads)
    training = [] if "training" in args.skip else training_rows(args.model_layers, args.model_hidden,
                                                                 args.train_seq_len, args.train_steps, device, peak,
                                                                 args.train_rounds)
    fp8 = [] if "fp8" in args.skip else fp8_rows(args.model_layers, args.model_hidden, args.train_seq_len,
                                                  args.train_steps, device, peak, args.train_rounds)
    table = markdown(info, attention, training, fp8)
    write_results(args.out, "gpu_check", table, {**info, "attention": attention, "training": training, "fp8": fp8})
    print("\n" + table + f"\nwritten to {args.out}/gpu_check.md and gpu_check.json")
    return {"info": info, "attention": attention, "training": training, "fp8": fp8}


if __name__ == "__main__":
    main()
