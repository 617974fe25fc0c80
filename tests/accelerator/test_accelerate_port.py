"""Issue 25, no processes: the settings objects behave as Accelerate's, so its tests pass with only their imports
changed (the measurement is docs/accelerate_compatibility.md; these are our own tests of the same behaviours).

- `ParallelismConfig()` reads the launcher's variables in its constructor; `build_device_mesh` goes through torch's
  `init_device_mesh`; ``cp_comm_strategy`` comes from ``PARALLELISM_CONFIG_CP_COMM_STRATEGY`` unchanged;
- `FullyShardedDataParallelPlugin()` reads ``FSDP_*`` in its constructor and holds torch's types (enums, offload and
  mixed-precision policies); `set_auto_wrap_policy` makes torch's wrap-policy callables;
- a prepared LR scheduler steps once per data-parallel rank and optimizer step (`AcceleratedScheduler`);
- Accelerate's module path ``ndparallel.accelerator`` has its names.
The multi-process behaviours are in test_accelerate_port_ranks.py.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp.fully_sharded_data_parallel import (
    FullStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

from ndparallel.distributed.layout import AXES
from ndparallel.configuration.parallelism import ParallelismConfig
from ndparallel.configuration.handlers import TorchContextParallelConfig
from ndparallel.training.loss import GradientState
from ndparallel.training.optim import AcceleratedOptimizer, AcceleratedScheduler
from ndparallel.parallel.blocks import modules_to_wrap
from ndparallel.configuration.plugins import DataLoaderConfiguration, FullyShardedDataParallelPlugin
from ndparallel.distributed.runtime import resolve_group

SIZES = ("DP_REPLICATE_SIZE", "DP_SHARD_SIZE", "TP_SIZE", "CP_SIZE", "SP_SIZE", "PP_SIZE")


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variable of this shell leaks into a test; returns monkeypatch to set some."""
    import os

    for name in list(os.environ):
        if name.startswith(("FSDP_", "PARALLELISM_CONFIG_", "NDPARALLEL_")):
            monkeypatch.delenv(name)
    return monkeypatch


# ---- module paths -----------------------------------------------------------------------------------------------------
def test_accelerator_module_has_accelerates_names():
    from ndparallel.accelerator import DataLoaderConfiguration as FromAccelerator
    from ndparallel.accelerator import GradientAccumulationPlugin
    from ndparallel.utils import GradientAccumulationPlugin as FromUtils

    assert FromAccelerator is DataLoaderConfiguration and GradientAccumulationPlugin is FromUtils


# ---- ParallelismConfig --------------------------------------------------------------------------------------------
def test_parallelism_config_constructor_reads_accelerates_variables(clean_env):
    clean_env.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "4")
    clean_env.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    config = ParallelismConfig()
    assert (config.dp_shard_size, config.tp_size, config.dp_replicate_size, config.cp_size) == (4, 2, 1, 1)
    assert ParallelismConfig(tp_size=1).tp_size == 1  # an explicit size wins
    clean_env.setenv("NDPARALLEL_TP_SIZE", "8")  # ndparallel's own launcher variable comes first
    assert ParallelismConfig().tp_size == 8
    # An explicit mapping instead of the environment: unset fields are read from it alone.
    assert ParallelismConfig.from_env(ParallelismConfig(), environ={}).sizes() == dict.fromkeys(AXES, 1)
    assert ParallelismConfig.from_env(environ={"PARALLELISM_CONFIG_CP_SIZE": "2"}).cp_size == 2


def test_cp_comm_strategy_from_the_environment_is_kept(clean_env):
    for strategy in ("alltoall", "allgather", "ring"):
        clean_env.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", strategy)
        assert ParallelismConfig(cp_size=2).cp_handler.cp_comm_strategy == strategy
        assert TorchContextParallelConfig().cp_comm_strategy == strategy
    clean_env.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "pairwise")
    with pytest.raises(ValueError, match=r"Invalid cp_comm_strategy: pairwise \(from \$PARALLELISM_CONFIG_CP_COMM_"
                                         r"STRATEGY\)\. Must be one of \['allgather', 'ring', 'alltoall'\]"):
        ParallelismConfig(cp_size=2)
    # given explicitly, the variable is not read
    assert ParallelismConfig(cp_handler=TorchContextParallelConfig("ring")).cp_handler.cp_comm_strategy == "ring"


class _RecordingMesh:
    """Stands in for torch's DeviceMesh: records which dimensions are flattened under which name."""

    def __init__(self, flattened: list) -> None:
        self.flattened = flattened

    def __getitem__(self, dims):
        mesh = self

        class _Sub:
            def _flatten(self, name):
                mesh.flattened.append((list(dims), name))

        return _Sub()


