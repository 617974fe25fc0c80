"""`set_seed`, Accelerate's name and meaning: one seed for Python, NumPy and torch; `synchronize_rng_states`: rank
0's generator states on every process."""

from __future__ import annotations

import os
import random

import torch


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python, NumPy (if installed) and torch; with `device_specific`, add this process's rank; with
    `deterministic`, ask torch for deterministic algorithms."""
    if device_specific:
        seed += int(os.environ.get("RANK", "0"))
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)



def synchronize_rng_state(rng_type: str | None = None, generator: torch.Generator | None = None) -> None:
    """Accelerate's: every process takes rank 0's state of one random generator -- ``"torch"`` (torch's CPU
    generator), ``"cuda"`` (this process's GPU's), ``"generator"`` (`generator`). Collective over every process."""
    import torch.distributed as dist

    kind = getattr(rng_type, "value", rng_type)  # Accelerate's RNGType enum, or its string
    if kind == "torch":
        state = torch.get_rng_state()
    elif kind == "cuda":
        state = torch.cuda.get_rng_state()
    elif kind == "generator":
        if generator is None:
            raise ValueError('synchronize_rng_state("generator") needs the generator: pass generator=...')
        state = generator.get_state()
    else:
        raise ValueError(f"synchronize_rng_state: {rng_type!r} is not a random generator ndparallel runs on; use "
                         '"torch", "cuda" or "generator"')
    if dist.is_initialized() and dist.get_world_size() > 1:
        on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else state.device
        moved = state.to(on)
        dist.broadcast(moved, src=0)
        state = moved.cpu()
    if kind == "torch":
        torch.set_rng_state(state)
    elif kind == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        generator.set_state(state)


def synchronize_rng_states(rng_types: list[str], generator: torch.Generator | None = None) -> None:
    """`synchronize_rng_state` for each of `rng_types`, in order."""
    for rng_type in rng_types:
        synchronize_rng_state(rng_type, generator=generator)
