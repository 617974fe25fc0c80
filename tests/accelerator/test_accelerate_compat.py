"""Accelerate's own behaviours, checked against ndparallel (issue 13: a script ported by changing ``accelerate`` to
``ndparallel`` on its import lines must run).

The cases follow Accelerate's tests -- the ParallelismConfig tests of its ``tests/test_dataclasses.py``, the FSDP2
plugin class of ``tests/fsdp/test_fsdp.py``, and its torchrun scripts ``test_sync.py`` and
``test_distributed_data_loop.py`` -- written anew for ndparallel. Where ndparallel differs on purpose the test asserts
ndparallel's behaviour, and the README's "Differences from Accelerate" says why: FSDP2 is the default version, and the
default wrap policy shards each transformer block. (More of the same behaviours, issue 25: test_accelerate_port.py.)
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, StateDictType
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.data import DataLoader, TensorDataset

from harness import run_ranks
from ndparallel.parallelism_config import ParallelismConfig
from ndparallel.utils import FullyShardedDataParallelPlugin, TorchContextParallelConfig


# ---- module paths: `accelerate` -> `ndparallel` on the import lines is the whole port -------------------------------
def test_accelerate_module_paths_and_names():
    import ndparallel
    import ndparallel.accelerator
    import ndparallel.state
    import ndparallel.utils

    assert ndparallel.accelerator.Accelerator is ndparallel.Accelerator
    assert ndparallel.parallelism_config.ParallelismConfig is ndparallel.ParallelismConfig
    for name in ("PartialState", "AcceleratorState", "GradientState", "DistributedType"):
        assert hasattr(ndparallel.state, name), name
    for name in ("FullyShardedDataParallelPlugin", "TorchTensorParallelConfig", "TorchContextParallelConfig",
                 "ProjectConfiguration", "DataLoaderConfiguration", "GradientAccumulationPlugin",
                 "InitProcessGroupKwargs", "DistributedDataParallelKwargs", "GradScalerKwargs", "AutocastKwargs",
                 "KwargsHandler", "DistributedType", "LoggerType", "GeneralTracker", "set_seed", "gather",
                 "gather_object", "reduce", "broadcast", "broadcast_object_list", "pad_across_processes",
                 "send_to_device"):
        assert hasattr(ndparallel.utils, name), name
    for name in ("Accelerator", "PartialState", "ParallelismConfig", "DataLoaderConfiguration", "DistributedType",
                 "DistributedDataParallelKwargs", "FullyShardedDataParallelPlugin", "GradScalerKwargs",
                 "InitProcessGroupKwargs", "AutocastKwargs"):
        assert hasattr(ndparallel, name), name
    members = {m.name for m in ndparallel.DistributedType}
    assert {"NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU",
            "DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM", "MULTI_HPU", "MULTI_NEURON"} <= members


# ---- ParallelismConfig (Accelerate's tests/test_dataclasses.py) --------------------------------------------------------
MESH_CASES = [  # sizes (dp_replicate, dp_shard, tp, cp), Accelerate's expected mesh shape and dimension names
    ((8, 1, 1, 1), (8,), ("dp_replicate",)),
    ((1, 8, 1, 1), (8,), ("dp_shard",)),
    ((2, 4, 1, 1), (2, 4), ("dp_replicate", "dp_shard")),
    ((1, 4, 2, 1), (4, 2), ("dp_shard", "tp")),
    ((2, 2, 2, 1), (2, 2, 2), ("dp_replicate", "dp_shard", "tp")),
    ((1, 1, 8, 1), (8,), ("tp",)),
    ((1, 1, 1, 4), (4,), ("cp",)),
    ((1, 4, 1, 2), (4, 2), ("dp_shard", "cp")),
    ((1, 2, 2, 2), (2, 2, 2), ("dp_shard", "cp", "tp")),
    ((2, 2, 2, 2), (2, 2, 2, 2), ("dp_replicate", "dp_shard", "cp", "tp")),
]


def _config(sizes: tuple[int, int, int, int]) -> ParallelismConfig:
    r, s, t, c = sizes
    return ParallelismConfig(dp_replicate_size=r, dp_shard_size=s, tp_size=t, cp_size=c)


@pytest.mark.parametrize("sizes,shape,names", MESH_CASES)
def test_get_mesh(sizes, shape, names):
    assert _config(sizes)._get_mesh() == (names, shape)


@pytest.mark.parametrize("sizes,shape,names", MESH_CASES)
def test_build_device_mesh_has_accelerates_flattened_names(sizes, shape, names):
    """The world mesh over the enabled dimensions, with Accelerate's ``dp``, ``dp_shard_cp`` and ``dp_cp`` reachable
    by name wherever their dimensions are enabled (on a fake process group of the right size)."""
    config = _config(sizes)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
    try:
        mesh = config.build_device_mesh("cpu")
        assert tuple(mesh.shape) == shape and mesh.mesh_dim_names == names
        with warnings.catch_warnings():  # torch deprecates slicing flattened dims from the root: it still works
            warnings.simplefilter("ignore")
            for flat, dims in (("dp", config.dp_dim_names), ("dp_shard_cp", config.dp_shard_cp_dim_names),
                               ("dp_cp", config.dp_cp_dim_names)):
                if dims:
                    assert mesh[flat].size() == math.prod(getattr(config, f"{d}_size") for d in dims), flat
        with pytest.raises(ValueError, match=r"get_device_mesh\(\) needs a device_type"):
            config.get_device_mesh()
        assert config.get_device_mesh("cpu") is config.get_device_mesh()  # built once, then kept
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sizes", [c[0] for c in MESH_CASES])
def test_from_env_reads_accelerates_variables(sizes, monkeypatch):
    r, s, t, c = sizes
    env = {"PARALLELISM_CONFIG_DP_REPLICATE_SIZE": str(r), "PARALLELISM_CONFIG_DP_SHARD_SIZE": str(s),
           "PARALLELISM_CONFIG_TP_SIZE": str(t), "PARALLELISM_CONFIG_CP_SIZE": str(c)}
    config = ParallelismConfig.from_env(environ=env)
    assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size, config.cp_size) == sizes
    for name, value in env.items():  # as Accelerate's, the constructor reads them too (issue 25)
        monkeypatch.setenv(name, value)
    config = ParallelismConfig()
    assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size, config.cp_size) == sizes
    # ndparallel's own variables come first
    ours = ParallelismConfig.from_env(environ={**env, "NDPARALLEL_TP_SIZE": "16"})
    assert ours.tp_size == 16


def test_cp_handler_strategies_and_environment():
    for setting in ("allgather", "alltoall"):
        pc = ParallelismConfig(cp_size=2, cp_handler=TorchContextParallelConfig(cp_comm_strategy=setting))
        assert pc.cp_handler.cp_comm_strategy == setting
        pc = ParallelismConfig.from_env(ParallelismConfig(cp_size=2),
                                        environ={"PARALLELISM_CONFIG_CP_COMM_STRATEGY": setting})
        assert pc.cp_handler.cp_comm_strategy == setting
        with pytest.MonkeyPatch.context() as mp:  # the constructor reads it too, as Accelerate's (issue 25)
            mp.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", setting)
            assert ParallelismConfig(cp_size=2).cp_handler.cp_comm_strategy == setting
    for setting in ("invalid", "unsupported"):
        with pytest.raises(ValueError, match=f"Invalid cp_comm_strategy: {setting}"):
            TorchContextParallelConfig(cp_comm_strategy=setting)
        with pytest.raises(ValueError, match=f"Invalid cp_comm_strategy: {setting}"):
            ParallelismConfig.from_env(ParallelismConfig(cp_size=2),
                                       environ={"PARALLELISM_CONFIG_CP_COMM_STRATEGY": setting})


def test_dimension_names():
    pc = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, cp_size=2, tp_size=2)
    assert pc.dp_dim_names == ["dp_replicate", "dp_shard"]
    assert pc.non_dp_dim_names == ["tp", "cp"]
    assert pc.dp_shard_cp_dim_names == ["dp_shard", "cp"]
    assert pc.dp_cp_dim_names == ["dp_replicate", "dp_shard", "cp"]
    assert pc.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]
    assert ParallelismConfig(tp_size=2).fsdp_dim_names == ["dp_shard_cp"]
    assert (pc.cp_backend, pc.sp_backend) == ("torch", "ndparallel")


def test_sp_backend_deepspeed_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match=r"sp_size=2 with sp_backend='deepspeed': ndparallel runs Ulysses sequence "
                                         r"parallelism itself, without DeepSpeed; drop sp_backend and sp_handler"):
        ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    with pytest.raises(ValueError, match=r"and an sp_handler"):
        ParallelismConfig(sp_size=2, sp_handler=object())
    assert ParallelismConfig(sp_backend="deepspeed").sp_size == 1  # harmless without sp
    # accelerate launch exports its default backend even for runs without sp
    assert ParallelismConfig.from_env(environ={"PARALLELISM_CONFIG_SP_BACKEND": "deepspeed"}).sp_backend == "ndparallel"
    with pytest.raises(ValueError, match=r"cp_backend must be one of \['torch'\]"):
        ParallelismConfig(cp_backend="te")


# ---- FullyShardedDataParallelPlugin (Accelerate's tests/fsdp/test_fsdp.py, FSDP2 class) ------------------------------
FSDP2_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}


def _from_env(**env: str) -> FullyShardedDataParallelPlugin:
    return FullyShardedDataParallelPlugin.from_env(environ={**FSDP2_ENV, **env})


@pytest.mark.parametrize("value", [True, False])
def test_reshard_after_forward(value):
    assert _from_env(FSDP_RESHARD_AFTER_FORWARD=str(value).lower()).reshard_after_forward is value
    assert FullyShardedDataParallelPlugin(reshard_after_forward=value).reshard_after_forward is value
    assert FullyShardedDataParallelPlugin(reshard_after_forward=str(value)).reshard_after_forward is value
    assert _from_env().sharding_strategy is None


@pytest.mark.parametrize("prefetch", ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"])
def test_backward_prefetch_is_ignored_with_a_warning(prefetch):
    if prefetch == "NO_PREFETCH":
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _from_env(FSDP_BACKWARD_PREFETCH=prefetch)
    else:
        with pytest.warns(UserWarning, match=r"backward_prefetch mean\(s\) nothing for FSDP2 and are ignored"):
            _from_env(FSDP_BACKWARD_PREFETCH=prefetch)
        with pytest.warns(UserWarning, match=r"backward_prefetch"):
            FullyShardedDataParallelPlugin(backward_prefetch=prefetch)


@pytest.mark.parametrize("name", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_state_dict_type(name):
    assert _from_env(FSDP_STATE_DICT_TYPE=name).state_dict_type == StateDictType[name]
    assert FullyShardedDataParallelPlugin(state_dict_type=StateDictType[name]).state_dict_type == StateDictType[name]
    with pytest.raises(ValueError, match=r"state_dict_type='LOCAL_STATE_DICT' is not one of"):
        _from_env(FSDP_STATE_DICT_TYPE="LOCAL_STATE_DICT")
    plugin = FullyShardedDataParallelPlugin(state_dict_type="FULL_STATE_DICT")
    plugin.set_state_dict_type("SHARDED_STATE_DICT")  # train sharded, save the last one full -- or the reverse
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT


def test_auto_wrap_policy_from_env_and_arguments():
    plugin = _from_env(FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP", FSDP_TRANSFORMER_CLS_TO_WRAP="LlamaDecoderLayer")
    assert (plugin.auto_wrap_policy, plugin.transformer_cls_names_to_wrap) == ("transformer_based_wrap",
                                                                               ["LlamaDecoderLayer"])
    plugin = _from_env(FSDP_AUTO_WRAP_POLICY="SIZE_BASED_WRAP", FSDP_MIN_NUM_PARAMS="2000")
    assert (plugin.auto_wrap_policy, plugin.min_num_params) == ("size_based_wrap", 2000)
    assert _from_env(FSDP_AUTO_WRAP_POLICY="NO_WRAP").auto_wrap_policy == "no_wrap"
    # Accelerate: a size-based policy with min_num_params 0 wraps nothing
    assert _from_env(FSDP_AUTO_WRAP_POLICY="SIZE_BASED_WRAP", FSDP_MIN_NUM_PARAMS="0").auto_wrap_policy == "no_wrap"
    assert FullyShardedDataParallelPlugin(auto_wrap_policy="SIZE_BASED_WRAP",
                                          min_num_params=0).auto_wrap_policy == "no_wrap"
    # Deliberately different: FSDP2 and one unit per transformer block are the defaults
    assert (_from_env().auto_wrap_policy, FullyShardedDataParallelPlugin().fsdp_version) == ("transformer_based_wrap", 2)


@pytest.mark.parametrize("flag", [True, False])
def test_cpu_offload(flag):
    policy = CPUOffloadPolicy() if flag else OffloadPolicy()  # OffloadPolicy() means "no offload"
    assert _from_env(FSDP_OFFLOAD_PARAMS=str(flag).lower()).cpu_offload == policy
    assert FullyShardedDataParallelPlugin(cpu_offload=flag).cpu_offload == policy
    assert FullyShardedDataParallelPlugin(cpu_offload=policy).offloads_to_cpu is flag


@pytest.mark.parametrize("flag", ["True", "False"])
def test_cpu_ram_efficient_loading_and_ignored_modules(flag):
    assert _from_env(FSDP_CPU_RAM_EFFICIENT_LOADING=flag).cpu_ram_efficient_loading is (flag == "True")
    assert _from_env(FSDP_IGNORED_MODULES=r".*\.q_proj$").ignored_modules == r".*\.q_proj$"


def test_mixed_precision_policy_from_names_and_dicts():
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        # As Accelerate 1.16: a name computes and reduces in that dtype; outputs are not cast (1.15 cast them too)
        assert FullyShardedDataParallelPlugin(mixed_precision_policy=name).mixed_precision_policy == \
            MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        policy = {"param_dtype": dtype, "reduce_dtype": dtype, "output_dtype": dtype}
        assert FullyShardedDataParallelPlugin(mixed_precision_policy=policy).mixed_precision_policy == \
            MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, output_dtype=dtype)


def test_fsdp1_fields_are_accepted_and_ignored_once():
    with pytest.warns(UserWarning) as record:
        plugin = FullyShardedDataParallelPlugin(sharding_strategy="FULL_SHARD", use_orig_params=True,
                                                sync_module_states=True, limit_all_gathers=True,
                                                forward_prefetch=False)
    messages = [str(w.message) for w in record if "mean(s) nothing for FSDP2" in str(w.message)]
    assert len(messages) == 1 and all(f in messages[0] for f in ("sharding_strategy", "use_orig_params",
                                                                  "sync_module_states", "limit_all_gathers"))
    assert plugin.fsdp_version == 2
    with pytest.raises(ValueError, match=r"fsdp_version=1 is not supported"):
        FullyShardedDataParallelPlugin.from_env(environ={"FSDP_VERSION": "1"})


# ---- the Accelerator in forked ranks (Accelerate's torchrun scripts) -------------------------------------------------
def _default_layout_and_env() -> dict:
    from ndparallel import Accelerator, ParallelismConfig

    out = {}
    acc = Accelerator(parallelism_config=ParallelismConfig())  # all ones: DDP over every process, as Accelerate
    out["all_ones"] = (acc.parallelism_config.dp_replicate_size, acc.distributed_type.value)
    acc.end_training()
    return out


def test_a_config_of_all_ones_runs_data_parallel_over_every_process():
    assert run_ranks(_default_layout_and_env, 2) == [{"all_ones": (2, "MULTI_CPU")}] * 2


def _accelerate_launch_environment() -> dict:
    from ndparallel import Accelerator

    acc = Accelerator()  # settings from what `accelerate launch --config_file` exports
    model = acc.prepare(torch.nn.Linear(4, 4))
    return {"sizes": (acc.parallelism_config.dp_shard_size, acc.dp_shard_size), "mp": acc.mixed_precision,
            "accum": acc.gradient_accumulation_steps, "fsdp": acc.is_fsdp2, "wrap": acc.fsdp_plugin.auto_wrap_policy,
            "reshard": acc.fsdp_plugin.reshard_after_forward, "type": type(model).__name__}


def test_accelerate_launch_variables_are_read():
    env = {"PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "ACCELERATE_MIXED_PRECISION": "bf16",
           "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
           "FSDP_AUTO_WRAP_POLICY": "NO_WRAP", "FSDP_RESHARD_AFTER_FORWARD": "false"}
    for res in run_ranks(_accelerate_launch_environment, 2, env=env):
        assert res == {"sizes": (2, 2), "mp": "bf16", "accum": 4, "fsdp": True, "wrap": "no_wrap",
                       "reshard": False, "type": "FSDPLinear"}


def _fsdp_without_a_layout() -> list:
    from ndparallel import Accelerator, FullyShardedDataParallelPlugin

    out = []
    for make in (lambda: Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin()), Accelerator):
        acc = make()
        model = acc.prepare(torch.nn.Linear(4, 4))
        out.append((acc.parallelism_config.dp_replicate_size, acc.parallelism_config.dp_shard_size,
                    tuple(model.weight.to_local().shape)))
    return out


def test_an_fsdp_plugin_without_a_layout_shards_over_every_process():
    """As Accelerate: FSDP with no ParallelismConfig shards over all processes (the plugin given, or
    ``accelerate launch``'s ACCELERATE_USE_FSDP), rather than replicating."""
    for res in run_ranks(_fsdp_without_a_layout, 2, env={"ACCELERATE_USE_FSDP": "true"}):
        assert res == [(1, 2, (2, 4))] * 2


def _process_surface() -> dict:
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.utils import DistributedDataParallelKwargs, GradScalerKwargs

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=2),
                      kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True),
                                       GradScalerKwargs(init_scale=1024.0)], mixed_precision="fp16")
    out: dict = {}
    model = acc.prepare(torch.nn.Linear(2, 2))
    out["ddp_find_unused"] = model.find_unused_parameters
    out["scale"] = acc.scaler.get_scale()
    out["state"] = (acc.state.num_processes, acc.state.distributed_type.value, acc.state.mixed_precision,
                    acc.state.device_mesh is acc.torch_device_mesh)
    out["ranks"] = (acc.data_parallel_rank, acc.data_parallel_shard_rank, acc.tensor_parallel_rank,
                    acc.context_parallel_rank)
    out["again"] = acc.prepare(model) is model  # an already prepared object comes back as it is
    with acc.split_between_processes(["a", "b", "c"]) as part:
        out["split"] = part
    with acc.split_between_processes(["a", "b", "c"], apply_padding=True) as part:
        out["split_padded"] = part
    with acc.split_between_processes({"x": torch.arange(4)}) as part:
        out["split_dict"] = part["x"].tolist()
    t = torch.arange(acc.process_index + 1)
    out["padded"] = acc.pad_across_processes(t, pad_index=-1).tolist()
    out["padded_first"] = acc.pad_across_processes(t, pad_first=True).tolist()

    @acc.on_main_process
    def main_only():
        return "ran"

    @acc.on_process(process_index=1)
    def second_only():
        return "ran"

    out["decorated"] = (main_only(), second_only())
    if acc.process_index == 1:
        acc.set_trigger()
    out["trigger"] = (acc.check_trigger(), acc.check_trigger())  # seen by everyone once, then cleared
    from ndparallel.utils import broadcast_object_list, gather, gather_object, reduce

    out["utils"] = (gather(torch.tensor([acc.process_index])).tolist(), gather_object([acc.process_index]),
                    reduce(torch.tensor(float(acc.process_index))).item(),
                    broadcast_object_list([acc.process_index], from_process=1))
    acc.end_training()
    return out


