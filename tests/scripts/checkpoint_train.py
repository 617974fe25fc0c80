"""An Accelerate-style training loop that saves and resumes checkpoints (the script of tests/checkpoint/test_checkpoint*.py).

`main(argv)` trains until optimizer step ``--steps`` -- starting from a checkpoint with ``--load`` -- saving a
checkpoint after each step listed in ``--save-at``, and returns {step: global token-mean loss} plus what the tests
compare. The data loader shuffles and runs several epochs (28 samples, global batch 8: epochs of 4 steps, the last
one short), so a resume lands mid-epoch and crosses an epoch boundary. ``--dropout`` makes the loss depend on the
random states, so resuming exactly needs them restored too; ``--workers N`` (``--persistent-workers``) loads the
data in worker processes. Every save follows an evaluation forward (``model.eval()``, ``torch.no_grad()``), as in
Accelerate's examples, which evaluate each epoch and save after; it must change nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig, ProjectConfiguration, set_seed
from tiny_models import VOCAB, TokenDataset, build_model, make_optimizer


class StepCounter:
    """A user object registered with register_for_checkpointing."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def pause_after_models(marker: str) -> None:
    """Test hook, in this process only: the next save stops once its models are written (when it asks for the
    first optimizer's state), writes `marker` and sleeps until killed. It replaces the function save_state calls
    there, so the library needs no switch of its own for this."""
    from ndparallel.checkpoint import training_state as state

    def paused(*args, **kwargs):
        Path(marker).write_text("models written")
        while True:
            time.sleep(60)

    state.get_optimizer_state_dict = paused


