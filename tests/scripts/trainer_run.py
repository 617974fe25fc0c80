"""An ordinary Hugging Face Trainer run, as a user writes it; nothing in it names ndparallel.

`train(...)` runs it in the calling process (a rank forked by tests/harness.py, whose NDPARALLEL_* variables say
the layout, as ``ndparallel launch`` would; or the pytest process itself, as the one-process reference) and returns
what the tests compare: the loss the Trainer logged at each step and the trained parameters in full.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tiny_models import TokenDataset, build_model


def train(output_dir: str, *, steps: int = 6, per_device: int = 2, accumulation: int = 1, seq_len: int = 16,
          samples: int = 48, average_tokens: bool = True, optim: str = "adamw_torch", model: str = "llama",
          eval_steps: int | None = None, save_steps: int | None = None, resume: str | bool | None = None,
          predict: bool = False, save_to: str | None = None, loss_kwargs: bool = True,
          cached_on: int | None = None, resets_state: bool = False,
          extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """`loss_kwargs=False`: the model says it takes no loss keywords (``accepts_loss_kwargs = False``, as a model
    whose forward has no ``num_items_in_batch`` does, and as Axolotl sets it): the Trainer then counts no tokens and
    each micro-batch's loss is the model's own mean. `cached_on`: that rank reads the same training rows as a
    ``datasets.Dataset`` (as one loaded from another rank's cache), the others as the dataset that made them.
    `resets_state`: a Trainer subclass that resets Accelerate's state as Axolotl's does (`_resetting_trainer`)."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=per_device,
        per_device_eval_batch_size=per_device, gradient_accumulation_steps=accumulation, learning_rate=1e-2,
        warmup_steps=2, lr_scheduler_type="linear", weight_decay=0.01, max_grad_norm=1.0, logging_steps=1,
        report_to=[], use_cpu=True, seed=0, optim=optim, average_tokens_across_devices=average_tokens,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        eval_strategy="steps" if eval_steps else "no", eval_steps=eval_steps, disable_tqdm=True,
        dataloader_drop_last=True, **(extra or {}))
    torch.manual_seed(0)
    evaluation = TokenDataset(8, seq_len, uneven_labels=True)
    net = build_model(model)
    if not loss_kwargs:
        net.accepts_loss_kwargs = False
    train_rows = TokenDataset(samples, seq_len, uneven_labels=True)
    if cached_on is not None and int(os.environ.get("RANK", "0")) == cached_on:
        from datasets import Dataset

        train_rows = Dataset.from_dict({"input_ids": train_rows.input_ids.tolist(),
                                        "labels": train_rows.labels.tolist()}).with_format("torch")
    trainer = (_resetting_trainer() if resets_state else Trainer)(model=net, args=args, train_dataset=train_rows,
                      eval_dataset=evaluation if eval_steps else None, compute_metrics=token_accuracy)
    trainer.train(resume_from_checkpoint=resume)
    history = trainer.state.log_history
    out = {"losses": [h["loss"] for h in history if "loss" in h],
           "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h],
           "eval_losses": [h["eval_loss"] for h in history if "eval_loss" in h],
           "epochs": [h["epoch"] for h in history if "loss" in h],  # where the Trainer thinks each step is
           "params": full_parameters(trainer.model),
           "accelerator": type(trainer.accelerator).__module__,
           "rank": int(os.environ.get("RANK", "0"))}
    if predict:
        out["predict"] = trainer.predict(evaluation).metrics
    if save_to is not None:
        trainer.save_model(save_to)
    return out


def _resetting_trainer() -> type:
    from accelerate import PartialState
    from accelerate.state import AcceleratorState
    from transformers import Trainer

    class ResettingTrainer(Trainer):
        """What Axolotl 0.19's AxolotlTrainer and its DistributedParallelMixin do around the Accelerator: reset
        Accelerate's shared state before building it (so it configures itself from the environment), then, for an
        FSDP run without an FSDP plugin, call it multi-GPU through ``state._shared_state`` and a new PartialState."""

        def create_accelerator_and_postprocess(self) -> None:
            if not self.args.accelerator_config.to_dict().get("use_configured_state", False):
                AcceleratorState._reset_state(reset_partial_state=True)
            super().create_accelerator_and_postprocess()
            if self.accelerator.distributed_type == "FSDP" and self.accelerator.state.fsdp_plugin is None:
                self.accelerator.state.distributed_type = "MULTI_GPU"
                self.accelerator.state._shared_state["distributed_type"] = "MULTI_GPU"
                PartialState().distributed_type = "MULTI_GPU"

    return ResettingTrainer


def token_accuracy(prediction: Any) -> dict[str, float]:
    """compute_metrics: next-token accuracy over the labelled positions, and the logits' mean."""
    logits, labels = prediction.predictions, prediction.label_ids
    hits = (logits[:, :-1].argmax(-1) == labels[:, 1:])[labels[:, 1:] != -100]
    return {"accuracy": float(hits.mean()), "logit_mean": float(logits.mean())}


def initial_parameters(model: str = "llama") -> dict[str, torch.Tensor]:
    """The parameters `train` starts from."""
    torch.manual_seed(0)
    return {name: p.detach().clone() for name, p in build_model(model).named_parameters()}


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter in full (DTensors gathered: collective), on the CPU."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = value.detach().cpu().clone()
    return out