def test_process_surface_and_helpers():
    results = run_ranks(_process_surface, 2)
    for rank, res in enumerate(results):
        assert res["ddp_find_unused"] is True and res["scale"] == 1024.0
        assert res["state"] == (2, "MULTI_CPU", "fp16", True)
        assert res["ranks"] == (rank, 0, 0, 0) and res["again"]
        assert res["decorated"] == (("ran", None) if rank == 0 else (None, "ran"))
        assert res["trigger"] == (True, False)
        assert res["padded"] == ([0, -1] if rank == 0 else [0, 1])
        assert res["padded_first"] == ([0, 0] if rank == 0 else [0, 1])
        assert res["utils"] == ([0, 1], [0, 1], 0.5, [1])
    assert [r["split"] for r in results] == [["a", "b"], ["c"]]
    assert [r["split_padded"] for r in results] == [["a", "b"], ["c", "c"]]
    assert [r["split_dict"] for r in results] == [[0, 1], [2, 3]]


def _prepared_again() -> list[bool]:
    from ndparallel import Accelerator, FullyShardedDataParallelPlugin

    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(list(range(8)), batch_size=2)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    scheduler = acc.prepare(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
    again = acc.prepare(model, optimizer, loader, scheduler)
    same = [a is b for a, b in zip(again, (model, optimizer, loader, scheduler))]
    counts = [len(acc.prepared.models), len(acc.prepared.optimizers), len(acc.prepared.dataloaders),
              len(acc.prepared.schedulers)]
    acc.end_training()
    return same + [counts == [1, 1, 1, 1]]


def test_prepared_objects_prepared_again_come_back_as_they_are():
    assert run_ranks(_prepared_again, 2) == [[True] * 5] * 2


def _batch_sizes(even_batches: bool, size: int, batch: int, split: bool = False) -> dict:
    from ndparallel import Accelerator, DataLoaderConfiguration

    acc = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=even_batches, split_batches=split))
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(size)), batch_size=batch))
    sizes = [len(b[0]) for b in loader]
    acc.end_training()
    return {"sizes": sizes, "len": len(loader)}