@pytest.mark.parametrize("sizes, names, shape, flattened", [
    (dict(dp_replicate_size=2, dp_shard_size=2, cp_size=2, tp_size=2),
     ("dp_replicate", "dp_shard", "cp", "tp"), (2, 2, 2, 2),
     [(["dp_replicate", "dp_shard"], "dp"), (["dp_shard", "cp"], "dp_shard_cp"),
      (["dp_replicate", "dp_shard", "cp"], "dp_cp")]),
    (dict(tp_size=4), ("tp",), (4,), []),
    (dict(dp_replicate_size=8), ("dp_replicate",), (8,), [(["dp_replicate"], "dp"), (["dp_replicate"], "dp_cp")]),
])
def test_build_device_mesh_goes_through_init_device_mesh(clean_env, sizes, names, shape, flattened):
    """No process group is needed here: torch's init_device_mesh (looked up when called) builds the mesh, and
    exactly Accelerate's three views are flattened."""
    calls, done = [], []

    def fake_init(device_type, mesh_shape, mesh_dim_names):
        calls.append((device_type, tuple(mesh_shape), tuple(mesh_dim_names)))
        return _RecordingMesh(done)

    clean_env.setattr("torch.distributed.device_mesh.init_device_mesh", fake_init)
    mesh = ParallelismConfig(**sizes).build_device_mesh("cpu")
    assert calls == [("cpu", shape, names)]
    assert mesh.flattened == flattened
    assert ParallelismConfig().build_device_mesh("cpu") is None  # nothing enabled: no mesh, as Accelerate
    with pytest.raises(ValueError, match=r"build_device_mesh: a size is -1 \(dp_shard\(-1\)\); resolve it"):
        ParallelismConfig(dp_shard_size=-1).build_device_mesh("cpu")


# ---- FullyShardedDataParallelPlugin -------------------------------------------------------------------------------
def test_fsdp_plugin_constructor_reads_fsdp_variables(clean_env):
    for name, value in {"FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true", "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
                        "FSDP_RESHARD_AFTER_FORWARD": "false", "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP",
                        "FSDP_MIN_NUM_PARAMS": "100", "FSDP_IGNORED_MODULES": r"head$",
                        "FSDP_CPU_RAM_EFFICIENT_LOADING": "True", "FSDP_ACTIVATION_CHECKPOINTING": "true",
                        "FSDP_SHARDING_STRATEGY": "2"}.items():
        clean_env.setenv(name, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # what accelerate launch exports is not warned about
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.cpu_offload == CPUOffloadPolicy() and plugin.offloads_to_cpu
    assert plugin.state_dict_type == StateDictType.FULL_STATE_DICT
    assert plugin.state_dict_config == FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    assert (plugin.reshard_after_forward, plugin.auto_wrap_policy, plugin.min_num_params) == (False, "size_based_wrap",
                                                                                               100)
    assert (plugin.ignored_modules, plugin.cpu_ram_efficient_loading, plugin.activation_checkpointing) == (
        r"head$", True, True)
    assert plugin.sharding_strategy == ShardingStrategy.SHARD_GRAD_OP  # kept, as torch's enum (FSDP1's: unused)
    explicit = FullyShardedDataParallelPlugin(cpu_offload=False, state_dict_type="SHARDED_STATE_DICT")
    assert explicit.cpu_offload == OffloadPolicy() and not explicit.offloads_to_cpu  # arguments win
    assert explicit.state_dict_config == ShardedStateDictConfig()
    # from_env reads the mapping given, not this environment
    assert FullyShardedDataParallelPlugin.from_env(environ={}).cpu_offload == OffloadPolicy()
    clean_env.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match=r"fsdp_version=1 is not supported: ndparallel uses FSDP2"):
        FullyShardedDataParallelPlugin()


def test_fsdp_plugin_enums_and_fsdp1_fields(clean_env):
    plugin = FullyShardedDataParallelPlugin(state_dict_type=StateDictType.FULL_STATE_DICT)
    plugin.set_state_dict_type("SHARDED_STATE_DICT")  # train sharded, save the last one full -- or the reverse
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert plugin.state_dict_config == ShardedStateDictConfig()
    assert FullyShardedDataParallelPlugin(state_dict_type="1").state_dict_type == StateDictType.FULL_STATE_DICT
    with pytest.raises(ValueError, match=r"state_dict_type='LOCAL_STATE_DICT' is not one of \['SHARDED_STATE_DICT', "
                                         r"'FULL_STATE_DICT'\] \(FSDP2 has no LOCAL_STATE_DICT\)"):
        FullyShardedDataParallelPlugin(state_dict_type=StateDictType.LOCAL_STATE_DICT)
    for given in (ShardingStrategy.HYBRID_SHARD, "hybrid_shard", 4, "4"):
        with pytest.warns(UserWarning, match=r"sharding_strategy mean\(s\) nothing for FSDP2 and are ignored"):
            assert FullyShardedDataParallelPlugin(sharding_strategy=given).sharding_strategy == \
                ShardingStrategy.HYBRID_SHARD
    with pytest.raises(ValueError, match=r"sharding_strategy='HALF_SHARD' is not one of \['FULL_SHARD'"):
        FullyShardedDataParallelPlugin(sharding_strategy="HALF_SHARD")
    clean_env.setenv("FSDP_BACKWARD_PREFETCH", "BACKWARD_PRE")
    with pytest.warns(UserWarning, match=r"backward_prefetch mean\(s\) nothing for FSDP2"):
        assert FullyShardedDataParallelPlugin().backward_prefetch is None  # dropped, as Accelerate under FSDP2


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32),
                                         ("fp8", torch.bfloat16), (torch.float16, torch.float16)])
