"""Tier 1 (no processes): validation tables for the config objects.

Every error path asserts the message text the user will read (house style 9), not just the type.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, StateDictType

from ndparallel.distributed.layout import AXES
from ndparallel.configuration.handlers import (
    CP_STRATEGIES,
    PipelineParallelConfig,
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
)
from ndparallel.configuration.parallelism import ParallelismConfig
from ndparallel.parallel.sequence import CP_ATTENTION
from ndparallel.configuration.plugins import FullyShardedDataParallelPlugin

SIZE_FIELDS = ("pp_size", "dp_replicate_size", "dp_shard_size", "cp_size", "sp_size", "tp_size", "ep_size")


# ---- ParallelismConfig: construction and resolve ------------------------------------------------------
def test_defaults_are_all_one():
    pc = ParallelismConfig()
    assert pc.sizes() == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "sp": 1, "tp": 1}
    assert isinstance(pc.tp_handler, TorchTensorParallelConfig)
    assert isinstance(pc.cp_handler, TorchContextParallelConfig)
    assert pc.resolve(1) == pc


@pytest.mark.parametrize(
    "kwargs, world, expected",
    [
        (dict(dp_shard_size=-1, tp_size=2), 8, dict(dp_shard_size=4, tp_size=2)),
        (dict(dp_replicate_size=-1, dp_shard_size=2, cp_size=2), 8, dict(dp_replicate_size=2)),
        (dict(dp_replicate_size=2, dp_shard_size=-1, tp_size=3), 12, dict(dp_shard_size=2)),
        (dict(tp_size=-1), 7, dict(tp_size=7)),
        (dict(sp_size=-1, cp_size=2), 2, dict(sp_size=1, cp_size=2)),  # -1 may become 1
        (dict(dp_shard_size=-1), 1, dict(dp_shard_size=1)),
        (dict(dp_replicate_size=2, dp_shard_size=2, cp_size=2, tp_size=2), 16, None),
        (dict(dp_replicate_size=2, dp_shard_size=2, cp_size=2, sp_size=2, tp_size=2), 32, None),
    ],
)
def test_resolve_valid(kwargs, world, expected):
    pc = ParallelismConfig(**kwargs)
    resolved = pc.resolve(world)
    want = {**{f: 1 for f in SIZE_FIELDS}, **kwargs, **(expected or {})}
    assert {f: getattr(resolved, f) for f in SIZE_FIELDS} == want
    assert resolved.total_size == world
    # resolve returns a copy: the -1 stays in the original
    assert {f: getattr(pc, f) for f in SIZE_FIELDS} == {**{f: 1 for f in SIZE_FIELDS}, **kwargs}


@pytest.mark.parametrize(
    "kwargs, world, match",
    [
        (dict(dp_replicate_size=2, dp_shard_size=2, tp_size=2), 6,
         r"dp_replicate\(2\) \* dp_shard\(2\) \* tp\(2\) = 8 != world size 6\..*-1.*8 processes in all"),
        (dict(cp_size=2, sp_size=2), 8, r"cp\(2\) \* sp\(2\) = 4 != world size 8"),
        (dict(), 4, r"^1 = 1 != world size 4"),
        (dict(dp_shard_size=-1, tp_size=4), 6,
         r"cannot fill dp_shard_size=-1: world size 6 is not divisible by tp\(4\) = 4"),
        # -1 between two known sizes: the divisor formula must not keep a hole ("a *  * b")
        (dict(dp_replicate_size=2, dp_shard_size=-1, tp_size=3), 8,
         r"cannot fill dp_shard_size=-1: world size 8 is not divisible by dp_replicate\(2\) \* tp\(3\) = 6$"),
        (dict(tp_size=-1, cp_size=16), 8,
         r"cannot fill tp_size=-1: world size 8 is not divisible by cp\(16\) = 16"),
    ],
)
def test_resolve_errors(kwargs, world, match):
    with pytest.raises(ValueError, match=match):
        ParallelismConfig(**kwargs).resolve(world)


@pytest.mark.parametrize("field", SIZE_FIELDS)
@pytest.mark.parametrize(
    "value, error, match",
    [
        (0, ValueError, r"must be >= 1, or -1 for 'the ranks that are left'; got 0"),
        (-2, ValueError, r"must be >= 1, or -1 .*; got -2"),
        (True, TypeError, r"must be an int .*got True"),
        (False, TypeError, r"must be an int .*got False"),
        (2.0, TypeError, r"must be an int .*got 2\.0"),
        ("2", TypeError, r"must be an int .*got '2'"),
        ([2], TypeError, r"must be an int .*got \[2\]"),
    ],
)
def test_bad_size(field, value, error, match):
    with pytest.raises(error, match=f"^{field} {match}"):
        ParallelismConfig(**{field: value})


@pytest.mark.parametrize(
    "kwargs, names",
    [
        (dict(dp_shard_size=-1, tp_size=-1), "dp_shard_size, tp_size"),
        (dict(dp_replicate_size=-1, dp_shard_size=-1, cp_size=-1), "dp_replicate_size, dp_shard_size, cp_size"),
    ],
)
def test_two_minus_ones(kwargs, names):
    with pytest.raises(ValueError, match=rf"at most one size may be -1 .*got -1 for {names}$"):
        ParallelismConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(tp_handler={"plan": None}), TypeError, r"tp_handler must be a TorchTensorParallelConfig, got dict"),
        (dict(cp_handler="ring"), TypeError, r"cp_handler must be a TorchContextParallelConfig, got str"),
        (dict(tp_handler=TorchContextParallelConfig()), TypeError, r"tp_handler must be a TorchTensorParallelConfig"),
    ],
)
def test_bad_handlers(kwargs, error, match):
    with pytest.raises(error, match=match):
        ParallelismConfig(**kwargs)


# ---- environment variables (read for unset fields, by the constructor and by from_env) -------------------------
@pytest.mark.parametrize("field", SIZE_FIELDS)
def test_env_var_used_when_field_is_none(field):
    pc = ParallelismConfig.from_env(environ={f"NDPARALLEL_{field.upper()}": "4"})
    assert getattr(pc, field) == 4
    assert all(getattr(pc, f) == 1 for f in SIZE_FIELDS if f != field)


def test_constructor_reads_the_environment_for_unset_sizes(monkeypatch):
    """As Accelerate's constructor (issue 25): a size left unset comes from the launcher's variables -- ndparallel's
    first, then Accelerate's -- and an explicit one wins; from_env reads a mapping given instead."""
    monkeypatch.setenv("NDPARALLEL_TP_SIZE", "4")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "8")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    assert (ParallelismConfig().tp_size, ParallelismConfig().cp_size) == (4, 2)
    assert ParallelismConfig(tp_size=1).tp_size == 1
    assert ParallelismConfig.from_env().tp_size == 4  # os.environ by default
    assert ParallelismConfig.from_env(ParallelismConfig(), environ={}).sizes() == dict.fromkeys(AXES, 1)
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "x")
    with pytest.raises(ValueError, match=r"environment variable PARALLELISM_CONFIG_DP_SHARD_SIZE='x' is not an integer"):
        ParallelismConfig()


