"""Fault-tolerant training: checkpoint every few steps, and on (re)start resume from the newest checkpoint.

The model and data are those of nd_parallel.py. Started by `ndparallel launch --max-restarts N`, a run whose rank
dies (out of memory, a lost node, ``kill -9``) is restarted by torchrun, and the new processes continue from the
newest complete checkpoint -- same model, optimizer, LR schedule, data position and random states -- on the same
or another layout (sizes from the launcher):

    ndparallel launch --nproc-per-node 2 --dp-shard-size 2 --max-restarts 2 examples/resume.py \\
        --project-dir runs/demo --steps 40 --checkpoint-every 10
    # to see a restart: add --crash-at-step 15 (rank 1 kills itself once, in the first attempt only)

A checkpoint only becomes visible when complete, so a crash during a save leaves the previous one to resume from.
`--async-save` writes checkpoints in the background (``save_state(async_save=True)``); `--eval-every N` evaluates on
a fixed batch every N steps and before every save (``model.eval()``, ``torch.no_grad()``), as training loops do;
`--workers N` loads the data in N worker processes; `--event-log FILE` appends one JSON line per event of the main
process (start, prepared, resumed, every step's exact loss and evaluation loss, each save's begin and end), flushed
at once so that it survives a ``kill -9``: `benchmarks/soak.py` reads it while it kills ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nd_parallel import build_dataset, build_model  # noqa: E402

from ndparallel import (  # noqa: E402
    Accelerator,
    FullyShardedDataParallelPlugin,
    ParallelismConfig,
    ProjectConfiguration,
    set_seed,
)
from ndparallel.checkpoint import latest_checkpoint  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--project-dir", type=Path, required=True, help="checkpoints go to <project-dir>/checkpoints")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps in all")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--keep", type=int, default=2, help="checkpoints to keep (total_limit)")
    p.add_argument("--batch-size", type=int, default=4, help="samples per data-parallel rank and micro-step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--crash-at-step", type=int, default=None,
                   help="rank 1 (else 0) kills itself with SIGKILL after this step, in the first attempt only")
    p.add_argument("--json-out", type=Path, default=None, help="write this attempt's losses here (main process)")
    p.add_argument("--async-save", action="store_true", help="save_state(async_save=True): write in the background")
    p.add_argument("--eval-every", type=int, default=0,
                   help="evaluate on a fixed batch every this many steps and before every save (0: never)")
    p.add_argument("--workers", type=int, default=0, help="data-loader worker processes (DataLoader num_workers)")
    p.add_argument("--event-log", type=Path, default=None,
                   help="append one JSON line per event here (main process), flushed at once")
    return p.parse_args(argv)


class EventLog:
    """JSON lines appended by the main process and flushed at once (each line is one write: a ``kill -9`` loses at
    most the line being written). Losses are written as Python floats, which JSON round-trips exactly."""

    def __init__(self, path: Path | None, attempt: int, enabled: bool) -> None:
        self.file = open(path, "a", encoding="utf-8") if path is not None and enabled else None  # noqa: SIM115
        self.attempt = attempt

    def __call__(self, event: str, **fields) -> None:
        if self.file is not None:
            line = {"event": event, "attempt": self.attempt, "time": time.time(), "pid": os.getpid(), **fields}
            self.file.write(json.dumps(line) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    accelerator = Accelerator(
        parallelism_config=ParallelismConfig(),  # sizes from `ndparallel launch`
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
        project_config=ProjectConfiguration(project_dir=args.project_dir, automatic_checkpoint_naming=True,
                                            total_limit=args.keep),
        step_scheduler_with_optimizer=False,  # the schedule counts optimizer steps, stepped by hand below
    )
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = EventLog(args.event_log, attempt, accelerator.is_main_process)
    log("start")
    set_seed(0)
    model = build_model({"seq_len": args.seq_len})
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.1, 1.0 - step / args.steps))
    dataset = build_dataset(args.seq_len)
    dataloader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
                            num_workers=args.workers)
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    # A fixed batch for the evaluations (the dataset's last samples, whole on every rank).
    held_out = torch.utils.data.default_collate([dataset[i] for i in range(len(dataset) - args.batch_size,
                                                                           len(dataset))])

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            loss = model(**{k: v.to(accelerator.device) for k, v in held_out.items()}).loss
        model.train()
        return accelerator.reduce(loss, "mean").item()
    log("prepared")

    # Resume: everything prepared above (and the data position, random states, step counter) comes back.
    resumed_from = None
    if latest_checkpoint(args.project_dir) is not None:
        resumed_from = accelerator.load_state()  # the newest complete checkpoint of the project
        accelerator.print(f"resumed from {resumed_from} at step {accelerator.gradient_state.optimizer_steps}")
    step = accelerator.gradient_state.optimizer_steps
    log("resumed", step=step, checkpoint=None if resumed_from is None else str(resumed_from))

    losses: dict[int, float] = {}
    model.train()
    while step < args.steps:
        for batch in dataloader:  # continues mid-epoch after a resume
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()  # once per optimizer step
                optimizer.zero_grad()
            step_loss = accelerator.reduce_loss(loss)  # global token mean of the step so far (collective)
            if not accelerator.sync_gradients:
                continue
            step += 1
            losses[step] = step_loss.item()
            accelerator.print(f"step {step}: loss {losses[step]:.4f}")
            log("step", step=step, loss=losses[step])
            saving = step % args.checkpoint_every == 0 or step == args.steps
            if args.eval_every and (step % args.eval_every == 0 or saving):
                log("eval", step=step, loss=evaluate())
            if saving:
                log("save-begin", step=step)
                saved = accelerator.save_state(async_save=args.async_save)
                log("save-end", step=step, checkpoint=str(saved))
                accelerator.print(f"saved {saved}" + (" (writing in the background)" if args.async_save else ""))
            if step == args.crash_at_step and attempt == 0 and \
                    accelerator.process_index == min(1, accelerator.num_processes - 1):
                os.kill(os.getpid(), signal.SIGKILL)  # a hard failure: no cleanup, no exception
            if step >= args.steps:
                break

    summary = {"losses": losses, "resumed_from": resumed_from, "attempt": attempt,
               "world_size": accelerator.num_processes}
    if args.json_out is not None and accelerator.is_main_process:
        args.json_out.write_text(json.dumps(summary))
    accelerator.end_training()  # waits for a background save still being written
    log("end", step=step)
    log.close()
    return summary


if __name__ == "__main__":
    main()
