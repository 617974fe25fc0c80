"""Tier 1: the small helpers with Accelerate's names."""

import random

import torch

from ndparallel import set_seed
from ndparallel.utils import progress_bar


def test_progress_bar_is_drawn_by_the_main_process_only():
    assert progress_bar(range(3), main_process=True).disable is False
    assert progress_bar(range(3), main_process=False).disable is True
    assert progress_bar(range(3), main_process=True, disable=True).disable is True
    assert progress_bar(range(3), main_process=False, disable=False).disable is True
    assert list(progress_bar(range(3), main_process=False)) == [0, 1, 2]


def test_set_seed_makes_python_and_torch_repeat(monkeypatch):
    set_seed(7)
    first = (random.random(), torch.rand(3))
    set_seed(7)
    assert random.random() == first[0] and torch.equal(torch.rand(3), first[1])
    monkeypatch.setenv("RANK", "3")
    set_seed(7, device_specific=True)  # seed 7 + rank 3
    shifted = torch.rand(3)
    set_seed(10)
    assert torch.equal(torch.rand(3), shifted)
