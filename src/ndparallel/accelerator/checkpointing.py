"""Checkpoints and saved files: Accelerate's `save_state` / `load_state` family over the Accelerator's record of
prepared objects (`ndparallel.checkpoint`; docs/checkpoints.md)."""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..distributed import agreement
from .. import checkpoint, parallel
from ..checkpoint import ProjectConfiguration
from ..training.prepared import PreparedObjects
from ..distributed.state import AcceleratorState


class CheckpointingMixin:
    """Part of `ndparallel.Accelerator`: checkpoints of what it prepared, Hugging Face exports, single files."""

    state: AcceleratorState
    prepared: PreparedObjects
    project_configuration: ProjectConfiguration
    gradient_accumulation_steps: int
    replica_groups: Any  # ndparallel.fault_tolerance.ReplicaGroups | None

    @property
    def project_dir(self) -> str | os.PathLike | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | os.PathLike | None:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        """The number the next automatically named checkpoint gets."""
        return self.project_configuration.iteration

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore `objects` (anything with ``state_dict`` / ``load_state_dict``) with the state."""
        bad = [i for i, o in enumerate(objects) if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))]
        if bad:
            raise ValueError("register_for_checkpointing takes objects with state_dict and load_state_dict methods; "
                             "these have not: " + ", ".join(f"Item at index {i} ({type(objects[i]).__name__})"
                                                             for i in bad))
        self.prepared.custom_objects.extend(objects)

    def save_state(self, output_dir: str | os.PathLike | None = None, *, async_save: bool = False,
                   **kwargs: Any) -> str:
        """Write a crash-safe, sharded checkpoint of everything prepared (and registered); return its directory.

        Without `output_dir`, ``ProjectConfiguration(automatic_checkpoint_naming=True)`` names it
        ``<project_dir>/checkpoints/checkpoint_<i>`` and keeps the newest ``total_limit``. Collective.

        ``async_save=True`` (ndparallel's): the state is copied to host memory and written in the background while
        training goes on; the next `save_state`, `load_state`, `wait_for_checkpoint` and `end_training` wait for it
        (and raise its error). Until it commits, the previous checkpoint stays the newest complete one.
        """
        self._ignored_kwargs("save_state", kwargs)
        self._check_same_directory("save_state", output_dir)
        groups = self.replica_groups
        if groups is not None and not groups.writes_checkpoints():  # fault tolerance: another group writes it
            return str(output_dir if output_dir is not None else self.project_configuration.checkpoints_dir)
        hooks = list(self._save_state_pre_hooks.values())
        models = list(self.prepared.models)

        def before_write(staging: Path) -> None:
            for hook in hooks:
                hook(models, [], str(staging))

        return str(checkpoint.save_state(self.prepared, self._run_settings(), self.project_configuration, output_dir,
                                         async_save=async_save, before_write=before_write if hooks else None))

    def register_save_state_pre_hook(self, hook: Callable[[list[nn.Module], list[Any], str], None]
                                     ) -> RemovableHandle:
        """Call ``hook(models, weights, output_dir)`` on every rank in each `save_state`, before the state is
        written; returns a handle whose ``remove()`` unregisters it.

        As Accelerate does under FSDP: ``weights`` is empty and every model is saved by `save_state` itself, so a
        hook saves *extra* files (a configuration, a model in its own format) into ``output_dir``, which is the
        checkpoint's staging directory: its files are checksummed and committed with the checkpoint."""
        handle = RemovableHandle(self._save_state_pre_hooks)
        self._save_state_pre_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[[list[nn.Module], str], None]) -> RemovableHandle:
        """Call ``hook(models, input_dir)`` on every rank in each `load_state`, once the checkpoint has verified and
        before anything is loaded; returns a handle whose ``remove()`` unregisters it. Every model is then loaded by
        `load_state` itself (as Accelerate does under FSDP)."""
        handle = RemovableHandle(self._load_state_pre_hooks)
        self._load_state_pre_hooks[handle.id] = hook
        return handle

    @functools.cached_property
    def _save_state_pre_hooks(self) -> OrderedDict[int, Callable[..., None]]:
        return OrderedDict()  # RemovableHandle holds a weak reference: a plain dict cannot have one

    @functools.cached_property
    def _load_state_pre_hooks(self) -> OrderedDict[int, Callable[..., None]]:
        return OrderedDict()

    def wait_for_checkpoint(self) -> str | None:
        """Wait until a ``save_state(async_save=True)`` under way has committed (raising its error if it failed);
        return its directory, or None when none was under way."""
        done = checkpoint.wait_for_saves()
        return None if done is None else str(done)

    def load_state(self, input_dir: str | os.PathLike | None = None, **kwargs: Any) -> str:
        """Restore a checkpoint written by `save_state` under this or any other layout (the newest complete one
        of the project without `input_dir`); return its directory. Collective."""
        self._ignored_kwargs("load_state", kwargs)
        self._check_same_directory("load_state", input_dir)
        hooks = list(self._load_state_pre_hooks.values())
        models = list(self.prepared.models)

        def before_load(directory: Path) -> None:
            for hook in hooks:
                hook(models, str(directory))

        return str(checkpoint.load_state(self.prepared, self.project_configuration, input_dir,
                                         before_load=before_load if hooks else None,
                                         parallelism=self.state.parallelism_config))

    def _check_same_directory(self, what: str, directory: str | os.PathLike | None) -> None:
        """Every rank here (a monitored barrier), with the same directory: a checkpoint is one directory that all
        ranks write into (rank 0 the files they share), so ranks given different paths (a temporary directory made
        on each) would write a checkpoint none of them could load. The same error on every rank otherwise."""
        path = None if directory is None else os.path.abspath(os.fspath(directory))
        key = "directory (a checkpoint is one directory that every rank writes into: pass the same path on every rank)"
        agreement.check_agreement({key: path}, what, timeout=self.state.runtime.timeout)

    def _run_settings(self) -> checkpoint.RunRecord:
        plugin = self.state.fsdp_plugin
        return checkpoint.RunRecord(self.state.parallelism_config, self.state.device.type,
                                      self.state.mixed_precision, self.gradient_accumulation_steps,
                                      plugin.state_dict_type.name if plugin is not None else checkpoint.SHARDED)

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True, *, merge_adapters: bool = False) -> str:
        """Write `model`'s full weights from any layout as a Hugging Face directory. Collective.

        A PEFT model is written as PEFT writes it: the adapter (``adapter_config.json`` and its weights, which
        ``PeftModel.from_pretrained`` loads); with ``merge_adapters=True`` (ndparallel's), the adapted transformers
        model with its LoRA merged in instead, which plain transformers loads (`ndparallel.checkpoint.adapters`)."""
        unwrapped = parallel.unwrap(model)
        if checkpoint.is_peft_model(unwrapped):
            agreement.monitored_barrier("save_model", self.state.runtime.timeout)
            checkpoint.save_adapter(model, unwrapped, save_directory, merge_adapters, safe_serialization)
            self.wait_for_everyone()
            return str(save_directory)
        if merge_adapters:
            raise ValueError("save_model(merge_adapters=True): the model is not a PEFT model; it has no adapters")
        return str(checkpoint.save_model(model, unwrapped, save_directory, max_shard_size, safe_serialization))

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict on the main process (an empty dict elsewhere when parameters are sharded)."""
        return checkpoint.get_state_dict(model, unwrap)

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Save `obj` to the file `f` from the main process only (``torch.save``, or a safetensors file of a dict of
        tensors with `safe_serialization`)."""
        if not self.state.is_main_process:
            return
        if safe_serialization:
            from safetensors.torch import save_file  # installed with transformers

            save_file({k: v.contiguous() for k, v in obj.items()}, str(f), metadata={"format": "pt"})
        else:
            torch.save(obj, f)

    @staticmethod
    def _ignored_kwargs(method: str, kwargs: dict[str, Any]) -> None:
        if kwargs:  # Accelerate's safe_serialization, load_kwargs...: ndparallel's format has no such choices
            warnings.warn(f"{method}: ignoring {sorted(kwargs)}", stacklevel=3)
