"""The single-process reference: the same model, data and optimizer in plain PyTorch, on the global batch.

It shares nothing with ndparallel: one process, no wrappers, `torch.nn.utils.clip_grad_norm_`, the model's own
mean loss over the whole global batch.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from tiny_models import VOCAB, TokenDataset, build_model, make_optimizer


def reference_run(model_name: str = "llama", global_batch: int = 4, seq_len: int = 16, steps: int = 6,
                  lr: float = 1e-2, uneven_labels: bool = False, optimizer: str = "adamw",
                  mean_of_chunks: int = 1, float64: bool = False, layers: int | None = None) -> dict:
    """Train on the global batch; `mean_of_chunks=k` instead averages the mean losses of k equal chunks of
    each batch (what naive data parallelism over k ranks computes) -- used to show the tests can fail.
    `float64` runs the model and its loss in float64; `layers`: decoder layers of the tiny model."""
    torch.manual_seed(0)
    model = build_model(model_name, float64, **({} if layers is None else {"num_hidden_layers": layers}))
    optimizer = make_optimizer(optimizer, model.parameters(), lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    dataset = TokenDataset(steps * global_batch, seq_len, VOCAB, uneven_labels)
    losses = []
    for batch in DataLoader(dataset, batch_size=global_batch, shuffle=False):
        if mean_of_chunks == 1:
            loss = model(**batch).loss
        else:
            chunks = [{k: v.chunk(mean_of_chunks)[i] for k, v in batch.items()} for i in range(mean_of_chunks)]
            loss = torch.stack([model(**c).loss for c in chunks]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "params": params, "lr": scheduler.get_last_lr()[0]}
