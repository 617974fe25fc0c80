"""Long sequences in less memory, side by side on the CPU: the chunked loss, tiled MLPs, activation offloading.

    python benchmarks/long_context.py [--hidden 256 --layers 2 --vocab 32000 --seq 4096 --cap-mib 512]
    python benchmarks/long_context.py --loss-only          # part 1 only
    python benchmarks/long_context.py --cap-only           # part 3 only
    python benchmarks/long_context.py --gpu               # on a CUDA GPU (scripts/gpu_check.sh): see `gpu_rows`

1. The loss alone: the LM head and transformers' ``ForCausalLMLoss`` on the full logits ("plain") next to
   ``linear_cross_entropy`` (chunked), fp32, on hidden states of ``tokens x hidden`` and a ``vocab x hidden`` head:
   the working set (peak resident memory of forward + backward above what existed before: logits, their fp32
   copy, log-softmax, gradients; for the chunked loss one chunk's, plus the head's and the hidden states' gradients)
   and the time, for each vocabulary and length. A plain run that would need more than --plain-limit-gib is not run.
2. One training step of a Llama-shaped model (hidden --hidden, --layers layers, MLP 4 x hidden, vocabulary --vocab)
   under FSDP2 over 2 ranks with activation checkpointing, one sequence of --seq tokens per rank: peak memory per
   rank above the state before the step, and the step time, for plain FSDP2 + checkpointing (the model's own loss),
   + chunked loss, + tiled MLP, + offload, and all together.
3. The longest sequence (a multiple of 1024, up to --max-seq) whose step stays within --cap-mib per rank, for the
   same settings. (Attention heads of 16 by default keep the CPU's attention time at long sequences bearable.)

How memory is measured: each measurement runs in freshly forked processes (tests/harness.py), glibc told to serve
large blocks from mmap so that freed memory leaves the resident set, the peak resident set size (Linux VmHWM, reset
through /proc/self/clear_refs) minus the resident set before the step -- so transients count, and the weights and
optimizer state (there before) do not. tracemalloc would see none of torch's allocations. On the CPU activation
offloading moves nothing (host memory is the memory): its rows measure the cost of the path, and its memory is
measured on a GPU (part 4, `--gpu`). Speed ratios compare runs of this one invocation (shared cores: rerun for
noise).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

from harness import run_ranks  # noqa: E402

MiB, GiB = 2**20, 2**30
SETTINGS = {  # name -> (MemoryKwargs fields, offload)
    "plain FSDP2 + AC": ({"chunked_loss": False}, False),
    "+ chunked loss": ({}, False),
    "+ tiled MLP": ({"chunked_loss": False, "tiled_mlp": True}, False),
    "+ offload": ({"chunked_loss": False}, True),
    "all together": ({"tiled_mlp": True}, True),
}


def _mmap_large_blocks() -> None:
    try:  # large blocks straight from mmap, returned at free: the resident set follows what tensors hold
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _rss(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(key)


def _peak_of(fn) -> tuple[int, float]:
    """(peak resident bytes above the resident set before, seconds) of one call of `fn`."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss("VmRSS")
    start = time.perf_counter()
    fn()
    return _rss("VmHWM") - before, time.perf_counter() - start


# ---- 1. the loss alone -----------------------------------------------------------------------------------------------
def _loss_inputs(tokens: int, vocab: int, hidden: int):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, tokens, hidden, generator=g).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).requires_grad_(True)
    return h, w, torch.randint(0, vocab, (1, tokens), generator=g)


