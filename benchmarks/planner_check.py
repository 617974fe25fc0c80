"""The planner's memory and bytes next to what the library measures, layout by layout (docs/planner.md).

    python benchmarks/planner_check.py [--hidden 64 --layers 2 --vocab 258 --seq 32 --batch 2]

Each case of `CASES` (every layout of benchmarks/run.py in fp32, three in bf16 with two accumulation micro-steps, two
with activation checkpointing) runs on forked gloo ranks (`run_ranks`): the library with an FSDP2 plugin, one
warm-up optimizer step, then one counted step -- the bytes and calls of every collective (common.py's
CollectiveCounter), the model states per rank just before zero_grad, and the bytes saved for backward in the first
micro-step. The planner predicts the same from the model's config (`ndparallel.planner.footprint.estimate`,
`ndparallel.planner.comm.transfers`); the table shows both and their ratio. tests/planner/test_planner.py asserts them.
`RING_CASES` (context parallelism's ring) and `PP_CASES` (pipeline stages) follow, asserted by
tests/planner/test_planner_ring.py and test_planner_pipeline_traffic.py. Point-to-point bytes (``send_recv``) are the
busiest rank's, as the planner predicts them (pp 3's middle stage sends twice what an end stage does).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.distributed.fsdp  # noqa: E402, F401  (imported before forking: the ranks need not import it each)
import torch.distributed.tensor  # noqa: E402, F401
from transformers.models.llama import modeling_llama  # noqa: E402, F401

import ndparallel  # noqa: E402, F401
import workloads  # noqa: E402
from common import (LAYOUTS, SavedActivations, model_state_bytes, peak_above_now, serve_large_blocks_from_mmap,  # noqa: E402
                    shift_labels, workload_config, workload_model)
from ndparallel.configuration.parallelism import ParallelismConfig  # noqa: E402
from ndparallel.planner import Layout, Recipe, spec_from_config  # noqa: E402
from ndparallel.planner.comm import by_kind, transfers  # noqa: E402
from ndparallel.planner.footprint import estimate  # noqa: E402
from ndparallel.test_utils import run_ranks  # noqa: E402
from ndparallel.test_utils.collectives import CollectiveCounter  # noqa: E402


def measure(layout: Layout, args: SimpleNamespace, precision: str, accumulation: int,
             checkpointing: bool, features: tuple[bool, bool, bool] = (True, False, False), ep: int = 1,
             build=workload_model, cp_strategy: str = "allgather") -> dict:
    """On every rank: the library with an FSDP2 plugin (as a planned script runs it), one warm-up optimizer step of
    `accumulation` micro-steps, then one step counted: collectives (CollectiveCounter), model states just before
    zero_grad, and the first micro-step's saved activations. `build(args)` makes the model (a Llama by default;
    benchmarks/planner_check_moe.py passes a mixture of experts and its `ep`); `cp_strategy` is
    ``TorchContextParallelConfig``'s ``cp_comm_strategy``."""
    from torch.utils.data import DataLoader

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, MemoryKwargs, TorchContextParallelConfig

    serve_large_blocks_from_mmap()
    chunked, tiled, offload = features

    pc = ParallelismConfig(dp_replicate_size=layout.dp_replicate, dp_shard_size=layout.dp_shard, cp_size=layout.cp,
                           sp_size=layout.sp, tp_size=layout.tp, ep_size=ep, pp_size=layout.pp,
                           cp_handler=TorchContextParallelConfig(cp_comm_strategy=cp_strategy))
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing={"every": 1, "offload": True}
                                            if offload else checkpointing)
    # Under pipeline stages only the last holds the head: "auto" puts the chunked loss there (True refuses the others).
    chunked = "auto" if chunked and layout.pp > 1 else chunked
    accelerator = Accelerator(parallelism_config=pc, fsdp_plugin=plugin, mixed_precision=precision,
                              gradient_accumulation_steps=accumulation, cpu=True,
                              kwargs_handlers=[MemoryKwargs(chunked_loss=chunked, tiled_mlp=tiled,
                                                            mlp_tile_size=getattr(args, "tile", None))])
    model = build(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = workloads.dataset(args, layout)
    rows = torch.cat([rows, rows])  # batches for the warm-up step, the counted step and the one whose peak is read
    samples = [{"input_ids": r, "labels": r, "shift_labels": shift_labels(r),
                "position_ids": torch.arange(len(r))} for r in rows]
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(samples, batch_size=args.batch))
    batches = iter(loader)
    states: dict[str, int] = {}
    saved = SavedActivations(model)  # activations only: not the weights

    def micro_step(count_saved: bool = False) -> None:
        batch = next(batches)
        buffers = list(batch.values())
        with accelerator.accumulate(model), accelerator.maybe_context_parallel(
                buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)):
            if count_saved:
                with saved.context():
                    loss = model(**batch).loss
            else:
                loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            if accelerator.sync_gradients:
                states.update(model_state_bytes(model, optimizer))
            optimizer.zero_grad()

    for _ in range(accumulation):
        micro_step()
    with CollectiveCounter() as counter:
        for i in range(accumulation):
            micro_step(count_saved=i == 0)
    # The peak of one more step, above the resident set before it (which holds the parameters and the optimizer's
    # state; the gradients were freed by zero_grad): peak resident memory, Linux's VmHWM reset through clear_refs.

    def step() -> None:
        for _ in range(accumulation):
            micro_step()

    step_peak, _ = peak_above_now(step)
    return {"bytes": dict(counter.bytes), "calls": dict(counter.calls), "states": states,
            "saved": saved.bytes, "step_peak": step_peak}


