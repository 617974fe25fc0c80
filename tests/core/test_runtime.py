"""Starting and releasing torch.distributed (`ndparallel.distributed.runtime`): a process can end one world and start
another (a notebook, a test suite, Accelerate's own tests create Accelerators one after another)."""

from __future__ import annotations

import torch

from harness import run_ranks


def _three_worlds() -> list:
    import torch.distributed as dist

    from ndparallel import Accelerator, ParallelismConfig

    out = []
    for world in range(3):
        accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        accelerator.backward(model(torch.full((3, 4), float(accelerator.process_index))).sum())
        optimizer.step()
        out.append((accelerator.reduce(torch.tensor([world + 1.0]), "sum").item(),
                    accelerator.gather(torch.tensor([accelerator.process_index])).tolist()))
        accelerator.end_training()
        out.append(dist.is_initialized())
    return out


def test_a_process_ends_its_world_and_starts_another_twice():
    """Each world made after `end_training` released the last one trains and meets in its collectives (the second
    world used to hang in its first barrier, reading the first world's keys from rank 0's store)."""
    results = run_ranks(_three_worlds, 2, timeout=180, env={"NDPARALLEL_TIMEOUT": "60"})
    for out in results:
        assert out == [(2.0, [0, 1]), False, (4.0, [0, 1]), False, (6.0, [0, 1]), False], out
