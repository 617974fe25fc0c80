"""A raw Accelerate-style loop, launched with ``ndparallel launch --fault-tolerant`` by tests/fault_tolerance and
benchmarks/goodput.py. Nothing in it is about faults except the kills it is told to do.

    python fault_tolerant_train.py OUT --steps N [--kill-at STEP ...] [--step-seconds S]

Each --kill-at: rank 1 of replica group 1 SIGKILLs itself in the middle of that step (after the forward, before
backward), once per attempt of its group -- the k-th kill on the k-th start. At the end every rank writes its local
parameter shards to OUT/params_replica{R}_rank{r}.pt; the participation log goes to OUT/log (FaultToleranceKwargs).
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill-at", type=int, action="append", default=[])
    parser.add_argument("--step-seconds", type=float, default=0.0)
    args = parser.parse_args()
    out = Path(args.out)
    accelerator = Accelerator(kwargs_handlers=[FaultToleranceKwargs(participation_log=str(out / "log"))])
    ft = accelerator.replica_groups.settings
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill = (args.kill_at[attempt] if ft.replica_id == 1 and accelerator.process_index == 1
            and attempt < len(args.kill_at) else None)
    global_batch = SAMPLES_PER_RANK * accelerator.num_processes * ft.replicas
    loader = DataLoader(dataset(args.steps, global_batch), batch_size=SAMPLES_PER_RANK, shuffle=False)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        if kill is not None and accelerator.replica_groups.manager.current_step() >= kill:
            os.kill(os.getpid(), signal.SIGKILL)  # dies holding this step: its peers' all-reduce fails
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(args.step_seconds)
    shards = {name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
              for name, p in model.named_parameters()}
    torch.save(shards, out / f"params_replica{ft.replica_id}_rank{accelerator.process_index}.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main()
