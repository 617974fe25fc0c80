"""Pipeline stages: ndparallel against the same schedule written in plain `torch.distributed.pipelining`.

    python benchmarks/pipeline.py [--pp 2] [--schedules gpipe 1f1b] [--microbatches 2 4 8] [--hidden 256 ...]

For each schedule and micro-batch count, on forked ranks (one OpenMP thread each; gloo on CPU in fp32, NCCL in bf16
on GPUs), it builds the same Llama twice from the same seed: once prepared by ndparallel with
``ParallelismConfig(pp_size=P, pp_handler=PipelineParallelConfig(schedule, microbatches))`` and trained with the
Accelerate-style loop (``model(**batch).loss``, ``accelerator.backward``), once split by hand -- a stage module that
runs the embedding, its decoder layers and the head, wrapped in torch's `PipelineStage` and schedule, with a mean
cross-entropy per micro-batch -- and alternates blocks of timed steps between the two. It prints, side by side:

- step time: the schedule's step (the model call for ndparallel, ``schedule.step`` for plain), median over blocks
  of the slowest rank, and the ratio ndparallel / plain;
- the bubble: 1 - m * t_mb / t_step per rank, t_mb being the rank's own forward + backward of one micro-batch
  measured alone, next to the schedule's formula (p - 1) / (m + p - 1) for GPipe and 1F1B;
- bytes each rank sends to the next / previous stage in one step (counted from the stage's send operations)
  against the activation size B x S x H x element size, once per direction;
- per stage: parameter bytes and peak resident memory;
- the gap between the two runs' losses after the same steps (they must agree to rounding).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from common import device_and_dtype, peak_rss_bytes, reset_peak_rss, shift_labels, workload_model  # noqa: E402

from ndparallel.test_utils import run_ranks  # noqa: E402


class PlainStage(nn.Module):
    """One stage written out: the embedding (first stage), decoder layers, final norm and head (last stage)."""

    def __init__(self, model: nn.Module, layers: list[int], first: bool, last: bool) -> None:
        super().__init__()
        inner = model.model
        self.embed = inner.embed_tokens if first else None
        self.layers = nn.ModuleList([inner.layers[i] for i in layers])
        self.rotary = inner.rotary_emb
        self.norm = inner.norm if last else None
        self.head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rotary = self.rotary(h, positions)
        for layer in self.layers:  # no mask: SDPA runs causal
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        return self.head(self.norm(h)) if self.head is not None else h


def _plain_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


class SendCounter:
    """Bytes this rank sends to other stages, counted from the stages' send operations."""

    def __init__(self) -> None:
        from torch.distributed.pipelining.stage import _PipelineStageBase

        self.cls, self.bytes = _PipelineStageBase, {"forward": 0, "backward": 0}
        self.saved = (self.cls.get_fwd_send_ops, self.cls.get_bwd_send_ops)

    def __enter__(self) -> SendCounter:
        def counted(original, kind):
            def wrapper(stage, *args, **kwargs):
                ops = original(stage, *args, **kwargs)
                self.bytes[kind] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
                return ops
            return wrapper
        self.cls.get_fwd_send_ops = counted(self.saved[0], "forward")
        self.cls.get_bwd_send_ops = counted(self.saved[1], "backward")
        return self

    def __exit__(self, *exc) -> None:
        self.cls.get_fwd_send_ops, self.cls.get_bwd_send_ops = self.saved


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(pp: int, schedule: str, microbatches: int, args: argparse.Namespace) -> dict:
    """Runs on every rank: interleaved timing of ndparallel and plain pipelining, then counted steps."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    from ndparallel import Accelerator, ParallelismConfig, PipelineParallelConfig

    device, precision = device_and_dtype(args)
    accelerator = Accelerator(cpu=device.type == "cpu", mixed_precision=precision,
                              parallelism_config=ParallelismConfig(pp_size=pp, pp_handler=PipelineParallelConfig(
                                  schedule=schedule, microbatches=microbatches)))
    rank = dist.get_rank()
    lib_model = workload_model(args)
    optimizer = torch.optim.AdamW(lib_model.parameters(), lr=1e-4)
    lib_model, optimizer = accelerator.prepare(lib_model, optimizer)
    lib_model.train()
    plan = lib_model.plan
    stage_index = plan.stages_of(rank)[0]
    layers = [int(u) for u in plan.stage_units(stage_index)]

    full = workload_model(args).to(device)  # same seed: the same weights as the library's
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    plain_module = PlainStage(full, layers, stage_index == 0, stage_index == plan.num_stages - 1).to(dtype)
    plain_opt = torch.optim.AdamW(plain_module.parameters(), lr=1e-4)
    stage = pipelining.PipelineStage(plain_module, stage_index, plan.num_stages, device)
    cls = pipelining.ScheduleGPipe if schedule == "gpipe" else pipelining.Schedule1F1B
    plain_schedule = cls(stage, microbatches, loss_fn=_plain_loss)  # mean per micro-batch; grads divided by m

    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
               for _ in range(args.warmup + args.steps * args.repeats + 1)]
    data = iter(batches)

    def library_step() -> float:
        ids = next(data)
        _sync(device)
        start = time.perf_counter()
        loss = lib_model(input_ids=ids, labels=ids).loss
        _sync(device)
        elapsed = time.perf_counter() - start
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        library_step.loss = float(loss)
        return elapsed

    def plain_step() -> float:
        ids = next(data)
        losses: list[torch.Tensor] = []
        _sync(device)
        start = time.perf_counter()
        if stage_index == 0:
            plain_schedule.step(ids, target=shift_labels(ids), losses=losses)
        else:
            plain_schedule.step(target=shift_labels(ids), losses=losses)
        _sync(device)
        elapsed = time.perf_counter() - start
        plain_opt.step()
        plain_opt.zero_grad()
        plain_step.loss = float(torch.stack(losses).detach().mean()) if losses else float("nan")
        return elapsed

    for step in (library_step, plain_step):  # warm-up (shapes learnt, allocator warm); same batches for both
        data = iter(batches)
        for _ in range(args.warmup):
            step()
    times: dict[str, list[float]] = {"library": [], "plain": []}
    positions = {"library": args.warmup, "plain": args.warmup}
    for repeat in range(args.repeats):
        order = ("library", "plain") if repeat % 2 == 0 else ("plain", "library")
        for name in order:
            data = iter(batches[positions[name]:])
            dist.barrier()
            block = [(library_step if name == "library" else plain_step)() for _ in range(args.steps)]
            positions[name] += args.steps
            times[name].append(statistics.median(block))
    # One counted step each (the same batch), then one micro-batch's forward + backward of this stage alone.
    counted = {}
    for name, step in (("library", library_step), ("plain", plain_step)):
        data = iter(batches[-1:])
        reset_peak_rss()
        dist.barrier()
        with SendCounter() as sends:
            step()
        counted[name] = {"sent": dict(sends.bytes), "peak_rss": peak_rss_bytes(), "loss": step.loss}
    mb = args.batch // microbatches
    x = (torch.randint(0, args.vocab, (mb, args.seq), device=device) if stage_index == 0 else
         torch.randn(mb, args.seq, args.hidden, device=device, dtype=dtype, requires_grad=True))
    alone = []
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        out = plain_module(x)
        out.float().square().mean().backward()
        _sync(device)
        alone.append(time.perf_counter() - start)
    plain_opt.zero_grad()
    params = sum(p.numel() * p.element_size() for p in accelerator.unwrap_model(lib_model).parameters())
    accelerator.end_training()
    return {"rank": rank, "stage": stage_index, "layers": layers, "times": times, "counted": counted,
            "t_mb": statistics.median(alone[1:]), "param_bytes": params, "elem": torch.finfo(dtype).bits // 8}


def summarise(pp: int, schedule: str, m: int, ranks: list[dict], args: argparse.Namespace) -> dict:
    step = {name: statistics.median(max(r["times"][name][i] for r in ranks) for i in range(args.repeats))
            for name in ("library", "plain")}
    bubbles = [1 - m * r["t_mb"] / step["plain"] for r in ranks]
    elem = ranks[0]["elem"]
    activation = args.batch * args.seq * args.hidden * elem
    return {
        "pp": pp, "schedule": schedule, "m": m, "step": step, "ratio": step["library"] / step["plain"],
        "bubble": statistics.mean(bubbles), "bubble_formula": (pp - 1) / (m + pp - 1),
        "sent": [{k: r["counted"]["library"]["sent"][k] for k in ("forward", "backward")} for r in ranks],
        "sent_plain": [r["counted"]["plain"]["sent"] for r in ranks], "activation": activation,
        "param_bytes": [r["param_bytes"] for r in ranks], "peak_rss": [r["counted"]["library"]["peak_rss"]
                                                                        for r in ranks],
        "loss_gap": abs(ranks[0]["counted"]["library"]["loss"] - ranks[-1]["counted"]["plain"]["loss"]),
        "layers": [r["layers"] for r in ranks],
    }


def markdown(rows: list[dict], command: str) -> str:
    mib = 2 ** 20
    lines = [f"`{command}`", "",
             "| pp | schedule | m | step ndparallel (s) | step plain (s) | ratio | bubble measured | bubble "
             "(p-1)/(m+p-1) | sent fwd / bwd per rank (MiB) | activation B.S.H (MiB) | params per stage (MiB) | "
             "peak RSS per rank (MiB) | loss gap |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sent = "; ".join(f"{s['forward'] / mib:.2f} / {s['backward'] / mib:.2f}" for s in r["sent"])
        lines.append(
            f"| {r['pp']} | {r['schedule']} | {r['m']} | {r['step']['library']:.4f} | {r['step']['plain']:.4f} | "
            f"{r['ratio']:.3f} | {r['bubble']:.3f} | {r['bubble_formula']:.3f} | {sent} | "
            f"{r['activation'] / mib:.2f} | {', '.join(f'{b / mib:.1f}' for b in r['param_bytes'])} | "
            f"{', '.join(f'{b / mib:.0f}' for b in r['peak_rss'])} | {r['loss_gap']:.1e} |")
    return "\n".join(lines) + "\n"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=["gpipe", "1f1b"])
    p.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="rows per step (every micro-batch count must divide it)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="timed steps per block")
    p.add_argument("--repeats", type=int, default=8, help="ndparallel/plain blocks, alternating")
    p.add_argument("--cpu", action="store_true", help="CPU and gloo even where CUDA is available")
    p.add_argument("--timeout", type=float, default=1200)
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse(argv)
    command = "python benchmarks/pipeline.py " + " ".join(sys.argv[1:] if argv is None else argv)
    bad = [m for m in args.microbatches if args.batch % m]
    if bad:
        raise SystemExit(f"--batch {args.batch} does not split into {bad} micro-batches")
    rows = []
    for schedule in args.schedules:
        for m in args.microbatches:
            print(f"pp {args.pp} {schedule} m={m} ...", flush=True)
            ranks = run_ranks(measure, args.pp, args.pp, schedule, m, args, timeout=args.timeout)
            rows.append(summarise(args.pp, schedule, m, ranks, args))
            r = rows[-1]
            print(f"  ratio {r['ratio']:.3f}  bubble {r['bubble']:.3f} (formula {r['bubble_formula']:.3f})",
                  flush=True)
    text = markdown(rows, command)
    print(text)
    return rows


if __name__ == "__main__":
    main()