def test_env_var_minus_one_and_empty():
    pc = ParallelismConfig.from_env(environ={"NDPARALLEL_DP_SHARD_SIZE": "-1", "NDPARALLEL_TP_SIZE": ""})  # empty: unset
    assert (pc.dp_shard_size, pc.tp_size) == (-1, 1)
    assert pc.resolve(8).dp_shard_size == 8


def test_explicit_args_beat_env_vars():
    env = {"NDPARALLEL_TP_SIZE": "4", "NDPARALLEL_CP_SIZE": "2", "NDPARALLEL_SP_SIZE": "2"}
    pc = ParallelismConfig.from_env(ParallelismConfig(tp_size=2, cp_size=1), environ=env)  # an explicit 1 also wins
    assert (pc.tp_size, pc.cp_size, pc.sp_size) == (2, 1, 2)


@pytest.mark.parametrize("raw", ["abc", "2.0", "two"])
def test_bad_env_var_is_named(raw):
    with pytest.raises(ValueError, match=re.escape(f"environment variable NDPARALLEL_TP_SIZE={raw!r} is not an integer")):
        ParallelismConfig.from_env(environ={"NDPARALLEL_TP_SIZE": raw})


def test_bad_env_var_value_is_validated():
    with pytest.raises(ValueError, match=r"cp_size must be >= 1, or -1 .*; got 0"):
        ParallelismConfig.from_env(environ={"NDPARALLEL_CP_SIZE": "0"})


def test_env_var_not_read_for_explicit_bad_env():
    # a broken variable for a field given explicitly must not matter
    assert ParallelismConfig.from_env(ParallelismConfig(tp_size=2), environ={"NDPARALLEL_TP_SIZE": "abc"}).tp_size == 2