@pytest.mark.slow
@pytest.mark.parametrize("even,size,batch,expected", [
    (True, 3, 1, ([1, 1], [1, 1])),  # Accelerate's test_default_ensures_even_batch_sizes
    (True, 7, 2, ([2, 2], [2, 2])),
    (False, 3, 1, ([1, 1], [1])),  # test_can_disable_even_batches
    (False, 7, 2, ([2, 2], [2, 1])),
])
def test_even_batches(even, size, batch, expected):
    results = run_ranks(_batch_sizes, 2, even, size, batch)
    assert tuple(r["sizes"] for r in results) == expected
    assert tuple(r["len"] for r in results) == tuple(len(e) for e in expected)


def test_split_batches_gives_each_rank_its_share_of_the_loaders_batch():
    results = run_ranks(_batch_sizes, 2, True, 8, 4, True)
    assert [r["sizes"] for r in results] == [[2, 2], [2, 2]]


def _join_uneven_inputs() -> list[int]:
    from ndparallel import Accelerator, DataLoaderConfiguration

    acc = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False))
    model = acc.prepare(torch.nn.Linear(1, 1))
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(3)), batch_size=1))
    seen = []
    with acc.join_uneven_inputs([model]):
        for i, batch in enumerate(loader):
            model(batch[0].float().unsqueeze(-1)).sum().backward()
            seen.append(i)
    acc.end_training()
    return seen


