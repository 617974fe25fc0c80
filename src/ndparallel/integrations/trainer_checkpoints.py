"""Saving and resuming a Hugging Face Trainer that ndparallel took over (`ndparallel.integrations.trainer`'s
docstring, item 4): `save_model` gathers the full weights on every rank (collective) for the main process to write; a
checkpoint's model and optimizer go into ``<checkpoint>/ndparallel/`` (`CHECKPOINT_SUBDIR`) as a sharded ndparallel
checkpoint, which loads under any other layout (`save_optimizer_and_scheduler`, `load_optimizer_and_scheduler`,
`load_from_checkpoint`; ``load_best_model_at_end``: `load_best_model`); resuming skips the consumed batches of
ndparallel's data loader (`skip_first_batches`). Under fault tolerance one replica group writes, and a group that
healed resumes from the live state (`trainer_faults`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from .. import checkpoint
from ..distributed.agreement import monitored_barrier
from ..training.data import PreparedDataLoader
from ..training.prepared import PreparedObjects
from . import trainer_faults
from .trainer_accelerator import taken_over

CHECKPOINT_SUBDIR = "ndparallel"  # inside the Trainer's checkpoint-<step> folder


def save_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not taken_over(self):
            return original(self, output_dir, _internal_call)
        groups = self.accelerator.replica_groups
        if groups is not None and not groups.writes_checkpoints():
            return None  # fault tolerance: another replica group writes it (the same weights); every rank alike
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if checkpoint.is_peft_model(self.accelerator.unwrap_model(self.model_wrapped)):
            monitored_barrier("save_model")  # the adapter only, as PEFT saves it (collective: every rank, here)
            state_dict = checkpoint.adapter_state_dict(self.model_wrapped)
        else:
            state_dict = self.accelerator.get_state_dict(self.model_wrapped)  # collective: every rank, here
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
    return wrapper


def _checkpointed(trainer: Any) -> PreparedObjects:
    """The model and optimizer a Trainer checkpoint keeps in ndparallel's format."""
    acc = trainer.accelerator
    return PreparedObjects(acc.gradient_state, acc.scaler, models=[trainer.model_wrapped],
                           optimizers=[trainer.optimizer])


def save_optimizer_and_scheduler(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, output_dir: str) -> None:
        if not taken_over(self):
            return original(self, output_dir)
        acc = self.accelerator
        # Sharded whatever the FSDP plugin's state_dict_type says (a script may set FULL_STATE_DICT for its final
        # save_model): the Trainer's checkpoints load into any layout as they are.
        settings = dataclasses.replace(acc._run_settings(), state_dict_type=checkpoint.SHARDED)
        checkpoint.save_state(_checkpointed(self), settings, checkpoint.ProjectConfiguration(),
                              os.path.join(output_dir, CHECKPOINT_SUBDIR))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))
    return wrapper


def load_optimizer_and_scheduler(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, resume: str | None) -> None:
        if not taken_over(self) or resume is None:
            return original(self, resume)
        live = trainer_faults.live_of(self)
        if live is not None and live.resuming(resume):  # optimizer and weights are live already, the schedule not
            return live.load_scheduler()
        directory = os.path.join(resume, CHECKPOINT_SUBDIR)
        if not os.path.isdir(directory):
            raise ValueError(f"resume_from_checkpoint={resume!r} has no {CHECKPOINT_SUBDIR}/ folder: it was not "
                             "written by a Trainer on ndparallel, whose optimizer states are sharded there")
        checkpoint.load_state(_checkpointed(self), checkpoint.ProjectConfiguration(), directory,
                              parallelism=self.accelerator.state.parallelism_config)
        scheduler = os.path.join(resume, "scheduler.pt")
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
    return wrapper


def load_from_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, resume: str, model: Any = None) -> None:
        # The model's weights come back with its optimizer (`load_optimizer_and_scheduler`), sharded as they are now;
        # resuming from the live state (fault tolerance) they are in place already.
        live = trainer_faults.live_of(self)
        if taken_over(self) and (os.path.isdir(os.path.join(resume, CHECKPOINT_SUBDIR))
                                 or (live is not None and live.resuming(resume))):
            return None
        return original(self, resume, model)
    return wrapper


def load_best_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any) -> None:
        if not taken_over(self):
            return original(self)
        directory = os.path.join(self.state.best_model_checkpoint, CHECKPOINT_SUBDIR)
        checkpoint.load_state(_checkpointed(self), checkpoint.ProjectConfiguration(), directory,
                              parallelism=self.accelerator.state.parallelism_config)
        return None
    return wrapper


def skip_first_batches(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(dataloader: Any, num_batches: int = 0) -> Any:
        if isinstance(dataloader, PreparedDataLoader):
            return dataloader.skip_batches(num_batches) or dataloader
        return original(dataloader, num_batches)
    return wrapper
