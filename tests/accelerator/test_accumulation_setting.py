"""``accelerator.gradient_accumulation_steps = N`` after construction (Accelerate lets scripts set it): the
accumulation windows and the data loaders' token windows follow, so training equals an Accelerator built with N."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from harness import run_ranks
from tiny_models import VOCAB, build_model


def _train(set_after: bool) -> dict:
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.state import GradientState

    accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2),
                              gradient_accumulation_steps=1 if set_after else 2)
    torch.manual_seed(0)
    model = build_model("llama")
    rows = []
    for i in range(16):  # a different number of -100 labels in every sample: the token weights matter
        ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(i))
        labels = ids.clone()
        labels[: i % 7] = -100
        rows.append({"input_ids": ids, "labels": labels})
    loader = DataLoader(rows, batch_size=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if set_after:
        accelerator.gradient_accumulation_steps = 2
    syncs = []
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            syncs.append(accelerator.sync_gradients)
            optimizer.step()
            optimizer.zero_grad()
    error = None
    with accelerator.accumulate(model):  # one micro-step into a window: refused there
        accelerator.backward(model(**next(iter(loader))).loss)
        try:
            accelerator.gradient_accumulation_steps = 3
        except ValueError as exc:
            error = str(exc)
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    accelerator.sync_gradients = False  # settable, as in Accelerate: the shared gradient state follows
    flags = [GradientState().sync_gradients]
    accelerator.sync_gradients = True
    flags.append(GradientState().sync_gradients)
    out = {"syncs": syncs, "num_steps": GradientState().num_steps, "error": error, "flags": flags,
           "state": state if accelerator.is_main_process else None}
    accelerator.end_training()
    return out


@pytest.mark.slow
def test_accumulation_steps_set_after_prepare_train_as_if_given_at_construction():
    given, set_after = run_ranks(_train, 2, False), run_ranks(_train, 2, True)
    for rank in range(2):
        assert set_after[rank]["syncs"] == given[rank]["syncs"] == [False, True] * 2, set_after[rank]["syncs"]
        assert set_after[rank]["num_steps"] == 2 and set_after[rank]["flags"] == [False, True]
        assert "in the middle of an accumulation window (1 of its 2 micro-steps done)" in set_after[rank]["error"]
    for name, value in given[0]["state"].items():
        assert torch.equal(set_after[0]["state"][name], value), name