def pause_before_commit(marker: str) -> None:
    """Test hook, in this process only: the next save stops once every file is written (when it checksums them, just
    before the commit) -- for a background save, in its writer thread while training goes on --, writes `marker` and
    sleeps until killed."""
    from ndparallel.checkpoint import storage

    def paused(*args, **kwargs):
        Path(marker).write_text("files written, not committed")
        while True:
            time.sleep(60)

    storage.checksum_files = paused


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    for axis in ("pp", "dp_replicate", "dp_shard", "tp", "cp"):
        p.add_argument(f"--{axis.replace('_', '-')}-size", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--dataset-size", type=int, default=28)
    p.add_argument("--workers", type=int, default=0, help="the DataLoader's num_workers")
    p.add_argument("--persistent-workers", action="store_true")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--hidden-size", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tied", action="store_true", help="tie the input embedding and the LM head")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--no-fsdp-plugin", action="store_true")
    p.add_argument("--full-state", action="store_true", help="FULL_STATE_DICT checkpoints")
    p.add_argument("--project-dir", default=None, help="automatic checkpoint naming under this directory")
    p.add_argument("--save-dir", default=None, help="without --project-dir: save to <save-dir>/step_<n>")
    p.add_argument("--total-limit", type=int, default=None)
    p.add_argument("--save-at", type=int, nargs="*", default=[])
    p.add_argument("--load", default=None, help="a checkpoint directory, or 'latest' (the project's newest)")
    p.add_argument("--pause-in-save", type=int, default=None, help="step whose save pauses (pause_after_models)")
    p.add_argument("--pause-marker", default=None)
    p.add_argument("--async-save", action="store_true", help="save_state(async_save=True); --pause-in-save then "
                   "pauses the background writer before its commit (pause_before_commit)")
    p.add_argument("--progress-file", default=None, help="the main process writes each step number here")
    p.add_argument("--return-params", action="store_true")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple:
    """The Accelerator and the prepared model, optimizer, data loader, scheduler, plus the registered counter."""
    pc = ParallelismConfig(pp_size=args.pp_size, dp_replicate_size=args.dp_replicate_size,
                           dp_shard_size=args.dp_shard_size, tp_size=args.tp_size, cp_size=args.cp_size)
    plugin = None if args.no_fsdp_plugin else FullyShardedDataParallelPlugin(
        state_dict_type="FULL_STATE_DICT" if args.full_state else "SHARDED_STATE_DICT")
    project = ProjectConfiguration(project_dir=args.project_dir, total_limit=args.total_limit,
                                   automatic_checkpoint_naming=args.project_dir is not None)
    # The schedule counts optimizer steps (stepped by hand below), so it is the same under every layout.
    accelerator = Accelerator(parallelism_config=pc, fsdp_plugin=plugin, gradient_accumulation_steps=args.accum,
                              project_config=project, step_scheduler_with_optimizer=False)

    set_seed(0)
    model = build_model("llama", attention_dropout=args.dropout, hidden_size=args.hidden_size,
                        num_hidden_layers=args.layers, tie_word_embeddings=args.tied)
    optimizer = make_optimizer(args.optimizer, model.parameters(), 1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    micro_batch = args.global_batch // (accelerator.data_parallel_size * args.accum)
    dataset = TokenDataset(args.dataset_size, args.seq_len, VOCAB)
    dataloader = DataLoader(dataset, batch_size=micro_batch, shuffle=True, num_workers=args.workers,
                            persistent_workers=args.persistent_workers)
    counter = StepCounter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    return accelerator, model, optimizer, dataloader, scheduler, counter


def evaluate(model: torch.nn.Module, dataset: TokenDataset, rows: int) -> float:
    """An evaluation forward on the first `rows` samples (whole sequences, on every rank), as a loop does between
    training steps: no backward follows it."""
    batch = torch.utils.data.default_collate([dataset[i] for i in range(rows)])
    model.eval()
    with torch.no_grad():
        loss = model(**batch).loss
    model.train()
    return float(loss)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    accelerator, model, optimizer, dataloader, scheduler, counter = build(args)
    loaded = None
    if args.load is not None:
        loaded = accelerator.load_state(None if args.load == "latest" else args.load)

    losses: dict[int, float] = {}
    saved: list[str] = []
    step = accelerator.gradient_state.optimizer_steps  # optimizer steps done (restored by load_state)
    model.train()
    while step < args.steps:
        for batch in dataloader:
            with accelerator.accumulate(model):
                buffers = [batch["input_ids"], batch["labels"]]
                if accelerator.cp_size > 1:  # as tests/scripts/accelerate_style.py
                    batch["shift_labels"] = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
                    batch["position_ids"] = torch.arange(args.seq_len).repeat(len(buffers[0]), 1)
                    buffers += [batch["shift_labels"], batch["position_ids"]]
                with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                                        no_restore_buffers=set(buffers)):
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                if accelerator.sync_gradients:  # once per optimizer step
                    scheduler.step()
                optimizer.zero_grad()
            # The global token mean of the step (the same number under every layout).
            logged = accelerator.reduce_loss(loss)
            if accelerator.sync_gradients:
                step += 1
                counter.count += 1
                losses[step] = float(logged)
                if args.progress_file and accelerator.is_main_process:
                    Path(args.progress_file).write_text(str(step))
                if step == args.pause_in_save:
                    accelerator.wait_for_checkpoint()  # an earlier background save must not be the one paused
                    (pause_before_commit if args.async_save else pause_after_models)(args.pause_marker)
                if step in args.save_at:
                    evaluate(model, TokenDataset(args.dataset_size, args.seq_len, VOCAB), len(batch["input_ids"]))
                    saved.append(accelerator.save_state(
                        None if args.project_dir else os.path.join(args.save_dir, f"step_{step}"),
                        async_save=args.async_save))
                if step >= args.steps:
                    break

    result = {"losses": losses, "counter": counter.count, "loaded": loaded, "saved": saved,
              "lr": scheduler.get_last_lr()[0], "epoch": dataloader.epoch}
    if args.return_params:
        result["params"] = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    if args.json_out and accelerator.is_main_process:
        with open(args.json_out, "w") as f:
            json.dump({k: v for k, v in result.items() if k != "params"}, f)
    accelerator.end_training()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
