"""Long sequences in less memory, side by side on the CPU: the chunked loss, tiled MLPs, activation offloading, fused
RMSNorms.

    python benchmarks/long_context.py [--hidden 256 --layers 2 --vocab 32000 --seq 4096 --cap-mib 512]
    python benchmarks/long_context.py --loss-only          # part 1 only
    python benchmarks/long_context.py --cap-only           # part 3 only
    python benchmarks/long_context.py --norm-only --vocab 512 --cap-mib 128 --step 128   # part 6 only
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
6. (4 is the GPU's, 5 the comparison with ALST in docs/long_context.md.) The fused RMSNorm
   (``MemoryKwargs(fused_rms_norm=True)``), measured against the planner: (a) on a small bf16 Llama
   in one process, the bytes autograd saves (ndparallel.test_utils.memory) and the most bytes of tensors alive at
   once in a forward + backward (ndparallel.test_utils.memory's `LiveBytes`), without and with it; (b) for part 2's
   model and layout with the chunked loss and tiled MLPs (offloading moves nothing on the CPU, and the planner's CPU
   prediction leaves it out), the step's peak per rank at --seq tokens and the longest sequence within --cap-mib (a
   multiple of --step, part 3's search), without and with the fused norm, each beside what the planner's memory
   model (`ndparallel.planner.footprint.estimate`, no allocator reserve on the CPU: the step's allocated bytes above
   the parameters and optimizer state) predicts for the same model, layout and cap, and the growth factor of both.

How memory is measured: each measurement runs in freshly forked processes (`run_ranks`), glibc told to serve
large blocks from mmap so that freed memory leaves the resident set, the peak resident set size (Linux VmHWM, reset
through /proc/self/clear_refs) minus the resident set before the step -- so transients count, and the weights and
optimizer state (there before) do not. tracemalloc would see none of torch's allocations. On the CPU activation
offloading moves nothing (host memory is the memory): its rows measure the cost of the path, and its memory is
measured on a GPU (part 4, `--gpu`). Speed ratios compare runs of this one invocation (shared cores: rerun for
noise).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

from common import llama, llama_config  # noqa: E402
from common import peak_above_now as _peak_of  # noqa: E402
from common import serve_large_blocks_from_mmap as _mmap_large_blocks  # noqa: E402

from ndparallel.test_utils import run_ranks  # noqa: E402

MiB, GiB = 2**20, 2**30
SETTINGS = {  # name -> (MemoryKwargs fields, offload)
    "plain FSDP2 + AC": ({"chunked_loss": False}, False),
    "+ chunked loss": ({}, False),
    "+ tiled MLP": ({"chunked_loss": False, "tiled_mlp": True}, False),
    "+ offload": ({"chunked_loss": False}, True),
    "all together": ({"tiled_mlp": True}, True),
}
NORM_SETTINGS = {  # part 6: the fused RMSNorm on top of the chunked loss and tiled MLPs (checkpointing on)
    "chunked loss + tiled MLP": ({"tiled_mlp": True}, False),
    "+ fused RMSNorm": ({"tiled_mlp": True, "fused_rms_norm": True}, False),
}


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
def model_config(seq: int, hidden: int, layers: int, vocab: int, head_dim: int):
    return llama_config(vocab=vocab, hidden=hidden, layers=layers, intermediate=4 * hidden, heads=4, kv_heads=2,
                        max_positions=max(seq, 1024), head_dim=head_dim, use_cache=False)


def _train_run(setting: str, seq: int, hidden: int, layers: int, vocab: int, head_dim: int, timed: int) -> dict:
    _mmap_large_blocks()
    from transformers import LlamaForCausalLM

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, MemoryKwargs, ParallelismConfig

    fields, offload = {**SETTINGS, **NORM_SETTINGS}[setting]
    checkpointing = {"every": 1, "offload": True} if offload else True
    accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2),
                              fsdp_plugin=FullyShardedDataParallelPlugin(activation_checkpointing=checkpointing),
                              kwargs_handlers=[MemoryKwargs(**fields)])
    torch.manual_seed(0)
    model = accelerator.prepare(LlamaForCausalLM(model_config(seq, hidden, layers, vocab, head_dim)))
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


def longest_within(cap: int, setting: str, args: argparse.Namespace, step: int = 1024, fits=None) -> int:
    """The longest multiple of `step` up to --max-seq whose step's peak per rank (`train`) is within `cap`: doubling
    from 1024 tokens, then bisection down to `step` (memory grows with the length). `fits(length)`: another test of
    a length than a measured step (part 6 searches the planner's prediction so)."""
    fits = fits or (lambda length: train(setting, length, args)["peak"] <= cap)
    fits_at, length = 0, 1024
    while length <= args.max_seq and fits(length):
        fits_at, length = length, 2 * length
    if length > args.max_seq:
        return fits_at
    lo, hi = fits_at, length
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if fits(mid):
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


# ---- 6. the fused RMSNorm, measured against the planner ---------------------------------------------------------------
def _norm_bytes(fused: bool, hidden: int, tokens: int) -> dict:
    """(a) A bf16 Llama (vocabulary 96, 8 / 4 heads; hidden `hidden`, 2 layers), one forward + backward of
    `tokens` tokens: the bytes autograd saves for backward, and the most bytes of tensors alive at once."""
    from ndparallel.parallel.memory.rms_norm import apply_fused_rms_norm
    from ndparallel.test_utils.memory import LiveBytes, training_step_kept_bytes

    model = llama(vocab=96, hidden=hidden, layers=2, intermediate=4 * hidden, max_positions=tokens)
    model = model.to(torch.bfloat16)
    if fused:
        apply_fused_rms_norm(model)
    ids = torch.randint(0, 96, (1, tokens), generator=torch.Generator().manual_seed(1))
    saved = training_step_kept_bytes(model, ids)
    model.zero_grad(set_to_none=True)
    with LiveBytes() as live:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return {"saved": saved, "peak": live.peak, "norms": 2 * model.config.num_hidden_layers + 1}


def predicted_step_peak(seq: int, setting: str, args: argparse.Namespace) -> float:
    """The planner's peak of part 6's step on one rank above the parameters and optimizer state (the CPU model:
    no allocator reserve; benchmarks/planner_check.py's `predicted_step_peak`)."""
    from ndparallel.planner import Layout, Recipe, spec_from_config
    from ndparallel.planner.footprint import estimate

    fields, offload = NORM_SETTINGS[setting]
    spec = spec_from_config(model_config(seq, args.hidden, args.layers, args.vocab, args.head_dim).to_dict(), "bench")
    recipe = Recipe(seq, 1, 1, "fp32", True, chunked_loss=fields.get("chunked_loss", True),
                    tiled_mlp=fields.get("tiled_mlp", False), offload=offload,
                    fused_norms=fields.get("fused_rms_norm", False))
    memory = estimate(spec, Layout(dp_shard=2), recipe)
    return memory["allocated"] - memory["params"] - memory["optimizer"]


def norm_table(args: argparse.Namespace) -> None:
    hidden, tokens = 64, 1024
    print(f"\n6a. The fused RMSNorm on a bf16 Llama (hidden {hidden}, MLP {4 * hidden}, 2 layers, 8 / 4 heads, "
          f"vocabulary 96), one forward + backward of {tokens} tokens in one process, no "
          "checkpointing\n")
    rows = {fused: run_ranks(_norm_bytes, 1, fused, hidden, tokens, timeout=600)[0] for fused in (False, True)}
    print(f"{'':<18} {'saved for backward':>19} {'live bytes at the peak':>23}")
    for fused, name in ((False, "model's own norms"), (True, "fused RMSNorms")):
        print(f"{name:<18} {rows[fused]['saved']:>17,} B {rows[fused]['peak']:>21,} B")
    less = {key: rows[False][key] - rows[True][key] for key in ("saved", "peak")}
    print(f"{'less by':<18} {less['saved']:>17,} B {less['peak']:>21,} B   (4 h bytes per token per norm: "
          f"{rows[True]['norms']} x {tokens} x {hidden} x 4 = {rows[True]['norms'] * tokens * hidden * 4:,} B)")

    cap = int(args.cap_mib * MiB)
    print(f"\n6b. Part 2's model (hidden {args.hidden}, {args.layers} layers, heads of {args.head_dim}, MLP "
          f"{4 * args.hidden}, vocabulary {args.vocab}), FSDP2 over 2 ranks, full activation checkpointing, fp32: the "
          f"step's peak per rank at {args.seq} tokens, and the longest sequence within {args.cap_mib:g} MiB per rank "
          f"(multiples of {args.step}), measured and predicted by the planner\n")
    print(f"{'setting':<26} {'peak measured':>14} {'predicted':>10} {'meas/pred':>9} {'longest measured':>17} "
          f"{'predicted':>10}")
    longest = {}
    for setting in NORM_SETTINGS:
        measured = train(setting, args.seq, args)["peak"]
        predicted = predicted_step_peak(args.seq, setting, args)
        found = longest_within(cap, setting, args, args.step)
        planned = longest_within(cap, setting, args, args.step,
                                 fits=lambda length, s=setting: predicted_step_peak(length, s, args) <= cap)
        longest[setting] = (found, planned)
        print(f"{setting:<26} {measured / MiB:>10.1f} MiB {predicted / MiB:>6.1f} MiB {measured / predicted:>9.3f} "
              f"{found:>17,} {planned:>10,}", flush=True)
    (before, plan_before), (after, plan_after) = longest.values()
    grown, predicted = after / max(before, 1), plan_after / max(plan_before, 1)
    print(f"\nthe longest sequence grows by {grown:.3f}x measured, {predicted:.3f}x predicted: measured / predicted "
          f"= {grown / predicted:.3f} ({'within' if abs(grown / predicted - 1) <= 0.15 else 'NOT within'} 15%)")


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
    p.add_argument("--norm-only", action="store_true", help="part 6 only (the fused RMSNorm)")
    p.add_argument("--step", type=int, default=128, help="part 6: the longest sequence is a multiple of this")
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
    if args.norm_only:
        norm_table(args)
        return
    loss_table(args)
    if args.loss_only:
        return
    step_table(args)
    if not args.no_cap:
        cap_table(args)
    norm_table(args)


if __name__ == "__main__":
    main()