def test_to_env_round_trip():
    pc = ParallelismConfig(dp_replicate_size=2, dp_shard_size=-1, sp_size=2, tp_size=2)
    env = pc.to_env()
    assert env == {
        "NDPARALLEL_PP_SIZE": "1",
        "NDPARALLEL_DP_REPLICATE_SIZE": "2",
        "NDPARALLEL_DP_SHARD_SIZE": "-1",
        "NDPARALLEL_CP_SIZE": "1",
        "NDPARALLEL_SP_SIZE": "2",
        "NDPARALLEL_TP_SIZE": "2",
        "NDPARALLEL_EP_SIZE": "1",
    }
    assert ParallelismConfig.from_env(environ=env) == pc


# ---- expert parallelism: carved out of dp_shard x cp x sp, no factor of the world size ------------------------
@pytest.mark.parametrize("kwargs, world", [
    (dict(dp_shard_size=4, ep_size=4), 4),
    (dict(dp_shard_size=-1, ep_size=2), 8),  # checked once the -1 is filled
    (dict(dp_shard_size=2, cp_size=2, sp_size=2, tp_size=2, ep_size=8), 16),
    (dict(dp_replicate_size=2, dp_shard_size=2, cp_size=3, ep_size=3), 12),
])
def test_ep_size_does_not_multiply_the_world(kwargs, world):
    resolved = ParallelismConfig(**kwargs).resolve(world)
    assert resolved.total_size == world and resolved.ep_size == kwargs["ep_size"] and resolved.ep_enabled
    assert "ep" not in resolved.sizes()


@pytest.mark.parametrize("kwargs, world, match", [
    (dict(dp_shard_size=4, ep_size=3), 4, r"ep_size=3 must divide the ranks the experts are split over, dp_shard\(4\) "
                                          r"\* cp\(1\) \* sp\(1\) = 4 .*use ep_size in \[1, 2, 4\]"),
    (dict(dp_replicate_size=2, tp_size=2, ep_size=2), 4, r"ep_size=2 must divide .* = 1 .*dp_replicate and tp ranks "
                                                         r"hold copies"),
    (dict(dp_shard_size=-1, tp_size=2, ep_size=4), 4, r"ep_size=4 must divide .*dp_shard\(2\)"),
])
def test_ep_size_must_divide_the_ranks_it_is_taken_from(kwargs, world, match):
    with pytest.raises(ValueError, match=match):
        ParallelismConfig(**kwargs).resolve(world)


def test_ep_size_minus_one_is_refused():
    with pytest.raises(ValueError, match=r"ep_size must be >= 1: .*-1 \('the ranks that are left'\) has no meaning"):
        ParallelismConfig(dp_shard_size=4, ep_size=-1)


# ---- Accelerate-compatible properties -----------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, total, dp, non_dp, enabled, active",
    [
        (dict(), 1, 1, 1, set(), []),
        (dict(dp_shard_size=8), 8, 8, 1, {"dp_shard", "dp"}, ["dp_shard"]),
        (dict(dp_replicate_size=2, dp_shard_size=2, cp_size=2, tp_size=2), 16, 4, 4,
         {"dp_replicate", "dp_shard", "dp", "cp", "tp"}, ["dp_replicate", "dp_shard", "tp", "cp"]),
        (dict(dp_replicate_size=3, sp_size=2, tp_size=2), 12, 3, 4,
         {"dp_replicate", "dp", "sp", "tp"}, ["dp_replicate", "tp", "sp"]),
        (dict(tp_size=4, cp_size=2, sp_size=2), 16, 1, 16, {"tp", "cp", "sp"}, ["tp", "cp", "sp"]),
    ],
)
def test_accelerate_properties(kwargs, total, dp, non_dp, enabled, active):
    pc = ParallelismConfig(**kwargs)
    assert pc.total_size == total
    assert pc.data_parallel_size == dp
    assert pc.non_data_parallel_size == non_dp
    flags = {name: getattr(pc, f"{name}_enabled") for name in ("dp_replicate", "dp_shard", "dp", "tp", "cp", "sp")}
    assert {name for name, on in flags.items() if on} == enabled
    assert all(isinstance(on, bool) for on in flags.values())
    assert pc.active_mesh_dims == active  # Accelerate's order: data-parallel dimensions, then tp, cp, sp