def test_plugin_mixed_precision_names_mean_what_they_mean_in_accelerate(name, dtype):
    assert FullyShardedDataParallelPlugin(mixed_precision_policy=name).mixed_precision_policy == \
        MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)  # Accelerate 1.16: outputs not cast


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)


class Net(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2)


def test_set_auto_wrap_policy_makes_torchs_callables(clean_env):
    model = Net()
    plugin = FullyShardedDataParallelPlugin()  # default: one unit per block, from the model's _no_split_modules
    plugin.set_auto_wrap_policy(model)
    assert isinstance(plugin.auto_wrap_policy, functools.partial)
    assert plugin.auto_wrap_policy.func is transformer_auto_wrap_policy
    assert plugin.auto_wrap_policy.keywords == {"transformer_layer_cls": {Block}}
    # prepare wraps by the callable exactly what it wraps by the name
    assert modules_to_wrap(model, plugin.auto_wrap_policy, []) == modules_to_wrap(model, "transformer_based_wrap",
                                                                                  [Block]) == list(model.blocks)
    sized = FullyShardedDataParallelPlugin(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=100)
    sized.set_auto_wrap_policy(model)
    assert sized.auto_wrap_policy.func is size_based_auto_wrap_policy
    assert sized.auto_wrap_policy.keywords == {"min_num_params": 100}
    for kwargs in (dict(auto_wrap_policy="NO_WRAP"), dict(auto_wrap_policy="size_based_wrap", min_num_params=0)):
        plugin = FullyShardedDataParallelPlugin(**kwargs)
        plugin.set_auto_wrap_policy(model)
        assert plugin.auto_wrap_policy is None
    missing = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap="T5Layer")
    with pytest.raises(ValueError, match=r"Could not find the transformer layer class T5Layer in the model\. Its "
                                         r"module classes are: \['Block', 'Linear', 'ModuleList', 'Net'\]"):
        missing.set_auto_wrap_policy(model)


def test_dispatch_batches_is_accepted():
    assert DataLoaderConfiguration(dispatch_batches=True).dispatch_batches is True


# ---- the LR scheduler ---------------------------------------------------------------------------------------------
def _scheduled(steps_per_update: int, syncs: list[bool], adjust: bool = True, onecycle: bool = False):
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = (torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=3) if onecycle
                 else torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s))
    state = GradientState(accumulation_steps=1, loss_world_size=1)
    wrapped = AcceleratedScheduler(scheduler, [AcceleratedOptimizer(optimizer, state)], state,
                                   steps_per_update=steps_per_update, adjust_scheduler=adjust)
    lrs = []
    for sync in syncs:
        state.sync_gradients = sync
        wrapped.optimizers[0].step()
        wrapped.step()
        lrs.append(wrapped.get_last_lr()[0])
    return lrs, scheduler._step_count


def test_scheduler_steps_once_per_data_parallel_rank_and_optimizer_step():
    """As Accelerate's: D ranks each took a loader batch, so a schedule counted in loader batches moves D steps."""
    assert _scheduled(2, [True, True]) == ([0.25, 0.0625], 5)
    # accumulation micro-steps leave the rate; torch's step count moves (adjust_scheduler), or not
    assert _scheduled(2, [False, True]) == ([1.0, 0.25], 4)
    assert _scheduled(2, [False, True], adjust=False) == ([1.0, 0.25], 3)
    lrs, count = _scheduled(4, [True, True], onecycle=True)  # OneCycleLR is never stepped past its last step
    assert count == 4 and len(lrs) == 2


def test_a_process_group_pickled_elsewhere_is_refused_clearly():
    with pytest.raises(RuntimeError, match=r"process group 'no-such-group' does not exist in this process: a prepared "
                                           r"object that holds a process group can only be unpickled where"):
        resolve_group("no-such-group")
    assert resolve_group(None) is None


def test_singletons_called_without_arguments_need_an_accelerator():
    from ndparallel.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    for cls in (AcceleratorState, GradientState):
        with pytest.raises(RuntimeError, match=rf"{cls.__name__}\(\) with no arguments is the state of this "
                                               r"process's Accelerator, and none exists: create the Accelerator first"):
            cls()
    with pytest.raises(TypeError, match=r"AcceleratorState\(\.\.\.\) is made by the Accelerator; call "
                                        r"AcceleratorState\(\) with no arguments for the current one"):
        AcceleratorState(mixed_precision="bf16")

