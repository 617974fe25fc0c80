"""What ``accelerate launch`` takes, for ``ndparallel launch``: its config file (written by ``accelerate config``) and
its flags, translated into ndparallel's launch settings and into the environment variables that ``accelerate
launch`` exports and the Accelerator reads (``ACCELERATE_USE_FSDP``, ``FSDP_*``, ``PARALLELISM_CONFIG_*``,
``ACCELERATE_DYNAMO_*``), so a script sees the same settings under either launcher.

Both arrive as one mapping in the file's shape (`from_flags` turns the flags into it; flags win over the file) and
`translate` checks it whole before any process starts:

- honoured: ``num_processes`` (over all machines), ``num_machines``, ``machine_rank``, ``main_process_ip`` /
  ``main_process_port``, ``rdzv_backend``, ``mixed_precision``, ``use_cpu``, ``gpu_ids``, ``distributed_type``
  NO / MULTI_CPU / MULTI_GPU / FSDP with ``fsdp_config``, ``parallelism_config``, ``num_cpu_threads_per_process``,
  compilation (``dynamo_config``: backend, mode, fullgraph, dynamic, regional compilation);
- refused, with what to use instead: DeepSpeed, Megatron-LM, TPU / XLA, SageMaker, other devices,
  ``--no_python``, keys Accelerate itself does not know;
- accepted without effect (they tune Accelerate's own launcher or TPU pods): ``same_network``,
  ``main_training_function``, ``downcast_bf16``, ``tpu_*``, ``commands``, ``command_file``, ``monitor_interval``...
  and the sections of an engine not chosen (``deepspeed_config`` when ``distributed_type`` is not DEEPSPEED), as
  Accelerate ignores them too. ``debug`` and ``enable_cpu_affinity`` are reported as ignored.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..configuration.environment import ACCELERATE_ENV_PREFIX
from ..configuration.parallelism import SIZE_FIELDS, ParallelismConfig
from ..configuration.plugins import FSDP_ENV_PREFIX, FullyShardedDataParallelPlugin, TorchDynamoPlugin

# ``accelerate config``'s keys (Accelerate's BaseConfig and ClusterConfig), as its YAML files hold them.
FILE_KEYS = frozenset({
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes",
    "machine_rank", "num_machines", "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend",
    "same_network", "main_training_function", "enable_cpu_affinity", "fp8_config", "deepspeed_config",
    "fsdp_config", "parallelism_config", "megatron_lm_config", "mpirun_config", "downcast_bf16", "tpu_name",
    "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env", "dynamo_config",
})
# Keys only the flags give (`from_flags`).
FLAG_KEYS = frozenset({"use_fsdp", "use_deepspeed", "use_megatron_lm", "tpu", "no_python",
                       "num_cpu_threads_per_process", "multi_gpu", "monitor_interval", "quiet"})
NO_EFFECT = frozenset({"same_network", "main_training_function", "downcast_bf16", "tpu_name", "tpu_zone",
                       "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env", "fp8_config",
                       "deepspeed_config", "megatron_lm_config", "multi_gpu", "monitor_interval", "quiet"})
RUNS = ("NO", "MULTI_CPU", "MULTI_GPU", "FSDP")  # distributed types ndparallel runs
REFUSED_TYPES = {
    "DEEPSPEED": "DeepSpeed is not used: ZeRO-3 is FSDP2 (dp_shard_size), Ulysses is sp_size",
    "MEGATRON_LM": "Megatron-LM is not used: tensor parallelism is tp_size, pipelines are pp_size",
    "XLA": "TPUs are not supported: ndparallel runs on CUDA GPUs and on CPUs",
}
# fsdp_config keys whose FSDP_* variable is not the key's own name (as `accelerate launch` exports them)
_FSDP_VARIABLES = {"fsdp_offload_params": "OFFLOAD_PARAMS",
                   "fsdp_transformer_layer_cls_to_wrap": "TRANSFORMER_CLS_TO_WRAP"}
FSDP_KEYS = frozenset({
    "fsdp_version", "fsdp_offload_params", "fsdp_min_num_params", "fsdp_sharding_strategy",
    "fsdp_reshard_after_forward", "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap",
    "fsdp_backward_prefetch", "fsdp_state_dict_type", "fsdp_forward_prefetch", "fsdp_use_orig_params",
    "fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states", "fsdp_activation_checkpointing",
    "fsdp_ignored_modules",
})
# parallelism_config keys beyond the sizes; the sequence-length ones tune DeepSpeed's Ulysses only
PARALLELISM_KEYS = frozenset({"cp_backend", "cp_comm_strategy", "sp_backend", "sp_seq_length",
                              "sp_seq_length_is_variable", "sp_attn_implementation"})
DEEPSPEED_ONLY = frozenset({"sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation"})
DEFAULT_PORT = 29500  # Accelerate's main_process_port when only main_process_ip is given


def is_accelerate_file(data: Mapping[str, Any]) -> bool:
    """Whether a config file's mapping was written by ``accelerate config`` (it always writes these keys)."""
    return "distributed_type" in data or "compute_environment" in data