def test_total_size_unknown_before_resolve():
    pc = ParallelismConfig(dp_shard_size=-1, tp_size=2)
    with pytest.raises(ValueError, match=r"total_size is unknown until a -1 size is resolved"):
        pc.total_size
    assert pc.resolve(8).total_size == 8


# ---- serialisation ------------------------------------------------------------------------------------
# Built inside the tests (not at import), so that the autouse fixture has cleared NDPARALLEL_* first.
ROUND_TRIP_CONFIGS = [
    lambda: ParallelismConfig(),
    lambda: ParallelismConfig(dp_replicate_size=2, dp_shard_size=-1, tp_size=2),
    lambda: ParallelismConfig(
        cp_size=2, sp_size=2,
        tp_handler=TorchTensorParallelConfig(plan={"layers.*.mlp.down_proj": "rowwise"}, sequence_parallel=True),
        cp_handler=TorchContextParallelConfig(cp_comm_strategy="ring", load_balance=False),
    ),
    lambda: ParallelismConfig(pp_size=2, dp_shard_size=2, pp_handler=PipelineParallelConfig(
        schedule="interleaved_1f1b", microbatches=8, split=[1, 2, 3])),
    lambda: ParallelismConfig(dp_shard_size=4, ep_size=2),
]
ROUND_TRIP_IDS = ["defaults", "minus_one", "handlers", "pipeline", "experts"]


@pytest.mark.parametrize("make", ROUND_TRIP_CONFIGS, ids=ROUND_TRIP_IDS)
def test_dict_round_trip(make):
    pc = make()
    data = pc.to_dict()
    # pp_handler only when pipeline stages are configured (a file without them stays readable by older versions)
    # ep_size likewise, only with expert parallelism
    assert set(data) == (set(SIZE_FIELDS) - ({"ep_size"} if pc.ep_size == 1 else set())) | {"tp_handler", "cp_handler"} | (
        {"pp_handler"} if pc.pp_size > 1 else set())
    assert isinstance(data["tp_handler"], dict) and isinstance(data["cp_handler"], dict)
    assert ParallelismConfig.from_dict(data) == pc


@pytest.mark.parametrize("make", ROUND_TRIP_CONFIGS, ids=ROUND_TRIP_IDS)
def test_yaml_round_trip(make, tmp_path):
    pc = make()
    path = tmp_path / "config.yaml"
    text = pc.to_yaml(path)
    assert path.read_text() == text
    assert text.startswith("parallelism:")
    assert ParallelismConfig.from_yaml(path) == pc
    assert ParallelismConfig.from_yaml(str(path)) == pc


def test_from_dict_partial_uses_defaults_and_env():
    pc = ParallelismConfig.from_dict({"tp_size": 2})
    assert (pc.tp_size, pc.cp_size, pc.dp_shard_size) == (2, 1, 1)
    pc = ParallelismConfig.from_env(pc, environ={"NDPARALLEL_CP_SIZE": "2", "NDPARALLEL_TP_SIZE": "4"})
    assert (pc.tp_size, pc.cp_size, pc.dp_shard_size) == (2, 2, 1)


def test_from_yaml_without_parallelism_section(tmp_path):
    path = tmp_path / "other.yaml"
    path.write_text("mixed_precision: bf16\n")
    assert ParallelismConfig.from_yaml(path) == ParallelismConfig()


@pytest.mark.parametrize(
    "data, error, match",
    [
        ({"tp_size": 2, "expert_size": 2}, ValueError,
         r"unknown parallelism config key\(s\) \['expert_size'\]; valid keys: \[.*'ep_size'.*'tp_size'.*\]"),
        ({"tp": 2, "dp_shard": 2}, ValueError, r"unknown parallelism config key\(s\) \['dp_shard', 'tp'\]"),
        ([("tp_size", 2)], TypeError, r"a parallelism config must be a mapping, got list"),
        ({"cp_handler": {"cp_comm_strategy": "all_to_all"}}, ValueError, r"Invalid cp_comm_strategy: all_to_all"),
        ({"tp_size": "2"}, TypeError, r"tp_size must be an int"),
    ],
)
def test_from_dict_errors(data, error, match):
    with pytest.raises(error, match=match):
        ParallelismConfig.from_dict(data)


def test_from_yaml_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(FileNotFoundError, match=rf"config file '{re.escape(str(path))}' does not exist.*ndparallel config"):
        ParallelismConfig.from_yaml(path)


