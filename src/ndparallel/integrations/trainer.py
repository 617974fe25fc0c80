"""The Hugging Face ``Trainer`` (and TRL's trainers, which derive from it) on ndparallel's N-D layouts.

When. A Trainer is taken over when it is asked for a layout: the script runs under ``ndparallel launch`` with sizes
(the ``NDPARALLEL_*`` variables), or its ``TrainingArguments(parallelism_config=...)`` is an
``ndparallel.ParallelismConfig`` (any launcher). Otherwise it is left exactly as transformers made it.

What changes, each for a reason (the rest of the training loop is the Trainer's own):

1. Its Accelerator (`create_accelerator_and_postprocess`) is ndparallel's, built from the Trainer's own arguments
   (Accelerate's plugin objects converted field by field; sizes left unset come from the launch). The Trainer
   accumulates gradients itself (its Accelerator gets one micro-step per window) and normalises the loss itself,
   so ndparallel's `backward` adds no weighting of its own (``loss_weighting="mean"``: a factor of one). The
   Trainer trains and evaluates the model `prepare` returned (`_wrap_model`), which keeps its place on record across
   the Trainer's ``free_memory()`` at every ``train()``. Accelerate's ``PartialState``, which the Trainer's arguments
   read, is configured again if a Trainer subclass reset it to have the Accelerator configure it (Axolotl's does:
   `_configure_accelerate_state`), and ``accelerator.state`` keeps what is written to its ``_shared_state``; its
   ``fsdp_plugin`` is the Accelerator's once built (`_TrainerView`). A Trainer method hooked here that another library
   replaces on ``Trainer`` afterwards is refused by name (`check_support`).
2. The loss's token count (`_get_num_items_in_batch`). The Trainer divides each micro-batch's summed token loss by
   a count X and, with ``average_tokens_across_devices``, multiplies it by M = processes / tp (DDP averages
   gradients over processes); its own X counts tokens over every process and divides by tp * cp * sp. ndparallel
   averages gradients over the W ranks of the ``loss`` view (batch x cp x sp) and counts each sample's tokens once
   (`ndparallel.training.loss.count_loss_tokens` on the full rows, summed over ``batch``), giving N, the tokens of the
   whole optimizer step. X = N * M / W makes every rank's loss S * W / N, so the averaged gradient is the one process's
   grad(sum S / N) and the logged loss (the Trainer's mean over processes) its sum S / N -- with
   ``average_tokens_across_devices`` on (M = W without pipeline stages) and off (M = 1), and whatever the -100 labels
   over ranks and micro-batches.
3. Context and sequence parallelism (`_prepare_context_parallel_inputs`): ``shift_labels`` made before sharding,
   ``position_ids`` added, then every sequence tensor of the batch sharded by `Accelerator.maybe_context_parallel`
   (cp and sp alike; padded and packed rows included: ndparallel keeps their masks). TRL's padding-free fields
   (``cu_seq_lens_*``, ``max_length_*``) are dropped after a check that they describe the rows ``position_ids``
   restarts at: ndparallel reads the documents from ``position_ids``. The Trainer's batches per epoch are the loader's
   length under sp too (`set_initial_training_values`: transformers counts sp_size times as many, for Accelerate's
   DeepSpeed-Ulysses adapter, which cuts each batch into sp_size; ndparallel's loader does not). The Trainer draws a whole accumulation
   window of batches before its first micro-step; each micro-step shards with what the data loader said of its own
   batch (`TrainerAccelerator._start_batch`). When the Trainer counts no tokens (a model that
   takes no ``num_items_in_batch``: ``model_accepts_loss_kwargs`` False), each rank's loss is its model's mean over
   its shard of the rows; the model's loss is then weighted (a forward hook while the batch is sharded: a subclass's
   own ``compute_loss`` keeps it) by the shard's share of the rows' loss tokens, n_r * G / n over the G ranks of
   cp x sp, so the ranks' average is the rows' mean, as in one process. Evaluation and prediction run whole rows on
   every rank of cp x sp (the logits ``compute_metrics`` reads are whole, as in one process; the loss's count for
   them divides over the ``batch`` ranks, whose losses the Trainer averages).
4. Saving and resuming. `save_model` gathers the full weights on every rank (collective) and the main process writes
   them, as ``save_pretrained`` does; a checkpoint's optimizer and model go into ``<checkpoint>/ndparallel/`` as a
   sharded ndparallel checkpoint, which loads under any other layout (`_save_optimizer_and_scheduler` /
   `_load_optimizer_and_scheduler`; ``load_best_model_at_end`` reads the best one's, `_load_best_model`); resuming
   skips the consumed batches of ndparallel's data loader (`skip_first_batches`). The LR scheduler and the Trainer's
   state are the Trainer's files.
5. Under ``ndparallel launch --fault-tolerant``: ``train`` and ``_save_checkpoint`` (installed always, acting only
   there) let a restarted replica group resume at the live step and one group write the checkpoints
   (`trainer_faults`).

Where each lives: item 1 in `trainer_accelerator`, item 2 here, item 3 in `trainer_sequence`, item 4 in
`trainer_checkpoints`, item 5 in `trainer_faults`, the version policy below in `trainer_versions`. This module lists
the Trainer's methods replaced (`HOOKS`) and attaches them (`install`); the public names of `trainer_accelerator`,
`trainer_sequence` and `trainer_checkpoints`, which this module held before, are importable from here too.

Versions (`TESTED_TRANSFORMERS`: the oldest supported minor and the newest tested one). Every minor from 5.16 (what
Axolotl 0.19 pins) through 5.25 was read and tested: their Trainers have the methods replaced here (`HOOKS`) with the
same signatures and the same calls to them (where they differ, the replacements do not call the Trainer's own). One
difference matters: the factor M by which ``compute_loss`` multiplies the loss (item 2) divides the processes by
``get_tp_size()`` from 5.19 on, by its Accelerator's ``parallelism_config.tp_size`` before (`_loss_multiplier`).
Tested with transformers 5.25.0, TRL 1.16.0, PEFT 0.21.2, Accelerate 1.16.0, and with 5.16.1, TRL 1.9.2, PEFT 0.20.0,
Accelerate 1.13.0 (``.ci/run``'s oldest-versions environment); ``.ci/newest.sh`` runs the integration's tests on the
newest releases of each as CI runs. The policy, when a Trainer would be taken over (`check_support`):

- older than 5.16: refused, with the floor;
- newer than the newest tested minor: it runs, with one warning on the main process naming the tested range --
  provided every hook is there as written for (next point); a release is not refused for its number alone;
- whatever the version: a hooked method that is gone, whose parameters changed, or that the Trainer's subclass (TRL's
  trainers, Axolotl's) overrides without calling the Trainer's own, is refused by name, with what was expected.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from ..training.loss import count_loss_tokens
from . import trainer_faults
from .trainer_accelerator import (TrainerAccelerator, _accelerator_factory, build_accelerator,  # noqa: F401
                                  create_accelerator_and_postprocess, taken_over, wanted, wrap_model)
from .trainer_checkpoints import (CHECKPOINT_SUBDIR, load_best_model, load_from_checkpoint,  # noqa: F401
                                  load_optimizer_and_scheduler, save_model, save_optimizer_and_scheduler,
                                  skip_first_batches)
from .trainer_sequence import prepare_context_parallel_inputs, prepare_input, set_initial_training_values
from .trainer_versions import (HOOK_MARK, TESTED_TRANSFORMERS, check_support, check_version,  # noqa: F401
                               hook_problems, warn_once)


# ---- the loss's token count (item 2) ------------------------------------------------------------------------------
def get_num_items_in_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, batch_samples: list, device: torch.device) -> torch.Tensor | int | None:
        if not taken_over(self):
            return original(self, batch_samples, device)
        acc = self.accelerator
        counts = [count_loss_tokens(batch) for batch in batch_samples]
        if (not batch_samples or any(count is None for count in counts)
                or not (self.model_accepts_loss_kwargs or self.compute_loss_func is not None)):
            # The Trainer then divides each micro-batch's mean loss by the micro-batches (Accelerate's meaning).
            if torch.is_grad_enabled():
                acc.loss_scale_after_the_call = 1.0 / max(1, len(batch_samples))
            return None
        total = torch.tensor([float(sum(counts))], dtype=torch.float64, device=acc.device)
        if acc.mesh.size("batch") > 1:
            dist.all_reduce(total, group=acc.mesh.group("batch"))
        multiplier = _loss_multiplier(self) if self.args.average_tokens_across_devices else 1
        if torch.is_grad_enabled():  # training: see the module docstring, item 2: X = N * M / W
            acc.loss_scale_after_the_call = float(multiplier)  # pipeline stages weigh their loss by it
            ranks = acc.mesh.size("loss")
        else:  # evaluation (item 3: whole rows): the Trainer averages each batch rank's loss, S * W_batch / N
            ranks = acc.mesh.size("batch")
        return (total * multiplier / ranks).to(torch.float32).squeeze(0)
    return wrapper


def _loss_multiplier(trainer: Any) -> int:
    """M of item 2: what ``compute_loss`` multiplies the loss by under ``average_tokens_across_devices`` -- the
    processes over the tensor-parallel size, which transformers reads from ``get_tp_size()`` since 5.19 and from its
    Accelerator's ``parallelism_config`` before."""
    import transformers
    from packaging.version import Version

    acc = trainer.accelerator
    if Version(transformers.__version__) >= Version("5.19"):
        return acc.num_processes // trainer.get_tp_size()
    return acc.num_processes // acc.parallelism_config.tp_size