def test_join_uneven_inputs():
    assert run_ranks(_join_uneven_inputs, 2) == [[0, 1], [0]]


def _dataloader_stack() -> list:
    from ndparallel import Accelerator

    acc = Accelerator()
    first, second = acc.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=1),
                                DataLoader(TensorDataset(torch.arange(6)), batch_size=1))
    state, seen = acc.gradient_state, []
    seen.append(state.active_dataloader is None)
    for i, _ in enumerate(first):
        seen.append(state.active_dataloader is first and state.end_of_dataloader == (i == len(first) - 1))
        if i == 1:
            for j, _ in enumerate(second):
                seen.append(state.active_dataloader is second and state.end_of_dataloader == (j == len(second) - 1))
    seen.append(state.active_dataloader is None)
    acc.end_training()
    return seen


def test_dataloader_break_tracks_the_active_loader():
    for res in run_ranks(_dataloader_stack, 2):
        assert all(res) and len(res) == 2 + 5 + 3


def _batch_size_none_and_skip() -> dict:
    from ndparallel import Accelerator

    acc = Accelerator()
    whole_batches = [torch.full((2,), i) for i in range(6)]  # a dataset whose items are batches
    loader = acc.prepare(DataLoader(whole_batches, batch_size=None))
    out = {"items": [b[0].item() for b in loader]}
    plain = acc.prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=2))
    skipped = acc.skip_first_batches(plain, num_batches=2)
    out["skipped"] = [b[0].tolist() for b in skipped]
    out["next_pass"] = len(list(plain))
    acc.end_training()
    return out


