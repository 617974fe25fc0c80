"""LoRA fine-tuning in the README's loop, as a PEFT user writes it: `train(...)` runs in the calling rank (forked by
tests/harness.py) under the layout `sizes` (one process without), and returns what the tests compare."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tiny_models import TokenDataset, build_model

TARGETS = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROBE = torch.arange(2 * 12).reshape(2, 12) % 90  # the input whose logits the saved adapters are checked on


def lora_model(name: str = "llama", **lora: Any) -> torch.nn.Module:
    """A tiny model (seed 0) with LoRA (r 8, alpha 16, seed 1, B initialised to nonzero) on every projection."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = build_model(name)
    torch.manual_seed(1)
    config = {"r": 8, "lora_alpha": 16, "target_modules": TARGETS.get(name, ALL_PROJECTIONS), "lora_dropout": 0.0,
              "init_lora_weights": False, **lora}
    return get_peft_model(model, LoraConfig(**config))


def train(sizes: dict[str, int], name: str = "llama", steps: int = 6, accumulation: int = 1,
          sequence_parallel: bool = False, save: str | None = None, merged: str | None = None,
          state: str | None = None, resume: str | None = None) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from ndparallel import (Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig,
                            TorchTensorParallelConfig)

    config = ParallelismConfig(**{f"{k}_size": v for k, v in sizes.items()},
                               tp_handler=TorchTensorParallelConfig(sequence_parallel=sequence_parallel))
    acc = Accelerator(parallelism_config=config, gradient_accumulation_steps=accumulation,
                      fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = lora_model(name)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    data_ranks = sizes.get("dp_shard", 1) * sizes.get("dp_replicate", 1)
    loader = torch.utils.data.DataLoader(TokenDataset(4 * steps * accumulation, 16, uneven_labels=True),
                                         batch_size=4 // data_ranks)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    if resume is not None:
        acc.load_state(resume)  # the model, the optimizer, and where the data loader was
    losses = []
    for i, batch in enumerate(loader):
        batch["shift_labels"] = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
        buffers = [batch["input_ids"], batch["labels"], batch["shift_labels"]]
        with acc.accumulate(model):
            with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                            no_restore_buffers=set(buffers)):
                loss = model(**batch).loss
                acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            logged = acc.reduce_loss(loss)
        if acc.sync_gradients:
            losses.append(logged.item())
            if state is not None and len(losses) == 2 and resume is None:
                model.eval()  # an evaluation forward first, as a training loop has: it must change nothing saved
                with torch.no_grad():
                    model(input_ids=batch["input_ids"], labels=batch["labels"])
                model.train()
                acc.save_state(state)
    unwrapped = acc.unwrap_model(model)
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
              for n, p in unwrapped.named_parameters()}
    trained = {n for n, p in unwrapped.named_parameters() if p.requires_grad}
    out = {"losses": losses, "params": params, "trained": sorted(trained),
           "frozen_unchanged": all(torch.equal(params[n], frozen[n]) for n in params if n in frozen),
           "frozen_without_grads": all(p.grad is None for n, p in unwrapped.named_parameters() if n not in trained),
           "optimizer_state": sum(len(s) > 0 for s in optimizer.state.values())}
    if save is not None:
        acc.save_model(model, save)
    if merged is not None:
        acc.save_model(model, merged, merge_adapters=True)
    if sizes == {}:  # one process: the trained model's logits on the probe, for the saved adapters to match
        with torch.no_grad():
            out["probe_logits"] = unwrapped(input_ids=PROBE).logits
    return out
