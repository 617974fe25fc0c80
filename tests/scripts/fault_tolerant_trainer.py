"""A Hugging Face Trainer run as a user writes it, launched by tests/fault_tolerance/test_trainer_groups.py with ``ndparallel
launch [--fault-tolerant] --dp-replicate-size 2``. Nothing in it is about faults except the kill it is told to do.

    python fault_tolerant_trainer.py OUT --steps N [--kill-at STEP] [--step-seconds S] [--save-steps K]

--kill-at: replica group 1 (without --fault-tolerant: the last rank) SIGKILLs itself in the forward of the step that
starts at that global step, on its first attempt only. Each process writes OUT/result_replica{R}_rank{r}_attempt{A}.json
-- each step it ended (global step, learning rate, epoch) -- and, at the end, its parameters in full to
OUT/params_replica{R}_rank{r}.pt.
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
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import TokenDataset, build_model  # noqa: E402


class Record(TrainerCallback):
    """What each step ended with, written as it goes (a killed attempt keeps what it did); and the kill."""

    def __init__(self, path: Path, kill_at: int | None, step_seconds: float) -> None:
        self.path, self.kill_at, self.step_seconds = path, kill_at, step_seconds
        self.steps: list[dict] = []
        self.trainer: Trainer | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.kill_at is not None:
            def die(module, inputs):
                if module.training and self.trainer.state.global_step >= self.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)  # dies holding this step: its peers' all-reduce fails
            model.register_forward_pre_hook(die)

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        self.steps.append({"step": state.global_step, "lr": lr_scheduler.get_last_lr()[0], "epoch": state.epoch})
        self.path.write_text(json.dumps(self.steps))
        time.sleep(self.step_seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--save-steps", type=int, default=0)
    options = parser.parse_args()
    out = Path(options.out)
    fault_tolerant = "NDPARALLEL_FT_REPLICAS" in os.environ
    replica = int(os.environ.get("NDPARALLEL_FT_REPLICA_ID", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    killer = replica == 1 if fault_tolerant else rank == world - 1
    args = TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=options.steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=0.05, warmup_steps=2, lr_scheduler_type="linear", optim="sgd",
        logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_drop_last=True,
        save_strategy="steps" if options.save_steps else "no", save_steps=options.save_steps or 500,
        save_total_limit=2)
    torch.manual_seed(0)
    record = Record(out / f"result_replica{replica}_rank{rank}_attempt{attempt}.json",
                    options.kill_at if killer and attempt == 0 else None, options.step_seconds)
    # 24 rows of 16 tokens (every label counts, so every replica group's loss weighs alike); 2 x 2 per update and
    # rank: 3 updates per epoch at 2 processes, so the run crosses epochs.
    trainer = Trainer(model=build_model("llama"), args=args, train_dataset=TokenDataset(24, 16), callbacks=[record])
    record.trainer = trainer
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    full = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}
    torch.save({"params": full, "global_step": trainer.state.global_step},
               out / f"params_replica{replica}_rank{rank}.pt")


if __name__ == "__main__":
    main()
