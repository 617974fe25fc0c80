"""Expert parallelism against experts sharded by FSDP2 alone, in one run: what each rank holds, what the all-to-alls
carry, step time and peak memory -- measured, and predicted by the planner (`ndparallel.planner.experts`).

    python benchmarks/experts.py [--world 4] [--ep 4] [--experts 32] [--top-k 2] [--hidden 256]
                                 [--intermediate 512] [--layers 2] [--seq 128] [--batch 2] [--steps 5] [--repeats 2]

On forked ranks (`run_ranks`; gloo on CPU in fp32, NCCL on CUDA in bf16, one GPU per rank), a Qwen3-MoE built
from a config trains with AdamW under ``dp_shard_size=world, ep_size=ep`` and under ``dp_shard_size=world`` alone,
alternating blocks of --steps timed steps --repeats times (after one warm-up step each) so machine noise hits both
alike. Per layout it prints:

- the all-to-all bytes of one step, counted from the collectives (`alltoall_base_` as the dispatcher sees it): the
  tokens' payload per rank and its mean over the ranks, next to the analytic tokens x top-k x hidden x dtype bytes
  x 2 directions x (forward + backward) x sparse layers. A rank sends its own tokens' pairs out (and their
  gradients back) -- exactly the analytic half -- and returns the results of the pairs it received, which depends on
  the routing: the mean over the ranks is the analytic figure exactly. Also how much left the rank (the rest a rank
  sends to itself) and the routing counts' bytes;
- the expert parameters each rank holds and their optimizer state (AdamW's moments), next to the planner's
  prediction (all experts / ep, then / the remaining shard expert_shard = world / ep);
- the median step time and the peak memory (CUDA: max allocated; CPU: the growth of the process's peak resident
  set over the step, a coarse figure that includes the allocator's slack).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # forked ranks: the parent must not initialise CUDA
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from common import peak_rss_bytes, qwen3_moe_config, reset_peak_rss  # noqa: E402
from ndparallel.test_utils import run_ranks  # noqa: E402

VOCAB = 1024


class AllToAllCounter(TorchDispatchMode):
    """Bytes of every all-to-all this rank runs: the input of ``alltoall_base_`` (floating point: tokens; integers:
    routing counts), and of the tokens the part that goes to other ranks (all but this rank's own block)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and func._schema.name.split("::")[-1] == "alltoall_base_":
            import torch.distributed as dist

            source, group = args[1], dist.ProcessGroup.unbox(args[2])
            total = source.numel() * source.element_size()
            kind = "tokens" if source.is_floating_point() else "counts"
            self.bytes[kind] += total
            if kind == "tokens":
                splits = list(args[4]) or [source.shape[0] // group.size()] * group.size()
                row = total // max(1, source.shape[0])
                self.bytes["tokens_left_rank"] += total - splits[group.rank()] * row
        return func(*args, **kwargs)


def config(options: dict):
    return qwen3_moe_config(vocab=VOCAB, hidden=options["hidden"], layers=options["layers"],
                            intermediate=options["intermediate"], moe_intermediate=options["intermediate"],
                            experts=options["experts"], top_k=options["top_k"], heads=8, kv_heads=4,
                            max_positions=options["seq"], output_router_logits=True, router_aux_loss_coef=0.01)


def _expert_params(model) -> list[torch.nn.Parameter]:
    return [p for name, p in model.named_parameters() if ".mlp.experts." in name]


def _local_bytes(tensors) -> tuple[int, int]:
    from torch.distributed.tensor import DTensor

    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() for t in local), sum(t.numel() * t.element_size() for t in local)


def train(options: dict, ep: int) -> dict:
    """One layout on this rank: warm-up, timed blocks, one counted step."""
    from transformers import Qwen3MoeForCausalLM

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

    world = int(os.environ["WORLD_SIZE"])
    accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=world, ep_size=ep),
                              fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
                              mixed_precision="bf16" if torch.cuda.is_available() else "no")
    cuda = accelerator.device.type == "cuda"
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config(options))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, VOCAB, (options["batch"], options["seq"]),
                        generator=torch.Generator().manual_seed(1 + accelerator.process_index)).to(accelerator.device)

    def step() -> None:
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()

    step()  # warm-up: creates the optimizer state
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    reset_peak_rss()
    before = peak_rss_bytes()
    times = []
    for _ in range(options["steps"]):
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes() - before
    with AllToAllCounter() as counter:
        step()
    experts = _expert_params(accelerator.unwrap_model(model))
    elements, _ = _local_bytes(experts)
    state = [v for p in experts for v in optimizer.state[p].values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    result = {"times": times, "peak": peak, "a2a": dict(counter.bytes), "expert_elements": elements,
              "expert_optimizer_bytes": _local_bytes(state)[1], "device": str(accelerator.device),
              "dtype_bytes": 2 if cuda else 4}
    accelerator.end_training()
    return result


def predicted(options: dict, world: int, ep: int, dtype_bytes: int):
    from ndparallel.planner.experts import expert_figures, expert_spec

    spec = expert_spec(config(options).to_dict())
    return expert_figures(spec, world, ep, options["batch"] * options["seq"], compute_bytes=dtype_bytes)


def run(options: dict) -> dict[str, dict]:
    """Both layouts, alternated; per layout the ranks' results (each rank's measurements)."""
    layouts = {f"ep {options['ep']} (expert_shard {options['world'] // options['ep']})": options["ep"],
               "FSDP2 alone": 1}
    results: dict[str, list] = {name: [] for name in layouts}
    for _ in range(options["repeats"]):
        for name, ep in layouts.items():
            results[name].append(run_ranks(train, options["world"], options, ep, timeout=900))
    out = {}
    for name, ep in layouts.items():
        last = results[name][-1]
        step_s = statistics.median(t for run in results[name] for rank in run for t in rank["times"])
        analytic = (2 * 2 * options["batch"] * options["seq"] * options["top_k"] * options["hidden"]
                    * last[0]["dtype_bytes"] * options["layers"]) if ep > 1 else 0
        out[name] = {"ep": ep, "step_s": step_s, "peak": max(r["peak"] for r in last),
                     "a2a": [r["a2a"] for r in last], "analytic_payload": analytic,
                     "expert_elements": [r["expert_elements"] for r in last],
                     "expert_optimizer_bytes": [r["expert_optimizer_bytes"] for r in last],
                     "predicted": predicted(options, options["world"], ep, last[0]["dtype_bytes"]),
                     "device": last[0]["device"]}
    return out


def report(options: dict, out: dict[str, dict]) -> str:
    mib = 2**20
    lines = [f"Qwen3-MoE: {options['experts']} experts, top-{options['top_k']}, hidden {options['hidden']}, expert "
             f"intermediate {options['intermediate']}, {options['layers']} layers; {options['world']} ranks x "
             f"{options['batch']} x {options['seq']} tokens; device {next(iter(out.values()))['device']}"]
    for name, r in out.items():
        p, a2a = r["predicted"], r["a2a"]
        tokens, left, counts = ([x.get(k, 0) for x in a2a] for k in ("tokens", "tokens_left_rank", "counts"))
        lines += [f"\n{name}:",
                  f"  all-to-all tokens per step: {', '.join(f'{t:,}' for t in tokens)} B counted by rank, mean "
                  f"{sum(tokens) / len(tokens):,.0f} B; analytic tokens x top-k x hidden x dtype x 2 directions x "
                  f"(forward + backward) x layers = {r['analytic_payload']:,} B; planner {p.payload_bytes:,} B",
                  f"  of which left the rank: {', '.join(f'{t:,}' for t in left)} B (uniform routing: "
                  f"{p.leaves_rank_uniform:.0%}); routing counts {', '.join(f'{c:,}' for c in counts)} B (planner "
                  f"{p.count_bytes:,})",
                  f"  expert parameters per rank: {', '.join(f'{e:,}' for e in r['expert_elements'])} (planner "
                  f"{p.elements:,}); their optimizer state: "
                  f"{', '.join(f'{b / mib:.2f}' for b in r['expert_optimizer_bytes'])} MiB (planner "
                  f"{p.optimizer_bytes / mib:.2f})",
                  f"  step {r['step_s'] * 1e3:.1f} ms (median), peak memory {r['peak'] / mib:.1f} MiB; one layer's "
                  f"experts gathered for compute (planner): {p.gathered_bytes / mib:.2f} MiB"]
    (a, b) = out.values()
    lines.append(f"\nep / FSDP2 alone: step time x{a['step_s'] / b['step_s']:.2f}, peak memory "
                 f"x{a['peak'] / max(1, b['peak']):.2f}")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("world", 4), ("ep", 4), ("experts", 32), ("top-k", 2), ("hidden", 256),
                          ("intermediate", 512), ("layers", 2), ("seq", 128), ("batch", 2), ("steps", 5),
                          ("repeats", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    return {k.replace("-", "_"): v for k, v in vars(p.parse_args(argv)).items()}


if __name__ == "__main__":
    options = parse()
    print(report(options, run(options)))