def test_batch_size_none_loaders_and_skip_first_batches():
    results = run_ranks(_batch_size_none_and_skip, 2)
    assert [r["items"] for r in results] == [[0, 2, 4], [1, 3, 5]]
    assert [r["skipped"] for r in results] == [[[8, 9]], [[10, 11]]]  # 2 of 3 steps skipped
    assert all(r["next_pass"] == 3 for r in results)


def _scheduler_modes(step_with_optimizer: bool) -> list[float]:
    from ndparallel import Accelerator, GradientAccumulationPlugin

    acc = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2),
                      step_scheduler_with_optimizer=step_with_optimizer)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = acc.prepare(model, opt, sched)
    lrs = []
    for _ in range(4):
        with acc.accumulate(model):
            acc.backward(model(torch.ones(1, 1)).sum())
            opt.step()
            sched.step()
            opt.zero_grad()
        lrs.append(sched.get_last_lr()[0])
    acc.end_training()
    return lrs


def test_step_scheduler_with_optimizer():
    assert run_ranks(_scheduler_modes, 1, True)[0] == [1.0, 0.5, 0.5, 1 / 3]  # once per optimizer step
    assert run_ranks(_scheduler_modes, 1, False)[0] == [0.5, 1 / 3, 0.25, 0.2]  # once per call


