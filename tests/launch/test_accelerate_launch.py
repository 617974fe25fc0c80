"""``ndparallel launch`` given what ``accelerate launch`` takes: the YAML of ``accelerate config`` and Accelerate's
flags (ndparallel.launch.accelerate_launch). Plans are checked without starting processes; one real launch checks that the
ranks' Accelerator gets the file's settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from ndparallel.launch.cli import build_parser, main
from ndparallel.launch.launcher import plan_launch
from test_cli import run_cli

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "accelerate_launch_report.py")

# What `accelerate config` writes for FSDP2 with a ParallelismConfig (the shape of Accelerate's own example configs).
ACCELERATE_FILE = {
    "compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": "FSDP", "downcast_bf16": "no",
    "enable_cpu_affinity": False,
    "fsdp_config": {"fsdp_activation_checkpointing": False, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                    "fsdp_cpu_ram_efficient_loading": False, "fsdp_offload_params": False,
                    "fsdp_reshard_after_forward": True, "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                    "fsdp_version": 2},
    "machine_rank": 0, "main_training_function": "main", "mixed_precision": "bf16", "num_machines": 1,
    "num_processes": 8,
    "parallelism_config": {"parallelism_config_cp_size": 1, "parallelism_config_dp_replicate_size": 2,
                           "parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 2},
    "rdzv_backend": "static", "same_network": True, "tpu_env": [], "tpu_use_cluster": False, "tpu_use_sudo": False,
    "use_cpu": False,
}


def write(tmp_path: Path, data: dict, name: str = "accelerate.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def plan(*args: str):
    return plan_launch(build_parser().parse_args(["launch", *args]))


def test_an_accelerate_config_file_becomes_the_same_launch(tmp_path):
    p = plan("--config_file", write(tmp_path, ACCELERATE_FILE), SCRIPT)
    assert (p.nproc_per_node, p.nnodes) == (8, 1)
    assert p.parallelism.sizes() == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "sp": 1, "tp": 2}
    assert p.env["NDPARALLEL_MIXED_PRECISION"] == "bf16"
    # on a machine without CUDA the launch is a CPU run, which says so as `accelerate launch` does
    assert p.env.get("ACCELERATE_USE_CPU") == (None if torch.cuda.is_available() else "true")
    # the FSDP plugin's fields, as `accelerate launch` exports them
    exported = {k: v for k, v in p.env.items() if k.startswith(("FSDP_", "ACCELERATE_")) and k != "ACCELERATE_USE_CPU"}
    assert exported == {
        "ACCELERATE_USE_FSDP": "true", "FSDP_ACTIVATION_CHECKPOINTING": "false",
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
        "FSDP_OFFLOAD_PARAMS": "false", "FSDP_RESHARD_AFTER_FORWARD": "true",
        "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT", "FSDP_VERSION": "2"}
    assert not [w for w in p.warnings if "same_network" in w or "downcast" in w]  # no-effect keys: silent


def test_accelerate_flags_override_the_file_and_count_processes_over_all_machines(tmp_path):
    path = write(tmp_path, ACCELERATE_FILE)
    p = plan("--config_file", path, "--num_processes", "8", "--num_machines", "2", "--machine_rank", "1",
             "--main_process_ip", "10.1.2.3", "--main_process_port", "1234", "--mixed_precision", "no",
             "--fsdp_reshard_after_forward", "false", "--parallelism_config_cp_comm_strategy", "alltoall", SCRIPT)
    assert (p.nproc_per_node, p.nnodes) == (4, 2)  # 8 processes over 2 machines
    assert p.endpoint == "10.1.2.3:1234"
    assert "--node-rank=1" in p.torchrun_args and "--master-addr=10.1.2.3" in p.torchrun_args
    assert p.env["NDPARALLEL_MIXED_PRECISION"] == "no" and p.env["FSDP_RESHARD_AFTER_FORWARD"] == "false"
    assert p.env["PARALLELISM_CONFIG_CP_COMM_STRATEGY"] == "alltoall"
    # the dash spellings are the same flags
    q = plan("--config-file", path, "--num-processes", "8", "--num-machines", "2", "--machine-rank", "1",
             "--main-process-ip", "10.1.2.3", "--main-process-port", "1234", "--mixed-precision", "no",
             "--fsdp-reshard-after-forward", "false", "--parallelism-config-cp-comm-strategy", "alltoall", SCRIPT)
    assert (q.nproc_per_node, q.nnodes, q.env, q.torchrun_args) == (p.nproc_per_node, p.nnodes, p.env,
                                                                      p.torchrun_args)


def test_accelerate_flags_without_a_file(tmp_path):
    p = plan("--num_processes", "4", "--use_fsdp", "--fsdp_auto_wrap_policy", "NO_WRAP",
             "--parallelism_config_dp_shard_size", "2", "--parallelism_config_tp_size", "2",
             "--num_cpu_threads_per_process", "3", "--gpu_ids", "0,1", "--multi_gpu", SCRIPT)
    assert p.nproc_per_node == 4 and p.parallelism.sizes()["tp"] == 2
    assert p.env["ACCELERATE_USE_FSDP"] == "true" and p.env["FSDP_AUTO_WRAP_POLICY"] == "NO_WRAP"
    assert p.env["OMP_NUM_THREADS"] == "3" and p.env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_a_dynamo_config_reaches_the_script_as_accelerate_launch_exports_it(tmp_path):
    dynamo = {"dynamo_backend": "INDUCTOR", "dynamo_mode": "default", "dynamo_use_regional_compilation": True}
    p = plan("--config_file", write(tmp_path, {**ACCELERATE_FILE, "dynamo_config": dynamo}), SCRIPT)
    assert p.env["ACCELERATE_DYNAMO_BACKEND"] == "INDUCTOR"
    assert p.env["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] == "True"
    assert plan("--dynamo_backend", "aot_eager", SCRIPT).env["ACCELERATE_DYNAMO_BACKEND"] == "aot_eager"


def test_other_distributed_types_and_ignored_sections(tmp_path):
    cpu = plan("--config_file", write(tmp_path, {**ACCELERATE_FILE, "distributed_type": "MULTI_CPU",
                                                 "parallelism_config": {}, "num_processes": 2}), SCRIPT)
    assert cpu.cpu and cpu.parallelism is None and "ACCELERATE_USE_FSDP" not in cpu.env
    assert any("fsdp_config is ignored because distributed_type is MULTI_CPU" in w for w in cpu.warnings)
    noisy = plan("--config_file", write(tmp_path, {**ACCELERATE_FILE, "debug": True}), SCRIPT)
    assert any("debug is ignored" in w for w in noisy.warnings)


@pytest.mark.parametrize("change, flags, message", [
    ({"distributed_type": "DEEPSPEED"}, [], "distributed_type DEEPSPEED is not supported: DeepSpeed is not used"),
    ({"distributed_type": "MEGATRON_LM"}, [], "distributed_type MEGATRON_LM is not supported"),
    ({"distributed_type": "MULTI_NPU"}, [], "distributed_type MULTI_NPU is not supported; ndparallel runs"),
    ({}, ["--use_deepspeed"], "--use_deepspeed is not supported"),
    ({}, ["--no_python"], "--no_python is not supported"),
    ({"compute_environment": "AMAZON_SAGEMAKER"}, [], "compute_environment 'AMAZON_SAGEMAKER' is not supported"),
    ({"dynamo_config": {"dynamo_backend": "WARP_SPEED"}}, [], "dynamo_config: TorchDynamoPlugin: unknown dynamo "
                                                              "backend 'WARP_SPEED'"),
    ({"dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_cache": 1}}, [], "unknown dynamo_config key(s)"),
    ({"flash": True}, [], "unknown key(s) ['flash']"),
    ({"fsdp_config": {"fsdp_sharding": "FULL"}}, [], "unknown fsdp_config key(s) ['fsdp_sharding']"),
    ({"fsdp_config": {"fsdp_auto_wrap_policy": "EVERYTHING"}}, [], "fsdp_config: auto_wrap_policy='EVERYTHING' is "
                                                                   "not supported"),
    ({"parallelism_config": {"parallelism_config_experts_size": 2}}, [], "unknown parallelism_config key(s)"),
    ({"parallelism_config": {"parallelism_config_sp_size": 2, "parallelism_config_dp_shard_size": 4,
                             "parallelism_config_sp_backend": "deepspeed"}}, [],
     "parallelism_config: sp_size=2 with sp_backend='deepspeed': ndparallel runs Ulysses sequence parallelism itself"),
    ({"parallelism_config": {"parallelism_config_cp_size": 8, "parallelism_config_cp_comm_strategy": "bogus"}}, [],
     "Invalid cp_comm_strategy: bogus"),
    ({"num_machines": 3}, [], "--num-processes 8 (over all nodes) is not divisible by --nnodes 3"),
    ({}, ["--nproc-per-node", "2"], "--num-processes 8 (over all nodes) disagrees with --nproc-per-node 2"),
    ({}, ["--rdzv-endpoint", "h:1", "--main_process_ip", "h"], "give --rdzv-endpoint HOST:PORT or --main-process-ip"),
    ({"rdzv_backend": "etcd"}, [], "rdzv_backend 'etcd' is not supported"),
    ({"parallelism_config": {"parallelism_config_tp_size": 3}}, [], "!= world size 8"),
])
def test_what_cannot_run_is_refused_before_anything_starts(capsys, tmp_path, change, flags, message):
    path = write(tmp_path, {**ACCELERATE_FILE, **change})
    assert main(["launch", "--config_file", path, *flags, SCRIPT]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ndparallel launch: error: ") and message in err, err


@pytest.mark.slow
def test_a_real_launch_with_an_accelerate_config_file(tmp_path):
    """Two CPU ranks from an `accelerate config` file: the ranks' Accelerator (built with no arguments, as in an
    Accelerate script) gets FSDP2 sharding over both, its plugin fields and mixed precision."""
    data = {**ACCELERATE_FILE, "num_processes": 2, "use_cpu": True,
            "fsdp_config": {**ACCELERATE_FILE["fsdp_config"], "fsdp_auto_wrap_policy": "NO_WRAP",
                            "fsdp_reshard_after_forward": False},
            "parallelism_config": {"parallelism_config_dp_shard_size": 2}}
    result = run_cli("launch", "--config_file", write(tmp_path, data), SCRIPT)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert sorted(r.pop("rank") for r in records) == [0, 1]
    assert records == [{"world_size": 2, "sizes": {"dp_shard": 2}, "fsdp2": True, "mixed_precision": "bf16",
                        "wrap": "no_wrap", "reshard": False, "cp_strategy": "allgather",
                        "model": "FSDPSequential"}] * 2


def test_ndparallel_config_writes_an_accelerate_file_that_launch_reads_back(capsys, tmp_path):
    path = str(tmp_path / "accelerate.yaml")
    assert main(["config", "--format", "accelerate", "--config-file", path, "--dp-shard-size", "2", "--tp-size", "2",
                 "--mixed-precision", "bf16", "--cpu"]) == 0
    data = yaml.safe_load(Path(path).read_text())
    assert (data["distributed_type"], data["num_processes"], data["use_cpu"]) == ("FSDP", 4, True)
    p = plan("--config-file", path, SCRIPT)
    assert (p.nproc_per_node, p.cpu, p.env["NDPARALLEL_MIXED_PRECISION"]) == (4, True, "bf16")
    assert p.parallelism.sizes() == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "sp": 1, "tp": 2}
    assert p.env["ACCELERATE_USE_FSDP"] == "true" and p.env["FSDP_VERSION"] == "2"
    # data parallel only: no FSDP, no sizes
    assert main(["config", "--format", "accelerate", "--config-file", path, "--nproc-per-node", "2"]) == 0
    p = plan("--config-file", path, SCRIPT)
    assert p.nproc_per_node == 2 and p.parallelism is None and "ACCELERATE_USE_FSDP" not in p.env
    assert main(["config", "--format", "accelerate", "--config-file", path, "--gradient-accumulation-steps", "2"]) == 2
    assert "holds no gradient_accumulation_steps" in capsys.readouterr().err