# (layout of benchmarks/run.py, mixed precision, accumulation steps, activation checkpointing): every layout as the
# benchmark runs it (fp32, no accumulation); three again in bf16 with two micro-steps per step (gathers in bf16,
# reductions in fp32, parameters gathered every micro-step, gradients reduced once); two with every layer checkpointed
# (the rerun forward repeats TP, CP and SP collectives).
CASES = ([(name, "no", 1, False) for name in LAYOUTS]
         + [(name, "bf16", 2, False) for name in ("hsdp", "fsdp2_tp", "cp_sp")]
         + [("fsdp2_tp", "no", 1, True), ("cp_sp", "bf16", 2, True)])

# The same with context parallelism's ring strategy (``cp_comm_strategy="ring"``: K/V blocks and their gradients sent
# point to point): cp 2 in fp32, cp 4 in bf16 with two micro-steps and every layer checkpointed (the rerun forward
# passes the blocks again), cp 2 x sp 2 in bf16 with two micro-steps (the ring inside Ulysses). Layouts by name:
# benchmarks/run.py's and `cp4`.
CASE_LAYOUTS = {**LAYOUTS, "cp4": Layout(cp=4), "pp": Layout(pp=2), "pp3": Layout(pp=3),
                "pp_fsdp2": Layout(pp=2, dp_shard=2), "pp_ddp": Layout(pp=2, dp_replicate=2)}
RING_CASES = [("cp", "no", 1, False), ("cp4", "bf16", 2, True), ("cp_sp", "bf16", 2, False)]

# Pipeline stages (the library's default schedule, 1F1B with pp micro-batches per micro-step): pp 2 in fp32, pp 2 in
# bf16 with two accumulation micro-steps, pp 3 in bf16 with two micro-steps and every layer checkpointed -- its middle
# stage sends both ways --, and FSDP2 inside the stages: pp 2 x dp_shard 2 in bf16 with two micro-steps and in fp32
# checkpointed, pp 2 x dp_replicate 2 in bf16 with two micro-steps. Each case with the sizes it changes: a stage needs
# a decoder layer, and a rank's samples split into pp micro-batches (3 layers and 3 samples for pp 3).
PP_CASES = [(("pp", "no", 1, False), {}), (("pp", "bf16", 2, False), {}),
            (("pp3", "bf16", 2, True), {"layers": 3, "batch": 3}), (("pp_fsdp2", "bf16", 2, False), {}),
            (("pp_fsdp2", "no", 1, True), {}), (("pp_ddp", "bf16", 2, False), {})]


def predict(args: SimpleNamespace, name: str, precision: str, accumulation: int, checkpointing: bool,
            features: tuple[bool, bool, bool] = (True, False, False), cp_strategy: str = "allgather"):
    """(memory terms, transfers) the planner predicts for one case on one rank (no allocator fragmentation: the
    CPU has no caching allocator)."""
    spec = spec_from_config(workload_config(args).to_dict(), "tiny")
    layout = CASE_LAYOUTS[name]
    recipe = Recipe(args.seq, args.batch, accumulation, "bf16" if precision == "bf16" else "fp32", checkpointing,
                    chunked_loss=features[0], tiled_mlp=features[1], offload=features[2],
                    mlp_tile=getattr(args, "tile", None), cp_strategy=cp_strategy)
    return estimate(spec, layout, recipe), transfers(spec, layout, recipe, gpus_per_node=8)


def predicted_step_peak(memory) -> float:
    """What one step adds above the parameters and optimizer state that exist before it."""
    return memory["allocated"] - memory["params"] - memory["optimizer"]


def measure_peak(case: tuple) -> tuple[int, float]:
    """(measured, predicted) peak of one step above the state before it, the largest over ranks. On the CPU,
    offloading moves nothing, so its prediction is the one without it."""
    layout = LAYOUTS[case[0]]
    ranks = run_ranks(measure, layout.world, layout, PEAK, *case[1:])
    chunked, tiled, _ = case[4]
    memory, _ = predict(PEAK, *case[:4], (chunked, tiled, False))
    return max(r["step_peak"] for r in ranks), predicted_step_peak(memory)


# Peak memory of a step (on larger sizes, where the step's tensors dwarf the resident set's noise): every layout of
# benchmarks/run.py with the library's defaults (the chunked loss), and FSDP2 with each memory setting:
# (layout, mixed precision, accumulation, checkpointing, (chunked loss, tiled MLP, offload)).
PEAK = SimpleNamespace(hidden=256, layers=2, vocab=8192, seq=1024, batch=2, warmup=1, steps=1, repeats=1, cpu=True,
                       tile=256)