def _refusals() -> dict:
    from harness import outcomes
    from ndparallel import Accelerator

    return outcomes({
        "deepspeed": lambda: Accelerator(deepspeed_plugin=object()),
        "megatron": lambda: Accelerator(megatron_lm_plugin=object()),
        "dynamo": lambda: Accelerator(dynamo_backend="warp_speed"),
        "dynamo-twice": lambda: Accelerator(dynamo_backend="inductor", dynamo_plugin=object()),
        "handler": lambda: Accelerator(kwargs_handlers=[object()]),
        "loss_weighting": lambda: Accelerator(loss_weighting="sum"),
    })


def test_foreign_engines_are_refused_with_what_to_use():
    from harness import assert_refused

    results = run_ranks(_refusals, 1)
    assert_refused(results, ("ValueError", r"deepspeed_plugin=.*not supported: DeepSpeed is not used: ZeRO-3 is "
                                           r"FSDP2"), "deepspeed")
    assert_refused(results, ("ValueError", r"megatron_lm_plugin=.*tensor parallelism is tp_size"), "megatron")
    assert_refused(results, ("ValueError", r"unknown dynamo backend 'warp_speed'; known: \[.*'inductor'"), "dynamo")
    assert_refused(results, ("ValueError", r"pass dynamo_plugin or dynamo_backend, not both"), "dynamo-twice")
    assert_refused(results, ("TypeError", r"kwargs_handlers: unsupported handler object"), "handler")
    assert_refused(results, ("ValueError", r"loss_weighting must be one of \['auto', 'tokens', 'mean'\]"),
                   "loss_weighting")