# The Trainer's methods replaced here (their parameters: `trainer_versions.EXPECTED_PARAMETERS`).
HOOKS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "create_accelerator_and_postprocess": create_accelerator_and_postprocess,
    "_get_num_items_in_batch": get_num_items_in_batch,
    "_prepare_context_parallel_inputs": prepare_context_parallel_inputs,
    "save_model": save_model,
    "_save_optimizer_and_scheduler": save_optimizer_and_scheduler,
    "_load_optimizer_and_scheduler": load_optimizer_and_scheduler,
    "_load_from_checkpoint": load_from_checkpoint,
    "_load_best_model": load_best_model,
    "_wrap_model": wrap_model,
    "_prepare_input": prepare_input,
    "set_initial_training_values": set_initial_training_values,
}


def install(module: ModuleType) -> None:
    """Attach the integration to ``transformers.trainer`` (`module`), once. Where a hook does not fit (another
    transformers than the one this was written for) nothing is replaced but ``create_accelerator_and_postprocess``,
    which refuses, naming what does not fit, when a Trainer would be taken over."""
    trainer = module.Trainer
    if getattr(trainer, "_ndparallel_integration", False):
        return
    if hook_problems(module):
        def refuse(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def wrapper(self: Any) -> None:
                if wanted(self):
                    check_support(self, module)  # raises, naming what does not fit
                return original(self)
            return wrapper
        trainer.create_accelerator_and_postprocess = refuse(trainer.create_accelerator_and_postprocess)
        trainer._ndparallel_refusing = True
    else:
        for name, wrap in HOOKS.items():
            hook = wrap(getattr(trainer, name))
            setattr(hook, HOOK_MARK, name)
            setattr(trainer, name, hook)
        trainer_faults.install(trainer)  # train / _save_checkpoint: act only under fault tolerance
        module.Accelerator = _accelerator_factory(module.Accelerator)
        module.skip_first_batches = skip_first_batches(module.skip_first_batches)
    trainer._ndparallel_integration = True
