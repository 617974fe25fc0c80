"""Axolotl (``ndparallel launch ... -m axolotl.cli.train config.yml``) on ndparallel's N-D layouts, the config as
Axolotl users write it.

Axolotl turns its N-D keys (``dp_shard_size``, ``dp_replicate_size``, ``tensor_parallel_size``,
``context_parallel_size``) into Accelerate's ``PARALLELISM_CONFIG_*`` variables and trains with the Hugging Face
Trainer, whose Accelerator is ndparallel's here (`ndparallel.integrations.trainer`). What this module adds is the way
in: the few places where Axolotl's own code assumes stock Accelerate on CUDA. It attaches under ``ndparallel launch``
as Axolotl's modules are imported (`ndparallel.launch.worker.attach_integrations`) and takes over a run of more than
one process, all of it decided from the config on every rank before any collective (`take_over`):

1. **Sizes.** Axolotl's keys are resolved by Axolotl's own rule (``_get_parallel_config_kwargs``: an unset
   ``dp_shard_size`` under ``fsdp_config`` takes the ranks left over) and passed on as the launch's sizes
   (``NDPARALLEL_<FIELD>_SIZE``), which the Trainer integration and `ndparallel.ParallelismConfig` read; sizes given
   to ``ndparallel launch`` as well must agree with them. A config with no N-D key trains as plain data parallelism
   (``dp_replicate_size`` = the processes), as Axolotl's DDP would.
2. **The device mesh** Axolotl builds (``build_parallelism_config``, for loading a model with ``tp_plan="auto"``
   and for its distributed optimizers) is ndparallel's config's mesh on the run's device, not CUDA's; and the
   ``device_map`` Axolotl sets for more than one process (``{"": LOCAL_RANK}``, a CUDA index) is the CPU on a CPU run.
3. **Context parallelism** is ndparallel's (SDPA or eager attention; packed rows kept apart by ``position_ids``),
   not Axolotl's ring-flash-attention: ``context_parallel_size`` is held out of Axolotl's validation, which requires
   ring-flash-attention for it, and Axolotl's ring-attention context manager and its no-op for the Trainer's
   context-parallel inputs (``patch_prepare_cp``) are not used.
4. **Saving.** Axolotl saves an FSDP run through ``accelerator.state.fsdp_plugin`` and ``trainer.save_model`` (the
   Trainer integration exposes the plugin and gathers on every rank), and any other run with ``save_pretrained`` on
   local rank 0 only -- a collective the other ranks never join when the model is sharded. Here every rank saves
   through ``trainer.save_model``, which writes what ``save_pretrained`` writes (the adapter alone for a PEFT model).

What cannot be kept exactly is refused by key (`refusals`): DeepSpeed, FSDP1, a sharded final save, QAT, ReLoRA,
LLM Compressor, fp8, Axolotl's expert parallelism, Ray, its ring-attention options, and context parallelism with
flash attention or RL trainers. The Axolotl functions replaced are checked against the parameters they were written
for (`EXPECTED`, read in Axolotl 0.19.0); one that differs is refused by name when a run would be taken over.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..configuration.environment import size_env_var
from ..launch.worker import INTEGRATION_HOOKS, after_import
from ..configuration.parallelism import SIZE_FIELDS, ParallelismConfig
from .trainer_versions import _parameters  # a callable's parameter names (a class's: its constructor's)

TESTED_AXOLOTL = "0.19.0"
LAUNCHED_ENV = "NDPARALLEL_LAUNCHER_PID"  # = ndparallel.launch.worker.LAUNCHER_PID_ENV: set under ndparallel launch
CP_KEYS = ("context_parallel_size", "sequence_parallel_degree")  # the second: Axolotl's deprecated spelling
SIZE_KEYS = {"dp_replicate_size": "dp_replicate_size", "dp_shard_size": "dp_shard_size",
             "tensor_parallel_size": "tp_size", "context_parallel_size": "cp_size"}  # Axolotl's key -> ndparallel's

# The Axolotl functions replaced, by module, with the parameters each was written for (Axolotl 0.19.0).
EXPECTED: dict[str, dict[str, tuple[str, ...]]] = {
    "axolotl.utils.config": {"validate_config": ("cfg", "capabilities", "env_capabilities"),
                             "normalize_config": ("cfg",)},
    "axolotl.utils.distributed": {"build_parallelism_config": ("cfg",),
                                  "_get_parallel_config_kwargs": (
                                      "world_size", "tensor_parallel_size", "context_parallel_size", "dp_shard_size",
                                      "dp_replicate_size", "is_fsdp", "expert_parallel_size")},
    "axolotl.monkeypatch.accelerate.parallelism_config": {"patch_prepare_cp": ()},
    "axolotl.train": {"save_trained_model": ("cfg", "trainer", "model"),
                      "SequenceParallelContextManager": ("models", "context_parallel_size",
                                                         "gradient_accumulation_steps", "ring_attn_func",
                                                         "heads_k_stride", "gather_outputs", "device_mesh")},
}
# Modules that import a replaced function by name (``from axolotl.utils.distributed import build_parallelism_config``)
COPIES: dict[str, tuple[str, ...]] = {
    "axolotl.cli.config": ("validate_config", "normalize_config"),
    "axolotl.loaders.model": ("build_parallelism_config",),
    "axolotl.core.builders.base": ("build_parallelism_config",),
}

_INSTALLED = "_ndparallel_axolotl"
_STATE: dict[str, Any] = {}  # "sizes": the run's sizes once taken over; "mesh": (config, mesh) built for Axolotl


# ---- when, and with what ------------------------------------------------------------------------------------------
def launched() -> bool:
    """Whether this process runs under ``ndparallel launch`` (the launcher's pid is in the environment)."""
    return bool(os.environ.get(LAUNCHED_ENV))


def taken_over() -> bool:
    return "sizes" in _STATE


def _size(cfg: Any, key: str) -> int | None:
    value = cfg.get(key)
    return int(value) if value is not None else None


def resolved_sizes(cfg: Any, world_size: int) -> dict[str, int]:
    """ndparallel's sizes for Axolotl's `cfg` on `world_size` processes: Axolotl's own resolution of its N-D keys
    (``_get_parallel_config_kwargs``, which raises on sizes that do not fill the world), or plain data parallelism
    over every process when the config has none of them."""
    from axolotl.utils import distributed

    kwargs = distributed._get_parallel_config_kwargs(
        world_size, _size(cfg, "tensor_parallel_size") or 1, _size(cfg, "context_parallel_size") or 1,
        _size(cfg, "dp_shard_size"), _size(cfg, "dp_replicate_size"), bool(cfg.get("fsdp") or cfg.get("fsdp_config")),
        _size(cfg, "expert_parallel_size"))
    sizes = {field: 1 for field in SIZE_FIELDS}
    sizes.update({name: int(size) for name, size in kwargs.items() if name in sizes})
    if all(size == 1 for size in sizes.values()):
        sizes["dp_replicate_size"] = world_size
    return sizes


def _attention(cfg: Any) -> str | None:
    """The attention implementation Axolotl's config asks for (its ``attn_implementation``, or the older flags)."""
    if cfg.get("attn_implementation"):
        return str(cfg.get("attn_implementation"))
    for flag, name in (("flash_attention", "flash_attention_2"), ("flex_attention", "flex_attention"),
                       ("sdp_attention", "sdpa"), ("eager_attention", "eager")):
        if cfg.get(flag):
            return name
    return None


def refusals(cfg: Any, cp_size: int) -> list[str]:
    """What of Axolotl's `cfg` ndparallel cannot honour, each naming the key and what to do instead."""
    out = []

    def refuse(key: str, why: str) -> None:
        out.append(f"`{key}`: {why}")

    if cfg.get("deepspeed"):
        refuse("deepspeed", "ndparallel shards with FSDP2 (`fsdp_config` with `fsdp_version: 2` and dp_shard_size), "
                            "which shards parameters, gradients and optimizer states as ZeRO-3 does; drop it")
    fsdp = cfg.get("fsdp_config")
    version = cfg.get("fsdp_version") or (fsdp or {}).get("fsdp_version") or 1  # Axolotl's default: FSDP1
    if (fsdp or cfg.get("fsdp")) and str(version) != "2":
        refuse("fsdp_version", "ndparallel shards with FSDP2: set `fsdp_version: 2`")
    if fsdp:
        final = fsdp.get("final_state_dict_type") or fsdp.get("state_dict_type")
        if final and "SHARDED" in str(final).upper():
            refuse("fsdp_config.final_state_dict_type", "ndparallel writes the trained model as full weights "
                   "(what transformers and PEFT load), and its checkpoints are sharded already; Axolotl would "
                   "then look for Accelerate's sharded files to merge: set `final_state_dict_type: FULL_STATE_DICT`")
    for key, why in (("qat", "quantization-aware training converts the model at save, which ndparallel's sharded "
                             "model does not go through"),
                     ("relora", "ReLoRA merges and saves adapters on one rank during training"),
                     ("llmcompressor", "LLM Compressor saves the compressed model on its own"),
                     ("fp8", "Axolotl's fp8 replaces the Trainer's Accelerator with Accelerate's"),
                     ("use_ray", "Ray starts its own workers; launch with ndparallel launch instead")):
        if cfg.get(key):
            refuse(key, why + "; not supported under ndparallel")
    if (_size(cfg, "expert_parallel_size") or 1) > 1:
        refuse("expert_parallel_size", "Axolotl's expert parallelism is a plugin of its own over Accelerate's mesh; "
                                       "not supported under ndparallel")
    if cp_size > 1:
        attention = _attention(cfg)
        if attention not in (None, "sdpa", "eager"):
            refuse("attn_implementation", f"context parallelism here is ndparallel's, which runs SDPA or eager "
                   f"attention (packed rows kept apart by position_ids), not {attention}: set `attn_implementation: "
                   "sdpa` (or `sdp_attention: true`)")
        for key in ("ring_attn_func", "heads_k_stride"):
            if cfg.get(key) is not None:
                refuse(key, "an option of Axolotl's ring-flash-attention, which ndparallel's context parallelism "
                            "replaces: drop it")
        if cfg.get("rl"):
            refuse("rl", "Axolotl's RL trainers run their own sequence-parallel steps under context_parallel_size")
    return out


def take_over(cfg: Any, cp_size: int) -> None:
    """Decide, on every rank alike and before any collective, whether ndparallel runs Axolotl's `cfg` (more than one
    process under ``ndparallel launch``), refuse what it cannot honour, and pass on the sizes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not launched() or world <= 1:
        return
    for name in EXPECTED:  # all of them now (Axolotl imports some later), so that each is checked before anything
        importlib.import_module(name)
    problems = refusals(cfg, cp_size) + [f"Axolotl's {name} " + what for name, what in api_problems()]
    if problems:
        raise ValueError("this Axolotl config cannot run under ndparallel launch as it is: " + "; ".join(problems))
    sizes = resolved_sizes(cfg, world)
    given = {name: int(value) for name in SIZE_FIELDS
             if (value := os.environ.get(size_env_var(name), "").strip()).lstrip("-").isdigit()}
    differ = [f"{name}={given[name]} (launch) vs {sizes[name]} (config)" for name in given
              if given[name] != sizes[name]]
    if differ:
        keys = ", ".join(f"{key}" for key in SIZE_KEYS)
        raise ValueError(f"ndparallel launch was given other sizes than the Axolotl config resolves to on {world} "
                         f"processes: {', '.join(differ)}. Give the sizes in one place: the config's {keys} (the "
                         "launch then needs none), or the same ones to both")
    for name, size in sizes.items():
        os.environ[size_env_var(name)] = str(size)
    _STATE["sizes"] = sizes
    for name in INTEGRATION_HOOKS:  # the Trainer's integration (and the guard), as the launch now has sizes
        after_import(name, "ndparallel.integrations:on_import")


# ---- Axolotl's API, as these replacements were written for -------------------------------------------------------
def api_problems() -> list[tuple[str, str]]:
    """(name, what differs) for each replaced Axolotl function that is gone or takes other parameters."""
    problems = []
    for module_name, functions in EXPECTED.items():
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name, expected in functions.items():
            found = getattr(module, name, None)
            found = getattr(found, "__wrapped__", found)
            if found is None:
                problems.append((f"{module_name}.{name}", "is gone"))
            elif _parameters(found) != expected:
                problems.append((f"{module_name}.{name}", f"takes ({', '.join(_parameters(found) or ('?',))}), where "
                                 f"ndparallel's integration was written for ({', '.join(expected)}) (Axolotl "
                                 f"{TESTED_AXOLOTL})"))
    return problems


# ---- the replacements ---------------------------------------------------------------------------------------------
def validate_config(original: Callable[..., Any]) -> Callable[..., Any]:
    """Axolotl's validation with ``context_parallel_size`` held out (its validator asks ring-flash-attention for it,
    which ndparallel's context parallelism replaces), then `take_over`."""
    @functools.wraps(original)
    def wrapper(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        if not launched() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return original(cfg, *args, **kwargs)
        held = {key: cfg.pop(key) for key in CP_KEYS if key in cfg}
        try:
            validated = original(cfg, *args, **kwargs)
        finally:
            cfg.update(held)
        cp_size = int(held.get("context_parallel_size") or held.get("sequence_parallel_degree") or 1)
        validated["context_parallel_size"] = cp_size
        take_over(validated, cp_size)
        return validated
    return wrapper


def normalize_config(original: Callable[..., Any]) -> Callable[..., Any]:
    """Axolotl's normalisation, then a ``device_map`` on the CPU for a CPU run (Axolotl's ``{"": LOCAL_RANK}`` is a
    CUDA index)."""
    @functools.wraps(original)
    def wrapper(cfg: Any) -> Any:
        out = original(cfg)
        if taken_over() and str(cfg.get("device") or "").startswith("cpu") and cfg.get("device_map") is not None:
            cfg.device_map = {"": "cpu"}
        return out
    return wrapper


def build_parallelism_config(original: Callable[..., Any]) -> Callable[..., Any]:
    """ndparallel's config of the run's sizes and its device mesh on the run's device (built once per process);
    (None, None) when every size is 1, as Axolotl's."""
    @functools.wraps(original)
    def wrapper(cfg: Any) -> tuple[Any, Any]:
        if not taken_over():
            return original(cfg)
        if "mesh" not in _STATE:
            from ..distributed.runtime import init_runtime

            device = init_runtime().device  # ndparallel's process group, as the Accelerator starts it
            config = ParallelismConfig(**_STATE["sizes"])
            _STATE["mesh"] = (config, config.get_device_mesh(device.type)) if config.total_size > 1 else (None, None)
        return _STATE["mesh"]
    return wrapper


def patch_prepare_cp(original: Callable[..., Any]) -> Callable[..., Any]:
    """Axolotl's ``patch_prepare_cp`` empties the Trainer's ``_prepare_context_parallel_inputs`` (its ring attention
    shards the inputs itself); ndparallel's context parallelism shards them there, so it is not applied."""
    @functools.wraps(original)
    def wrapper() -> None:
        if not taken_over():
            return original()
        return None
    return wrapper


def sequence_parallel_context(original: type) -> Callable[..., Any]:
    """Axolotl's ring-attention context manager (``SequenceParallelContextManager``) is not entered: the Trainer's
    context parallelism is ndparallel's."""
    @functools.wraps(original, updated=())
    def replacement(*args: Any, **kwargs: Any) -> Any:
        if not taken_over():
            return original(*args, **kwargs)
        return contextlib.nullcontext()
    return replacement


def save_trained_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """Axolotl's final save. With an ``fsdp_config`` its own route (the FSDP plugin, then ``trainer.save_model`` on
    every rank); otherwise every rank saves through ``trainer.save_model`` (gathered, written by the main process)
    instead of ``save_pretrained`` on local rank 0 alone, which under a sharded model would wait for the others."""
    @functools.wraps(original)
    def wrapper(cfg: Any, trainer: Any, model: Any) -> Any:
        if not taken_over() or cfg.get("fsdp_config") or cfg.get("fsdp"):
            return original(cfg, trainer, model)
        for name, module in model.named_modules():  # Axolotl's post-training module hooks, as its own save runs them
            if hasattr(module, "_post_training"):
                module._post_training(model, name)
        trainer.save_model(cfg.output_dir)
        return None
    return wrapper


REPLACEMENTS: dict[str, dict[str, Callable[..., Any]]] = {
    "axolotl.utils.config": {"validate_config": validate_config, "normalize_config": normalize_config},
    "axolotl.utils.distributed": {"build_parallelism_config": build_parallelism_config},
    "axolotl.monkeypatch.accelerate.parallelism_config": {"patch_prepare_cp": patch_prepare_cp},
    "axolotl.train": {"save_trained_model": save_trained_model,
                      "SequenceParallelContextManager": sequence_parallel_context},
}


def install(module: ModuleType) -> None:
    """Replace what `module` (one of `MODULES`, just imported) holds of Axolotl's functions above; a module that
    imported one by name gets the replacement too. Each is replaced once; the replacements leave a run that is not
    taken over (one process, or not under ndparallel launch) to Axolotl's own."""
    for name, wrap in REPLACEMENTS.get(module.__name__, {}).items():
        current = getattr(module, name, None)
        if current is not None and not getattr(current, _INSTALLED, False):
            replacement = wrap(current)
            setattr(replacement, _INSTALLED, True)
            setattr(module, name, replacement)
    for name in COPIES.get(module.__name__, ()):
        current = getattr(module, name, None)
        source = next((m for m, names in REPLACEMENTS.items() if name in names), None)
        replaced = getattr(sys.modules.get(source or ""), name, None)
        if current is not None and replaced is not None and getattr(replaced, "__wrapped__", None) is current:
            setattr(module, name, replaced)
