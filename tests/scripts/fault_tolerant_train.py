"""A raw Accelerate-style loop, launched with ``ndparallel launch --fault-tolerant`` by tests/fault_tolerance and
benchmarks/goodput.py. Nothing in it is about faults except the kills it is told to do.

    python fault_tolerant_train.py OUT --steps N [--kill-at STEP ...] [--step-seconds S] [--checkpoint-every C]

Each --kill-at: rank 1 of replica group 1 (without --fault-tolerant: the last rank) SIGKILLs itself in the middle of
that step (after the forward, before backward), once per attempt of its group -- the k-th kill on the k-th start.
At the end every rank writes its local parameter shards to OUT/params_replica{R}_rank{r}.pt; the participation log
goes to OUT/log (FaultToleranceKwargs). --checkpoint-every C (the restart-from-checkpoint way, without
--fault-tolerant): save_state to OUT/checkpoint every C steps, load_state from it on start when it exists.
--verify-checkpoint: only load OUT/checkpoint and write the parameters loaded to OUT/loaded_rank{r}.pt.
--evaluate-every E: a forward in evaluation mode, without gradients, after every E-th step.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from ndparallel import Accelerator
from ndparallel.fault_tolerance import FaultToleranceKwargs

SAMPLES_PER_RANK = 2  # the loader's batch size


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def dataset(steps: int, global_batch: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps * global_batch, 16, generator=g)
    return TensorDataset(x, (x[:, :1] * x[:, 1:2]).tanh() + 0.1 * torch.randn(len(x), 1, generator=g))


def local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


class StepCount:
    """The optimizer steps taken, saved with the checkpoint (register_for_checkpointing)."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill-at", type=int, action="append", default=[])
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--verify-checkpoint", action="store_true")
    parser.add_argument("--evaluate-every", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    fault_tolerant = "NDPARALLEL_FT_REPLICAS" in os.environ
    handlers = [FaultToleranceKwargs(participation_log=str(out / "log"))] if fault_tolerant else []
    accelerator = Accelerator(kwargs_handlers=handlers)
    ft = accelerator.replica_groups.settings if fault_tolerant else None
    replicas, replica_id = (ft.replicas, ft.replica_id) if ft else (1, 0)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    last = accelerator.num_processes - 1
    killer = (replica_id, accelerator.process_index) == ((1, 1) if fault_tolerant else (0, last))
    kill = args.kill_at[attempt] if killer and attempt < len(args.kill_at) else None
    global_batch = SAMPLES_PER_RANK * accelerator.num_processes * replicas
    loader = DataLoader(dataset(args.steps, global_batch), batch_size=SAMPLES_PER_RANK, shuffle=False)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    count = StepCount()
    checkpoint = out / "checkpoint"
    if args.checkpoint_every or args.verify_checkpoint:
        accelerator.register_for_checkpointing(count)
        if checkpoint.exists():
            accelerator.load_state(checkpoint)
    if args.verify_checkpoint:
        torch.save(local_shards(model), out / f"loaded_rank{accelerator.process_index}.pt")
        accelerator.end_training()
        return
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        step = accelerator.replica_groups.manager.current_step() if fault_tolerant else count.steps
        if kill is not None and step >= kill:
            os.kill(os.getpid(), signal.SIGKILL)  # dies holding this step: its peers' all-reduce fails
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        count.steps += 1
        if args.checkpoint_every and count.steps % args.checkpoint_every == 0:
            accelerator.save_state(checkpoint)
        if args.evaluate_every and count.steps % args.evaluate_every == 0:  # an evaluation between steps
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
        time.sleep(args.step_seconds)
    torch.save(local_shards(model), out / f"params_replica{replica_id}_rank{accelerator.process_index}.pt")
    (out / f"steps_replica{replica_id}_rank{accelerator.process_index}.txt").write_text(str(count.steps))
    accelerator.end_training()


if __name__ == "__main__":
    main()