@pytest.mark.parametrize(
    "text, error, match, names_file",
    [
        ("parallelism: {tp_size: 2\n", ValueError, r"is not valid YAML", True),
        ("parallelism:\n  tp_size: 2\n bad_indent: 3\n", ValueError, r"is not valid YAML", True),
        ("- tp_size\n- 2\n", ValueError, r"must hold a mapping at the top level, got list", True),
        ("parallelism: 3\n", TypeError, r"a parallelism config must be a mapping, got int", False),
        ("parallelism:\n  tp_szie: 2\n", ValueError, r"unknown parallelism config key\(s\) \['tp_szie'\]", False),
    ],
)
def test_from_yaml_malformed(tmp_path, text, error, match, names_file):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(error, match=match) as info:
        ParallelismConfig.from_yaml(path)
    if names_file:
        assert f"config file {str(path)!r}" in str(info.value)


@pytest.mark.parametrize("text", ["", "parallelism:\n", "parallelism:\n  # tp_size: 2\n"])
def test_empty_yaml_or_section_is_defaults(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    assert ParallelismConfig.from_yaml(path) == ParallelismConfig()


# ---- tensor / context parallel handlers ---------------------------------------------------------------
def test_tp_handler():
    assert TorchTensorParallelConfig() == TorchTensorParallelConfig(plan=None, sequence_parallel=False)
    plan = {"layers.*.self_attn.q_proj": "colwise"}
    assert TorchTensorParallelConfig(plan=plan).plan == plan
    with pytest.raises(TypeError, match=r"TorchTensorParallelConfig.plan must be a dict of pattern -> style, got list"):
        TorchTensorParallelConfig(plan=["colwise"])


@pytest.mark.parametrize("strategy", CP_STRATEGIES)
def test_cp_handler_valid(strategy):
    assert TorchContextParallelConfig(cp_comm_strategy=strategy).cp_comm_strategy == strategy
    # every accepted name has an attention to run (a name only the config knew would fail at the first forward)
    assert strategy in CP_ATTENTION


@pytest.mark.parametrize("strategy", ["all_to_all", "Ring", ""])
def test_cp_handler_unknown_strategy(strategy):
    with pytest.raises(ValueError, match=rf"Invalid cp_comm_strategy: {re.escape(strategy)}\. Must be one of "
                                         r"\['allgather', 'ring', 'alltoall'\]"):
        TorchContextParallelConfig(cp_comm_strategy=strategy)


def test_cp_handler_default_and_accelerate_names():
    assert TorchContextParallelConfig().cp_comm_strategy == "allgather"
    assert TorchContextParallelConfig(cp_comm_strategy=None).cp_comm_strategy == "allgather"
    assert TorchContextParallelConfig(cp_comm_strategy="alltoall").cp_comm_strategy == "alltoall"  # ring


# ---- FullyShardedDataParallelPlugin -------------------------------------------------------------------
def test_fsdp_defaults():
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.auto_wrap_policy == "transformer_based_wrap"
    assert plugin.transformer_cls_names_to_wrap is None
    assert plugin.reshard_after_forward is True
    assert plugin.mixed_precision_policy is None
    # Accelerate's types: torch's enum and offload policies (issue 25)
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert plugin.cpu_offload == OffloadPolicy() and not plugin.offloads_to_cpu


@pytest.mark.parametrize(
    "kwargs, field, expected",
    [
        (dict(auto_wrap_policy="no_wrap"), "auto_wrap_policy", "no_wrap"),
        # Accelerate's configs spell the policies in upper case
        (dict(auto_wrap_policy="TRANSFORMER_BASED_WRAP"), "auto_wrap_policy", "transformer_based_wrap"),
        (dict(auto_wrap_policy="NO_WRAP"), "auto_wrap_policy", "no_wrap"),
        (dict(state_dict_type="full_state_dict"), "state_dict_type", StateDictType.FULL_STATE_DICT),
        (dict(state_dict_type="SHARDED_STATE_DICT"), "state_dict_type", StateDictType.SHARDED_STATE_DICT),
        (dict(transformer_cls_names_to_wrap="LlamaDecoderLayer"), "transformer_cls_names_to_wrap", ["LlamaDecoderLayer"]),
        (dict(transformer_cls_names_to_wrap=" LlamaDecoderLayer, MistralDecoderLayer ,"),
         "transformer_cls_names_to_wrap", ["LlamaDecoderLayer", "MistralDecoderLayer"]),
        (dict(transformer_cls_names_to_wrap=["A", "B"]), "transformer_cls_names_to_wrap", ["A", "B"]),
        (dict(ignored_modules=r"^lm_head$|embed_tokens"), "ignored_modules", r"^lm_head$|embed_tokens"),
        (dict(reshard_after_forward=False), "reshard_after_forward", False),
    ],
)
def test_fsdp_valid(kwargs, field, expected):
    assert getattr(FullyShardedDataParallelPlugin(**kwargs), field) == expected


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(fsdp_version=1), ValueError, r"fsdp_version=1 is not supported: ndparallel uses FSDP2 .*set fsdp_version=2"),
        (dict(fsdp_version="1"), ValueError, r"fsdp_version=1 is not supported"),
        (dict(auto_wrap_policy="size"), ValueError,
         r"auto_wrap_policy='size' is not supported; use one of \['transformer_based_wrap', 'size_based_wrap', "
         r"'no_wrap'\] or a callable"),
        (dict(auto_wrap_policy="transformer"), ValueError, r"auto_wrap_policy='transformer' is not supported"),
        (dict(state_dict_type="LOCAL_STATE_DICT"), ValueError,
         r"state_dict_type='LOCAL_STATE_DICT' is not one of \['SHARDED_STATE_DICT', 'FULL_STATE_DICT'\]"),
        (dict(state_dict_type="sharded"), ValueError, r"state_dict_type='SHARDED' is not one of"),
        (dict(ignored_modules="lm_head("), ValueError, r"ignored_modules='lm_head\(' is not a valid regex: "),
        (dict(ignored_modules="[a-"), ValueError, r"ignored_modules='\[a-' is not a valid regex"),
        (dict(reshard_after_forward="maybe"), TypeError, r"reshard_after_forward must be a bool \(or 'true' / "
                                                        r"'false'\), got 'maybe'"),
    ],
)
def test_fsdp_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        FullyShardedDataParallelPlugin(**kwargs)