def _loss_step(kind: str, h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> None:
    from ndparallel.parallel.memory.cross_entropy import linear_cross_entropy

    if kind == "plain":
        loss = ForCausalLMLoss(F.linear(h, w), labels, w.shape[0])
    else:
        loss = linear_cross_entropy(h, w, None, F.pad(labels[..., 1:], (0, 1), value=-100))
    loss.backward()
    h.grad = w.grad = None


def _loss_memory(kind: str, tokens: int, vocab: int, hidden: int) -> int:
    _mmap_large_blocks()
    h, w, labels = _loss_inputs(tokens, vocab, hidden)
    _loss_step(kind, h, w, labels)  # warm-up
    return _peak_of(lambda: _loss_step(kind, h, w, labels))[0]


def _loss_times(kinds: list[str], tokens: int, vocab: int, hidden: int, repeats: int) -> dict[str, float]:
    """Median seconds of each kind, the kinds interleaved in one process (shared cores: noise hits both alike)."""
    _mmap_large_blocks()
    h, w, labels = _loss_inputs(tokens, vocab, hidden)
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(repeats + 1):
        for kind in kinds:
            times[kind].append(_peak_of(lambda: _loss_step(kind, h, w, labels))[1])
    return {kind: statistics.median(t[1:]) for kind, t in times.items()}


def loss_table(args: argparse.Namespace) -> None:
    print(f"1. The loss alone: head {args.hidden} -> vocabulary, fp32, one process per measurement (working set = "
          "peak resident memory of forward + backward above the state before; time: median of 3, the two interleaved "
          "in one process)\n")
    print(f"{'vocab':>7} {'tokens':>7} {'plain':>12} {'chunked':>12} {'shrink':>7} {'plain s':>8} {'chunked s':>9} "
          f"{'time ratio':>10}")
    for vocab in args.loss_vocabs:
        for tokens in args.loss_tokens:
            plain_bytes = 4.0 * tokens * vocab * 4  # logits, log-softmax, their gradients: what the plain loss holds
            chunked = run_ranks(_loss_memory, 1, "chunked", tokens, vocab, args.hidden, timeout=3600)[0]
            if plain_bytes > args.plain_limit_gib * GiB:
                t = run_ranks(_loss_times, 1, ["chunked"], tokens, vocab, args.hidden, 3, timeout=3600)[0]
                print(f"{vocab:>7} {tokens:>7} {'not run':>12} {chunked / MiB:>8.0f} MiB {'':>7} {'':>8} "
                      f"{t['chunked']:>9.2f}   (plain would hold ~{plain_bytes / GiB:.1f} GiB)", flush=True)
                continue
            plain = run_ranks(_loss_memory, 1, "plain", tokens, vocab, args.hidden, timeout=3600)[0]
            t = run_ranks(_loss_times, 1, ["plain", "chunked"], tokens, vocab, args.hidden, 3, timeout=3600)[0]
            print(f"{vocab:>7} {tokens:>7} {plain / MiB:>8.0f} MiB {chunked / MiB:>8.0f} MiB "
                  f"{plain / max(chunked, 1):>6.1f}x {t['plain']:>8.2f} {t['chunked']:>9.2f} "
                  f"{t['chunked'] / t['plain']:>9.2f}x", flush=True)


# ---- 2 and 3. a training step ----------------------------------------------------------------------------------------
def _train_run(setting: str, seq: int, hidden: int, layers: int, vocab: int, head_dim: int, timed: int) -> dict:
    _mmap_large_blocks()
    from transformers import LlamaConfig, LlamaForCausalLM

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, MemoryKwargs, ParallelismConfig

    fields, offload = SETTINGS[setting]
    checkpointing = {"every": 1, "offload": True} if offload else True
    accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2),
                              fsdp_plugin=FullyShardedDataParallelPlugin(activation_checkpointing=checkpointing),
                              kwargs_handlers=[MemoryKwargs(**fields)])
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                         max_position_embeddings=max(seq, 1024),
                         tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)
    model = accelerator.prepare(LlamaForCausalLM(config))
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-4))
    model.train()

    def step(length: int) -> None:
        ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(length))
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(256)  # warm-up: optimizer state and one-time allocations exist before the measured step
    peak, seconds = _peak_of(lambda: step(seq))
    times = [_peak_of(lambda: step(seq))[1] for _ in range(timed)]
    accelerator.end_training()
    return {"peak": peak, "time": statistics.median(times) if times else seconds}


def train(setting: str, seq: int, args: argparse.Namespace, timed: int = 0) -> dict:
    ranks = run_ranks(_train_run, 2, setting, seq, args.hidden, args.layers, args.vocab, args.head_dim, timed,
                      timeout=7200)
    return {"peak": max(r["peak"] for r in ranks), "time": max(r["time"] for r in ranks)}


def step_table(args: argparse.Namespace) -> None:
    print(f"\n2. One training step: Llama hidden {args.hidden}, {args.layers} layers, 4 query / 2 KV heads of "
          f"{args.head_dim}, MLP {4 * args.hidden}, vocabulary {args.vocab}, FSDP2 over 2 ranks, full activation "
          f"checkpointing, AdamW, one sequence of {args.seq} tokens per rank, fp32 (largest value over ranks)\n")
    print(f"{'setting':<18} {'peak per rank':>14} {'vs plain':>9} {'step s':>8} {'vs plain':>9}")
    base = None
    for setting in SETTINGS:
        r = train(setting, args.seq, args, timed=2)
        base = base or r
        print(f"{setting:<18} {r['peak'] / MiB:>10.0f} MiB {r['peak'] / base['peak']:>8.2f}x {r['time']:>8.2f} "
              f"{r['time'] / base['time']:>8.2f}x", flush=True)


def longest_within(cap: int, setting: str, args: argparse.Namespace) -> int:
    fits, length = 0, 1024
    while length <= args.max_seq and train(setting, length, args)["peak"] <= cap:
        fits, length = length, 2 * length
    if length > args.max_seq:
        return fits
    lo, hi = fits, length
    while hi - lo > 1024:
        mid = (lo + hi) // 2 // 1024 * 1024
        if train(setting, mid, args)["peak"] <= cap:
            lo = mid
        else:
            hi = mid
    return lo


def cap_table(args: argparse.Namespace) -> None:
    print(f"\n3. Longest sequence whose step stays within {args.cap_mib:g} MiB per rank (multiples of 1024, searched up "
          f"to {args.max_seq})\n")
    print(f"{'setting':<18} {'tokens':>8} {'vs plain':>9}")
    base = None
    for setting in SETTINGS:
        tokens = longest_within(int(args.cap_mib * MiB), setting, args)
        base = base or max(tokens, 1)
        print(f"{setting:<18} {tokens:>8} {tokens / base:>8.1f}x", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16, help="attention head size (small: CPU attention stays cheap)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--cap-mib", type=float, default=768.0)
    p.add_argument("--max-seq", type=int, default=32768)
    p.add_argument("--loss-vocabs", type=int, nargs="+", default=[32000, 128256])
    p.add_argument("--loss-tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--plain-limit-gib", type=float, default=8.0)
    p.add_argument("--loss-only", action="store_true")
    p.add_argument("--no-cap", action="store_true", help="skip part 3 (the longest sequence)")
    p.add_argument("--cap-only", action="store_true", help="part 3 only")
    p.add_argument("--gpu", action="store_true", help="the GPU rows (scripts/gpu_check.sh)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.gpu:
        from long_context_gpu import gpu_rows

        gpu_rows([])
        return
    if args.cap_only:
        cap_table(args)
        return
    loss_table(args)
    if args.loss_only:
        return
    step_table(args)
    if not args.no_cap:
        cap_table(args)


if __name__ == "__main__":
    main()
