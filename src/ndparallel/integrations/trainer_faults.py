"""The Hugging Face Trainer under ``ndparallel launch --fault-tolerant`` (replica groups: `ndparallel.fault_tolerance`).

A raw loop's live state is its prepared objects (model, optimizer, data position, RNG), which a healing replica group
takes from a healthy one at the step it joins. A Trainer keeps more that every step changes: its `TrainerState` (step
count, epoch, logs) and its LR scheduler (which it steps itself, not through ``prepare``); and its loop keeps where it
is in local variables (the epoch, the batch within it, the accumulation window) that no state can reach. So:

1. Every group sends its `TrainerState` and LR scheduler with the live state (`ReplicaGroups.register_state`).
2. A group that heals -- restarted by the launcher, it joins the running job at its first step -- loads them at that
   step's commit and steps with the others; that ``train()`` call then ends right after the step (`Rejoin`: nothing
   logged, saved or evaluated for it, no best model loaded). It trains on in a second ``train()`` call that resumes
   from that state as from a checkpoint whose weights, optimizer and data position are in place already
   (`resume_live`): the Trainer's own resume arithmetic puts its loop where the healthy groups are. That arithmetic
   must land on the data position the healthy group sent, which is checked at the step it healed in: where it would
   not, the group stops with an error instead of training on other batches than the run it joins.
3. Checkpoints (the Trainer's ``_save_checkpoint`` and ``save_model``) are written by one group, as ``save_state`` is
   (`ReplicaGroups.writes_checkpoints`); every rank of the other groups skips them alike.
4. Refused before anything trains (`check`): ``load_best_model_at_end`` (only the writing group would know the best
   checkpoint, so the groups would end with different weights).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile
from collections.abc import Callable
from types import ModuleType
from typing import Any

from transformers import TrainerCallback, TrainerState

from ..fault_tolerance.settings import REPLICAS_ENV
from .trainer_versions import HOOK_MARK, _bypassing_overrides, _parameters

TRAINER_STATE_FILE = "trainer_state.json"  # the name the Trainer resumes its TrainerState from (TRAINER_STATE_NAME)
LIVE_ATTR = "_ndparallel_live"  # a Trainer's `Rejoin`, while fault tolerance runs it


def asked() -> bool:
    """Whether this process runs as one replica group of ``ndparallel launch --fault-tolerant``."""
    return bool(os.environ.get(REPLICAS_ENV))


def check(trainer: Any, module: ModuleType) -> None:
    """Refuse, on every rank alike and before anything trains, what fault tolerance cannot run exactly: hooks of
    ``transformers.trainer`` (`module`) that do not fit or that the Trainer's class bypasses, and
    ``load_best_model_at_end``."""
    problems = []
    for name, expected in EXPECTED_PARAMETERS.items():
        found = getattr(getattr(module.Trainer, name, None), HOOK_MARK, None) == name
        if not found:
            problems.append(f"Trainer.{name} is not the one ndparallel installed (its parameters are not "
                            f"({', '.join(expected)}), or another library replaced it)")
    problems += [f"{where} overrides it without calling the Trainer's own"
                 for where in _bypassing_overrides(type(trainer), module.Trainer, EXPECTED_PARAMETERS)]
    if problems:
        raise RuntimeError("ndparallel launch --fault-tolerant cannot run this Trainer: " + "; ".join(problems)
                           + ". Launch without --fault-tolerant, or write the loop with ndparallel's Accelerator")
    if trainer.args.load_best_model_at_end:
        raise ValueError(
            "ndparallel launch --fault-tolerant: load_best_model_at_end=True is not supported -- one replica group "
            "writes the checkpoints, so only it would know the best one and the groups would end with different "
            "weights; set load_best_model_at_end=False (and load the best checkpoint after training), or launch "
            "without --fault-tolerant")


class Rejoin(TrainerCallback):
    """One Trainer's part of the live state, and the end of a ``train()`` call in which its group healed."""

    def __init__(self, trainer: Any, groups: Any) -> None:
        self.trainer = trainer
        self.groups = groups
        self.healed = False  # this group loaded the live state in the step under way
        self.live_position: dict[str, Any] | None = None  # the training data's position that came with it
        self.resume: tuple[str, dict[str, Any] | None] | None = None  # (TrainerState JSON, scheduler) after that step
        self.directory: str | None = None  # the second call's resume "checkpoint" (`resume_live`)
        self.scheduler: dict[str, Any] | None = None  # the LR schedule it resumes with (`_schedule`)
        groups.register_state("trainer", self._state, self._load)

    # ---- the live state --------------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        scheduler = self.trainer.lr_scheduler
        return {"state": _json(self.trainer.state),
                "scheduler": scheduler.state_dict() if scheduler is not None else None}

    def _load(self, value: dict[str, Any]) -> None:
        """At the commit of the step this group heals in (after the prepared objects were loaded): the healthy
        group's counters and LR schedule as they were when the step began; the Trainer steps both after it."""
        self.trainer.state = TrainerState(**json.loads(value["state"]))
        if value["scheduler"] is not None and self.trainer.lr_scheduler is not None:
            self.trainer.lr_scheduler.load_state_dict(value["scheduler"])
        taken = self.groups.positions_taken  # the training data loader's first: the Trainer prepares it first
        self.healed, self.live_position = True, taken[0] if taken else None

    # ---- the step it healed in ends this train() -------------------------------------------------------------------
    def on_step_end(self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kwargs: Any) -> Any:
        if not self.healed:
            return control
        self.healed = False
        epoch, position = _resume_point(args, state.global_step, train_dataloader)
        live = self.live_position
        if live is not None and (live["epoch"], live["position"]) != (epoch, position):
            raise RuntimeError(
                f"fault tolerance: replica group {self.groups.settings.replica_id} healed to global step "
                f"{state.global_step} with the live data position (epoch {live['epoch']}, {live['position']} "
                f"{live['unit']}), but the Trainer would resume at epoch {epoch}, {position} {live['unit']}: it "
                "cannot go on with the batches of the run it joins, so it stops. Launch without --fault-tolerant "
                "(restarts resume from the Trainer's checkpoints), and please report this with the Trainer's arguments")
        self.resume = (_json(state), self._schedule())
        state.best_model_checkpoint = None  # this call ends here: nothing to load at its end, nothing to rotate
        return _stop(control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        return _stop(control) if self.resume is not None else control

    def _schedule(self) -> dict[str, Any]:
        """The LR scheduler's state and what it set in the optimizer's parameter groups (their learning rates)."""
        scheduler = self.trainer.lr_scheduler
        groups = [{key: value for key, value in group.items() if key != "params"}
                  for group in self.trainer.optimizer.param_groups]
        return {"scheduler": scheduler.state_dict() if scheduler is not None else None, "param_groups": groups}

    # ---- the second train() call -----------------------------------------------------------------------------------
    def resuming(self, checkpoint: str | None) -> bool:
        """Whether `checkpoint` is the live resume of `resume_live` (nothing of it is read from disk but the counters)."""
        return checkpoint is not None and checkpoint == self.directory

    def load_scheduler(self) -> None:
        """The Trainer makes a new LR scheduler at every train(), which sets the optimizer's learning rates to its
        first step's: the live scheduler's state as it was after the step, and the learning rates it had set (as
        loading the optimizer's state does when the Trainer resumes from a checkpoint)."""
        if self.scheduler is None:
            return
        if self.scheduler["scheduler"] is not None and self.trainer.lr_scheduler is not None:
            self.trainer.lr_scheduler.load_state_dict(self.scheduler["scheduler"])
        for group, saved in zip(self.trainer.optimizer.param_groups, self.scheduler["param_groups"]):
            group.update(saved)


def _json(state: TrainerState) -> str:
    """`state` as the Trainer writes it to trainer_state.json (`TrainerState.save_to_json`)."""
    return json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"


def _stop(control: Any) -> Any:
    control.should_training_stop = True
    control.should_log = control.should_evaluate = control.should_save = False
    return control


def _steps_in_epoch(args: Any, loader: Any) -> int:
    """Batches per epoch as the Trainer counts them (`set_initial_training_values`): the loader's length, or, for data
    without one, max_steps x accumulation (one pass)."""
    try:
        return len(loader)
    except TypeError:
        return args.max_steps * args.gradient_accumulation_steps


def _updates_per_epoch(args: Any, loader: Any) -> int:
    """Optimizer steps per epoch as the Trainer counts them: a last, shorter accumulation window included."""
    batches, accumulation = _steps_in_epoch(args, loader), args.gradient_accumulation_steps
    return max(batches // accumulation + int(batches % accumulation > 0), 1)


def _resume_point(args: Any, global_step: int, loader: Any) -> tuple[int, int]:
    """Where the Trainer's resume arithmetic (`_init_training_state`) starts the data after `global_step` updates:
    epoch global_step // updates per epoch, then (global_step % updates per epoch) x accumulation batches skipped --
    in the loader's `state_dict` terms (epoch, position)."""
    epoch, updates = divmod(global_step, _updates_per_epoch(args, loader))
    return epoch, updates * args.gradient_accumulation_steps * loader.units_per_batch


class EpochOfTheHealedStep(TrainerCallback):
    """First of the callbacks: in the step a group heals in, the Trainer sets ``state.epoch`` from its own loop's
    place (the start of the data), not the live one; the run that did not fail would have had
    epoch + min(batches done in it, batches in it) / batches in it."""

    def __init__(self, rejoin: Rejoin) -> None:
        self.rejoin = rejoin

    def on_step_end(self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kwargs: Any) -> Any:
        if self.rejoin.healed and train_dataloader is not None:
            batches = _steps_in_epoch(args, train_dataloader)
            # the update just taken: its epoch, its index in it
            epoch, updates = divmod(state.global_step - 1, _updates_per_epoch(args, train_dataloader))
            state.epoch = epoch + min((updates + 1) * args.gradient_accumulation_steps, batches) / batches
        return control


def attach(trainer: Any) -> Rejoin:
    """The Trainer's `Rejoin`, made and registered once (every train() call of this Trainer uses it)."""
    live = getattr(trainer, LIVE_ATTR, None)
    if live is None:
        live = Rejoin(trainer, trainer.accelerator.replica_groups)
        trainer.callback_handler.callbacks.insert(0, EpochOfTheHealedStep(live))  # before the user's callbacks
        trainer.add_callback(live)  # after every other: it ends the call whatever they set
        setattr(trainer, LIVE_ATTR, live)
    return live


def live_of(trainer: Any) -> Rejoin | None:
    return getattr(trainer, LIVE_ATTR, None)


def resume_live(train: Callable[..., Any], trainer: Any, *args: Any) -> Any:
    """`train` (the Trainer's own, called with `args` after the checkpoint) once, and again from the live state each
    time this group healed in it (see the module docstring)."""
    live = attach(trainer)
    checkpoint, rest = args[0], args[1:]
    output = train(trainer, checkpoint, *rest)
    while live.resume is not None:
        state, live.scheduler = live.resume
        live.resume = None
        with tempfile.TemporaryDirectory(prefix="ndparallel-live-") as directory:
            with open(os.path.join(directory, TRAINER_STATE_FILE), "w") as f:
                f.write(state)
            live.directory = directory
            try:
                output = train(trainer, directory, *rest)
            finally:
                live.directory, live.scheduler = None, None
    return output


# ---- the Trainer's methods (installed by `integrations.trainer`, acting only under fault tolerance) -------------------
def train_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, resume_from_checkpoint: Any = None, trial: Any = None,
                ignore_keys_for_eval: Any = None) -> Any:
        if getattr(getattr(self, "accelerator", None), "replica_groups", None) is None:
            return original(self, resume_from_checkpoint, trial, ignore_keys_for_eval)
        return resume_live(original, self, resume_from_checkpoint, trial, ignore_keys_for_eval)
    return wrapper


def save_checkpoint_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, model: Any, trial: Any) -> None:
        groups = getattr(getattr(self, "accelerator", None), "replica_groups", None)
        if groups is not None and not groups.writes_checkpoints():
            return None  # another replica group writes it (the same state)
        return original(self, model, trial)
    return wrapper


HOOKS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "train": train_hook,
    "_save_checkpoint": save_checkpoint_hook,
}
EXPECTED_PARAMETERS: dict[str, tuple[str, ...]] = {  # in every transformers from 5.16 through 5.25
    "train": ("self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"),
    "_save_checkpoint": ("self", "model", "trial"),
}


def install(trainer: type) -> None:
    """Replace the Trainer's methods of `HOOKS` whose parameters are those written for (the others stay, and `check`
    refuses fault tolerance, naming them); they act only under fault tolerance."""
    for name, wrap in HOOKS.items():
        original = getattr(trainer, name, None)
        if original is not None and _parameters(original) == EXPECTED_PARAMETERS[name]:
            hook = wrap(original)
            setattr(hook, HOOK_MARK, name)
            setattr(trainer, name, hook)