@pytest.mark.parametrize(
    "policy, expected",
    [
        (None, None),
        # A name means what it means in Accelerate 1.16: compute and reduce in that dtype, outputs not cast
        ("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)),
        ("BF16", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)),
        ("fp16", MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)),
        ("fp8", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)),
        ({"param_dtype": "bfloat16", "reduce_dtype": "fp32"},
         MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
        ({"param_dtype": torch.float16, "output_dtype": "float32", "cast_forward_inputs": False},
         MixedPrecisionPolicy(param_dtype=torch.float16, output_dtype=torch.float32, cast_forward_inputs=False)),
        ({}, MixedPrecisionPolicy()),
        (MixedPrecisionPolicy(param_dtype=torch.bfloat16), MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
        (torch.bfloat16, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)),
    ],
)
def test_mixed_precision_policy_valid(policy, expected):
    assert FullyShardedDataParallelPlugin(mixed_precision_policy=policy).mixed_precision_policy == expected


@pytest.mark.parametrize(
    "policy, error, match",
    [
        ({"param_dtype": "bf16", "buffer_dtype": "bf16"}, ValueError,
         r"mixed_precision_policy: unknown field\(s\) \['buffer_dtype'\]; valid: "
         r"\['cast_forward_inputs', 'output_dtype', 'param_dtype', 'reduce_dtype'\]"),
        ("fp4", ValueError, r"mixed_precision_policy: unknown dtype 'fp4'; use one of \[.*'bf16'.*\] or a torch\.dtype"),
        ({"param_dtype": "half-ish"}, ValueError, r"mixed_precision_policy\.param_dtype: unknown dtype 'half-ish'"),
        ({"reduce_dtype": 32}, ValueError, r"mixed_precision_policy\.reduce_dtype: unknown dtype 32"),
        (16, TypeError,
         r"mixed_precision_policy must be a MixedPrecisionPolicy, a dict of its fields, a dtype name or None; got int"),
        (["bf16"], TypeError, r"mixed_precision_policy must be .*; got list"),
    ],
)
def test_mixed_precision_policy_errors(policy, error, match):
    with pytest.raises(error, match=match):
        FullyShardedDataParallelPlugin(mixed_precision_policy=policy)


def test_fsdp_plugin_is_a_dataclass_with_accelerate_names():
    names = {f.name for f in dataclasses.fields(FullyShardedDataParallelPlugin)}
    assert {
        "fsdp_version", "auto_wrap_policy", "transformer_cls_names_to_wrap", "reshard_after_forward",
        "mixed_precision_policy", "cpu_offload", "activation_checkpointing", "ignored_modules", "state_dict_type",
    } <= names