@dataclass
class Translated:
    """Settings for `ndparallel.launch.launcher.plan_launch`: sizes, launch settings (its keys: ``num_processes``,
    ``nnodes``, ``node_rank``, ``rdzv_endpoint``, ``rdzv_backend``, ``mixed_precision``, ``cpu``), environment
    variables for the ranks, and warnings."""

    sizes: dict[str, int] = field(default_factory=dict)
    launch: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def _flag_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def _upper(value: Any) -> str:
    return str(getattr(value, "value", value)).upper()


def translate(settings: Mapping[str, Any], source: str) -> Translated:
    """Check Accelerate's settings (a config file's mapping, with flags merged in) and translate them."""
    out = Translated()
    unknown = sorted(set(settings) - FILE_KEYS - FLAG_KEYS)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown} (not keys of `accelerate config` files either)")
    given = {key: value for key, value in settings.items() if value is not None}

    # ---- what cannot run here ----
    if _upper(given.get("compute_environment", "LOCAL_MACHINE")) != "LOCAL_MACHINE":
        raise ValueError(f"{source}: compute_environment {given['compute_environment']!r} is not supported; "
                         "ndparallel launches on the machines it runs on (LOCAL_MACHINE)")
    for flag, kind in (("use_deepspeed", "DEEPSPEED"), ("use_megatron_lm", "MEGATRON_LM"), ("tpu", "XLA")):
        if given.get(flag):
            raise ValueError(f"{source}: --{flag} is not supported: {REFUSED_TYPES[kind]}")
    if given.get("no_python"):
        raise ValueError(f"{source}: --no_python is not supported: ndparallel launch runs Python scripts and modules")
    kind = _upper(given.get("distributed_type", "NO"))
    if given.get("use_fsdp"):
        kind = "FSDP"
    if kind in REFUSED_TYPES or kind == "TPU":
        reason = REFUSED_TYPES.get(kind, REFUSED_TYPES["XLA"])
        raise ValueError(f"{source}: distributed_type {kind} is not supported: {reason}")
    if kind not in RUNS:
        raise ValueError(f"{source}: distributed_type {kind} is not supported; ndparallel runs {list(RUNS)} "
                         "(CUDA GPUs and CPUs)")
    precision = given.get("mixed_precision")
    if precision is False:  # YAML 1.1 reads an unquoted `no` as false
        precision = "no"
    _translate_dynamo(dict(given.get("dynamo_config") or {}), source, out)
    if given.get("mpirun_config"):
        raise ValueError(f"{source}: mpirun_config is not supported: ndparallel starts its ranks with torchrun")

    # ---- processes, machines, rendezvous ----
    launch = out.launch
    for key, ours in (("num_processes", "num_processes"), ("num_machines", "nnodes"), ("machine_rank", "node_rank")):
        if key in given and not (key == "num_processes" and given[key] == -1):  # -1: Accelerate's "unset"
            launch[ours] = given[key]
    if precision is not None:
        launch["mixed_precision"] = str(precision).lower()
    if given.get("use_cpu") or kind == "MULTI_CPU":
        launch["cpu"] = True
    if "main_process_ip" in given:
        launch["rdzv_endpoint"] = f"{given['main_process_ip']}:{given.get('main_process_port') or DEFAULT_PORT}"
    elif "main_process_port" in given and int(launch.get("nnodes", 1)) == 1:
        launch["rdzv_endpoint"] = f"127.0.0.1:{given['main_process_port']}"
    if "rdzv_backend" in given:
        backend = str(given["rdzv_backend"])
        if backend not in ("static", "c10d"):
            raise ValueError(f"{source}: rdzv_backend {backend!r} is not supported; use static or c10d")
        launch["rdzv_backend"] = backend
    gpu_ids = given.get("gpu_ids")
    if gpu_ids is not None and str(gpu_ids).lower() != "all":
        out.env["CUDA_VISIBLE_DEVICES"] = _flag_value(gpu_ids)
    if "num_cpu_threads_per_process" in given:
        out.env["OMP_NUM_THREADS"] = str(given["num_cpu_threads_per_process"])
    for key in ("debug", "enable_cpu_affinity"):
        if given.get(key):
            out.warnings.append(f"{source}: {key} is ignored by ndparallel launch")

    _translate_fsdp(given, kind, source, out)
    _translate_parallelism(given, source, out)
    return out