PEAK_CASES = ([(name, "no", 1, False, (True, False, False)) for name in LAYOUTS]
              + [("fsdp2", "no", 1, False, (False, False, False)), ("fsdp2", "no", 1, True, (False, False, False)),
                 ("fsdp2", "no", 1, True, (True, False, False)), ("fsdp2", "no", 1, False, (True, True, False)),
                 ("fsdp2", "no", 1, True, (True, True, True)), ("fsdp2", "bf16", 2, True, (True, True, False)),
                 ("fsdp2", "bf16", 1, False, (False, False, False))])


def peak_case_name(case: tuple) -> str:
    name, precision, accumulation, checkpointing, (chunked, tiled, offload) = case
    features = "".join(k for k, on in (("C", chunked), ("T", tiled), ("O", offload)) if on) or "-"
    return f"{name} {'bf16' if precision == 'bf16' else 'fp32'} x{accumulation}{' AC' if checkpointing else ''} {features}"


def run_case(args: SimpleNamespace, case: tuple, cp_strategy: str = "allgather") -> list[dict]:
    layout = CASE_LAYOUTS[case[0]]
    return run_ranks(functools.partial(measure, cp_strategy=cp_strategy), layout.world, layout, args, *case[1:])


TABLE_HEADER = ("| case | states B, measured / predicted | bytes per collective, measured (mean over the ranks; "
                "point to point the busiest rank's) / "
                "predicted (calls) | saved for backward B, measured / predicted (mean / predicted) |\n"
                "|---|---|---|---|")


def table_row(name: str, ranks: list[dict], memory, items, checkpointed: bool) -> str:
    """One case of the table: model states (the largest rank's), bytes of each collective (the mean over the ranks:
    a mixture of experts' all-to-alls depend on its routing; point to point the busiest rank's) and calls, bytes
    saved for backward (the ranks' range, and their mean over the prediction), each measured / predicted."""
    states = max(sum(r["states"].values()) for r in ranks)
    # point to point: the busiest rank's, as the planner predicts it (a pipeline's middle stage sends both ways)
    busiest = max(ranks, key=lambda r: r["bytes"].get("send_recv", 0))

    def sent(k: str) -> tuple[float, int]:
        if k == "send_recv":
            return busiest["bytes"].get(k, 0), busiest["calls"].get(k, 0)
        return sum(r["bytes"].get(k, 0) for r in ranks) / len(ranks), ranks[0]["calls"].get(k, 0)

    comm = ", ".join(f"{k} {sent(k)[0]:,.0f} / {v:,.0f} ({sent(k)[1]} / {sum(i.calls for i in items if i.kind == k)})"
                     for k, v in by_kind(items).items())
    saved = [r["saved"] for r in ranks]
    act = "n/a (checkpointed)" if checkpointed else (f"{min(saved):,}..{max(saved):,} / {memory['activations']:,.0f} "
                                                     f"({sum(saved) / len(saved) / memory['activations']:.4f})")
    return f"| {name} | {states:,} / {memory.states:,.0f} ({states / memory.states:.4f}) | {comm} | {act} |"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 64), ("layers", 2), ("vocab", 258), ("seq", 32), ("batch", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--peak", action="store_true", help="only the peak of a step, on PEAK's sizes")
    parsed = p.parse_args(argv)
    if parsed.peak:
        print(f"| case (hidden {PEAK.hidden}, {PEAK.layers} layers, vocabulary {PEAK.vocab}, {PEAK.batch} x {PEAK.seq} "
              "tokens per data-parallel rank) | step peak per rank, measured / predicted | ratio |\n|---|---|---|")
        for case in PEAK_CASES:
            measured, predicted = measure_peak(case)
            print(f"| {peak_case_name(case)} | {measured / 2**20:.1f} / {predicted / 2**20:.1f} MiB | "
                  f"{measured / predicted:.3f} |", flush=True)
        return
    args = SimpleNamespace(**{k: v for k, v in vars(parsed).items() if k != "peak"}, warmup=1, steps=1, repeats=1,
                           cpu=True, tile=None)  # workloads' fields
    print(TABLE_HEADER)
    cases = ([(case, "allgather", args) for case in CASES] + [(case, "ring", args) for case in RING_CASES]
             + [(case, "allgather", SimpleNamespace(**{**vars(args), **sizes})) for case, sizes in PP_CASES])
    for case, strategy, sized in cases:
        name = (f"{case[0]}{' ring' if strategy == 'ring' else ''} {'bf16' if case[1] == 'bf16' else 'fp32'} "
                f"x{case[2]}{' AC' if case[3] else ''}")
        print(table_row(name, run_case(sized, case, strategy), *predict(sized, *case, cp_strategy=strategy),
                        checkpointed=case[3]), flush=True)


if __name__ == "__main__":
    main()
