"""Context parallelism on one long sequence: activation memory per rank, the longest sequence under a memory cap,
and step time of all-gather vs ring attention, at cp 1, 2 and 4.

    python benchmarks/context_parallel.py [--seq-len 8192] [--cap-mib 48] [--hidden-size 64] [--layers 2]

Each configuration runs in freshly forked gloo ranks on the CPU (one thread each): a small Llama (GQA) prepared by
the Accelerator with ``cp_size`` = 1, 2 or 4, one training step (forward + backward) on one sequence inside
``maybe_context_parallel``, after a short warm-up step. Per rank it measures

- saved activations: bytes of the tensors autograd saves for backward during forward (saved-tensor hooks,
  each storage counted once);
- peak activation memory: the peak resident set size during forward + backward minus the resident set size before
  it (Linux: /proc/self/status VmHWM, reset through /proc/self/clear_refs), so it includes the transients too --
  attention blocks, gathered K/V, communication buffers -- but not the weights, which exist before the step;
- step time: the median of three forward + backward passes.

Tables show the largest value over ranks. The "longest sequence" search doubles the length while the peak
activation memory stays under the cap, then bisects to a multiple of 512 tokens. On a machine with fewer cores
than ranks the ranks share cores, so compare step times within a row (all-gather vs ring), not across cp sizes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import llama, peak_above_now, serve_large_blocks_from_mmap  # noqa: E402

from ndparallel.test_utils import run_ranks  # noqa: E402

MiB = 2**20


def _step(accelerator, model, seq_len: int, saved: list[int] | None = None) -> None:
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))
    batch = {"input_ids": ids, "labels": ids.clone(),
             "shift_labels": torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100),
             "position_ids": torch.arange(seq_len).unsqueeze(0)}
    buffers = list(batch.values())
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if saved is not None and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            saved[0] += storage.nbytes()
        return t

    with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * 4, no_restore_buffers=set(buffers)):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**batch).loss
        loss.backward()
    model.zero_grad(set_to_none=True)


def _measure(cp: int, strategy: str, seq_len: int, hidden: int, layers: int, timed: int) -> dict:
    """One rank: memory of one step at `seq_len`, and the median time of `timed` steps."""
    serve_large_blocks_from_mmap()
    from ndparallel import Accelerator, ParallelismConfig, TorchContextParallelConfig

    accelerator = Accelerator(parallelism_config=ParallelismConfig(
        cp_size=cp, cp_handler=TorchContextParallelConfig(cp_comm_strategy=strategy)))
    model = accelerator.prepare(llama(vocab=256, hidden=hidden, layers=layers, intermediate=2 * hidden, heads=4,
                                      kv_heads=2, max_positions=seq_len, use_cache=False))
    model.train()
    _step(accelerator, model, 64 * cp)  # warm-up: one-time allocations happen here, not in the measured step
    saved = [0]
    peak, _ = peak_above_now(lambda: _step(accelerator, model, seq_len, saved))
    times = []
    for _ in range(timed):
        start = time.perf_counter()
        _step(accelerator, model, seq_len)
        times.append(time.perf_counter() - start)
    accelerator.end_training()
    return {"saved": saved[0], "peak": peak, "time": statistics.median(times) if times else None}


def measure(cp: int, strategy: str, seq_len: int, args: argparse.Namespace, timed: int = 0) -> dict:
    ranks = run_ranks(_measure, cp, cp, strategy, seq_len, args.hidden_size, args.layers, timed, timeout=1800)
    return {key: max(r[key] for r in ranks) if ranks[0][key] is not None else None for key in ranks[0]}


def longest_within(cap: int, cp: int, strategy: str, args: argparse.Namespace) -> int:
    """The longest sequence (a multiple of 512) whose peak activation memory per rank stays within `cap` bytes."""
    fits, length = 0, 1024
    while measure(cp, strategy, length, args)["peak"] <= cap:
        fits, length = length, 2 * length
    lo, hi = fits, length  # lo fits (or is 0), hi does not
    while hi - lo > 512:
        mid = (lo + hi) // 2 // 512 * 512
        if measure(cp, strategy, mid, args)["peak"] <= cap:
            lo = mid
        else:
            hi = mid
    return lo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--cap-mib", type=float, default=48.0)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    configs = [(1, "allgather")] + [(cp, s) for cp in (2, 4) for s in ("allgather", "ring")]
    print(f"{args.layers}-layer Llama, hidden {args.hidden_size}, 4 query / 2 KV heads, fp32, CPU + gloo, one sequence "
          f"of {args.seq_len} tokens, load-balanced layout; largest value over ranks\n")
    print(f"{'cp':>3} {'strategy':>10} {'saved activations':>18} {'peak activation memory':>23} {'step time':>10}")
    rows = {}
    for cp, strategy in configs:
        r = rows[cp, strategy] = measure(cp, strategy, args.seq_len, args, timed=3)
        print(f"{cp:>3} {strategy if cp > 1 else '-':>10} {r['saved'] / MiB:>14.1f} MiB {r['peak'] / MiB:>19.1f} MiB "
              f"{r['time']:>8.2f} s", flush=True)
    print("\nring / all-gather step time: " + ", ".join(
        f"cp {cp}: {rows[cp, 'ring']['time'] / rows[cp, 'allgather']['time']:.2f}" for cp in (2, 4)))
    cap = int(args.cap_mib * MiB)
    print(f"\nlongest sequence whose peak activation memory per rank fits {args.cap_mib:g} MiB (multiples of 512)")
    print(f"{'cp':>3} {'strategy':>10} {'tokens':>8}")
    for cp, strategy in configs:
        print(f"{cp:>3} {strategy if cp > 1 else '-':>10} {longest_within(cap, cp, strategy, args):>8}", flush=True)


if __name__ == "__main__":
    main()
