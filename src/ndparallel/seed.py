"""`set_seed`, Accelerate's name and meaning: one seed for Python, NumPy and torch."""

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