def _presharded(path: str) -> tuple:
    from transformers import LlamaForCausalLM

    from ndparallel import Accelerator
    from ndparallel.parallel.tensor.presharded import is_transformers_sharded

    acc = Accelerator(cpu=True, parallelism_config=ParallelismConfig(tp_size=2))
    # Accelerate's example: transformers splits the model itself, on the Accelerator's tp mesh
    model = LlamaForCausalLM.from_pretrained(path, tp_plan="auto", device_mesh=acc.torch_device_mesh["tp"])
    sharded = is_transformers_sharded(model)
    model = acc.prepare(model)
    ids = torch.arange(16).view(1, 16) % 90
    out = model(input_ids=ids, labels=ids)
    acc.backward(out.loss)
    # the mesh passed without a tp_plan (Accelerate's example for its other layouts): an ordinary model
    plain = acc.prepare(LlamaForCausalLM.from_pretrained(path, device_mesh=acc.torch_device_mesh))
    return (sharded, model.lm_head.weight is model.model.embed_tokens.weight, out.loss.item(),
            model.lm_head.weight.grad.full_tensor(), plain(input_ids=ids, labels=ids).loss.item())


def test_a_model_transformers_already_split_is_prepared_with_its_ties(tmp_path):
    """``from_pretrained(tp_plan="auto")`` models are gathered and split again on the Accelerator's mesh; a tied
    embedding / LM head stays one parameter, so its gradient is the sum of both uses, as in one process."""
    from tiny_models import build_model

    torch.manual_seed(0)
    model = build_model("llama_tied")
    model.save_pretrained(tmp_path)
    ids = torch.arange(16).view(1, 16) % 90
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    for sharded, tied, loss, grad, plain_loss in run_ranks(_presharded, 2, str(tmp_path)):
        assert sharded and tied
        assert loss == pytest.approx(out.loss.item(), abs=1e-6)
        assert plain_loss == pytest.approx(out.loss.item(), abs=1e-6)
        assert (grad - model.lm_head.weight.grad).abs().max().item() < 1e-6