DYNAMO_KEYS = {"dynamo_backend": "BACKEND", "dynamo_mode": "MODE", "dynamo_use_fullgraph": "USE_FULLGRAPH",
               "dynamo_use_dynamic": "USE_DYNAMIC", "dynamo_use_regional_compilation": "USE_REGIONAL_COMPILATION"}


def _translate_dynamo(dynamo: dict[str, Any], source: str, out: Translated) -> None:
    """``dynamo_config`` into the ``ACCELERATE_DYNAMO_*`` variables `TorchDynamoPlugin`'s settings come from;
    checked here (an unknown backend is refused before any process starts)."""
    unknown = sorted(set(dynamo) - set(DYNAMO_KEYS))
    if unknown:
        raise ValueError(f"{source}: unknown dynamo_config key(s) {unknown}; valid keys: {sorted(DYNAMO_KEYS)}")
    if _upper(dynamo.get("dynamo_backend", "NO")) == "NO":
        return
    try:
        TorchDynamoPlugin(backend=dynamo["dynamo_backend"], mode=dynamo.get("dynamo_mode"),
                          fullgraph=dynamo.get("dynamo_use_fullgraph"),
                          use_regional_compilation=dynamo.get("dynamo_use_regional_compilation"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: dynamo_config: {exc}") from None
    for key, suffix in DYNAMO_KEYS.items():
        if dynamo.get(key) is not None:
            out.env[f"ACCELERATE_DYNAMO_{suffix}"] = str(dynamo[key])


def _translate_fsdp(given: Mapping[str, Any], kind: str, source: str, out: Translated) -> None:
    fsdp = dict(given.get("fsdp_config") or {})
    unknown = sorted(set(fsdp) - FSDP_KEYS)
    if unknown:
        raise ValueError(f"{source}: unknown fsdp_config key(s) {unknown}; valid keys: {sorted(FSDP_KEYS)}")
    if kind != "FSDP":
        if fsdp:
            out.warnings.append(f"{source}: fsdp_config is ignored because distributed_type is {kind}, not FSDP "
                                "(as accelerate launch does)")
        return
    env = {"ACCELERATE_USE_FSDP": "true"}
    for key, value in fsdp.items():
        if value is not None:
            env[FSDP_ENV_PREFIX + _FSDP_VARIABLES.get(key, key.removeprefix("fsdp_").upper())] = _flag_value(value)
    with warnings.catch_warnings(record=True) as caught:  # the plugin the ranks will build: checked here, once
        warnings.simplefilter("always")
        try:
            FullyShardedDataParallelPlugin.from_env(None, env)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: fsdp_config: {exc}") from None
    out.warnings.extend(f"{source}: fsdp_config: {w.message}" for w in caught)
    out.env.update(env)


def _translate_parallelism(given: Mapping[str, Any], source: str, out: Translated) -> None:
    section = dict(given.get("parallelism_config") or {})
    prefix = "parallelism_config_"
    names = {key: key.removeprefix(prefix) for key in section}
    valid = {prefix + name for name in (*SIZE_FIELDS, *PARALLELISM_KEYS)}
    unknown = sorted(key for key in section if key not in valid)
    if unknown:
        raise ValueError(f"{source}: unknown parallelism_config key(s) {unknown}; valid keys: {sorted(valid)}")
    env = {}
    for key, value in section.items():
        name = names[key]
        if value is None:
            continue
        if name in SIZE_FIELDS:
            out.sizes[name] = value
        elif name in DEEPSPEED_ONLY:
            if value not in (False, "False", "false", ""):
                out.warnings.append(f"{source}: parallelism_config.{key} tunes DeepSpeed's sequence parallelism and "
                                    "is ignored (ndparallel's sp takes any length divisible by sp_size)")
        else:
            env[ACCELERATE_ENV_PREFIX + name.upper()] = _flag_value(value)
    try:  # what the ranks will build, checked here with every size explicit (none read from this shell)
        ParallelismConfig.from_env(ParallelismConfig(**{name: out.sizes.get(name, 1) for name in SIZE_FIELDS}), env)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: parallelism_config: {exc}") from None
    out.env.update(env)


# ---- flags -----------------------------------------------------------------------------------------------------------
# Flags of `accelerate launch` that ndparallel's own flags do not already spell (those are aliases in
# `ndparallel.launch.cli`): key -> (argparse keyword arguments, help). Each is accepted as --a_b and --a-b.
FLAGS: dict[str, dict[str, Any]] = {
    "num_processes": dict(type=int, help="total processes over all nodes (accelerate launch's; --nproc-per-node is "
                                         "per node)"),
    "main_process_ip": dict(help="address of node 0 (with --main-process-port: --rdzv-endpoint IP:PORT)"),
    "main_process_port": dict(type=int, help="port on node 0 (default 29500)"),
    "gpu_ids": dict(help="GPUs to use on this node, e.g. 0,1 (sets CUDA_VISIBLE_DEVICES)"),
    "num_cpu_threads_per_process": dict(type=int, help="OMP_NUM_THREADS of every rank"),
    "use_fsdp": dict(action="store_true", help="FSDP2 (with the --fsdp-* settings below)"),
    **{key: dict(help=f"FSDP plugin field {key.removeprefix('fsdp_')}") for key in sorted(FSDP_KEYS)},
    **{f"parallelism_config_{key}": dict(help=f"ParallelismConfig {key}") for key in sorted(PARALLELISM_KEYS)},
    "dynamo_backend": dict(help="torch.compile backend (e.g. inductor; 'no': no compilation)"),
    "use_deepspeed": dict(action="store_true", help="refused: DeepSpeed is not used"),
    "use_megatron_lm": dict(action="store_true", help="refused: Megatron-LM is not used"),
    "tpu": dict(action="store_true", help="refused: no TPUs"),
    "no_python": dict(action="store_true", help="refused: scripts run with Python"),
    "multi_gpu": dict(action="store_true", help="no effect (the layout follows the process count)"),
    "same_network": dict(action="store_true", help="no effect"),
    "main_training_function": dict(help="no effect"),
    "monitor_interval": dict(type=float, help="no effect"),
    "debug": dict(action="store_true", help="no effect"),
    "quiet": dict(action="store_true", help="no effect"),
}
DEST_PREFIX = "accelerate_"


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add `FLAGS` to ``ndparallel launch``'s parser, in their own help group."""
    group = parser.add_argument_group("accelerate launch's flags (also as --a_b)")
    for key, options in FLAGS.items():
        options = dict(options)
        if options.get("action") != "store_true":
            options.setdefault("metavar", {int: "N", float: "SECONDS"}.get(options.get("type"), "VALUE"))
        group.add_argument(f"--{key.replace('_', '-')}", f"--{key}", dest=DEST_PREFIX + key, default=None,
                           **options)


def from_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The flags of `FLAGS` that were given, as a mapping in the config file's shape."""
    out: dict[str, Any] = {}
    for key in FLAGS:
        value = getattr(args, DEST_PREFIX + key, None)
        if value is None:
            continue
        if key in FSDP_KEYS:
            out.setdefault("fsdp_config", {})[key] = value
        elif key.startswith("parallelism_config_"):
            out.setdefault("parallelism_config", {})[key] = value
        elif key == "dynamo_backend":
            out["dynamo_config"] = {"dynamo_backend": value}
        else:
            out[key] = value
    return out


def merge(file: Mapping[str, Any], flags: Mapping[str, Any]) -> dict[str, Any]:
    """`file` with `flags` on top; the ``fsdp_config`` / ``parallelism_config`` / ``dynamo_config`` sections are
    merged key by key."""
    out = dict(file)
    for key, value in flags.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def to_file(config: ParallelismConfig | None, launch: Mapping[str, Any]) -> dict[str, Any]:
    """The mapping of an ``accelerate config`` file for `config` (None: no sizes) and ``ndparallel config``'s launch
    settings (``nproc_per_node``, ``nnodes``, ``mixed_precision``, ``cpu``); `translate` reads it back to the same.

    ``distributed_type`` is FSDP when the layout shards parameters (as ndparallel lays it out), else MULTI_CPU /
    MULTI_GPU (NO for one process). Accelerate files hold no accumulation steps: a value other than 1 is refused.
    """
    from ..parallel.data_parallel import uses_fsdp

    if launch.get("gradient_accumulation_steps", 1) != 1:
        raise ValueError("an accelerate config file holds no gradient_accumulation_steps: pass it to "
                         "Accelerator(gradient_accumulation_steps=...), or write ndparallel's format")
    world = launch["nproc_per_node"] * launch["nnodes"]
    cpu = bool(launch.get("cpu"))
    fsdp = config is not None and uses_fsdp(config, None)
    kind = "FSDP" if fsdp else "NO" if world == 1 else "MULTI_CPU" if cpu else "MULTI_GPU"
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": kind,
        "mixed_precision": launch.get("mixed_precision", "no"), "use_cpu": cpu, "num_machines": launch["nnodes"],
        "num_processes": world, "machine_rank": 0, "rdzv_backend": "static", "same_network": True,
        "main_training_function": "main",
    }
    if fsdp:
        out["fsdp_config"] = {"fsdp_version": 2}
    if config is not None:
        # Accelerate's ParallelismConfig has no pipeline axis nor expert parallelism: pp_size and ep_size are written
        # only where they are used
        out["parallelism_config"] = {f"parallelism_config_{name}": getattr(config, name) for name in SIZE_FIELDS
                                     if name not in ("pp_size", "ep_size") or getattr(config, name) != 1}
    return out
