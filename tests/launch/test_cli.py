"""Tests of the ``ndparallel`` command: argument checks, config files, env report, and real launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ndparallel.launch.cli import build_parser, main
from ndparallel.configuration.parallelism import ParallelismConfig
from ndparallel.launch.launcher import WORKER, plan_launch

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "print_env_launch.py")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No NDPARALLEL_* variable of the shell running the tests may leak into them."""
    for key in list(os.environ):
        if key.startswith("NDPARALLEL_"):
            monkeypatch.delenv(key)


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`timeout`: a guard against a hang, not a speed check (the machine may be busy with other work)."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("NDPARALLEL_")}
    child_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "ndparallel.cli", *args], capture_output=True, text=True,
                          env=child_env, timeout=timeout)


def plan(*args: str):
    return plan_launch(build_parser().parse_args(["launch", *args]))


def write_yaml(path: Path, data: object) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


# ---- top level ------------------------------------------------------------------------------------------
def test_no_subcommand_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "launch" in capsys.readouterr().err


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("ndparallel 0.1.0")


# ---- launch: checks before anything starts --------------------------------------------------------------
@pytest.mark.slow
def test_launch_sizes_not_matching_world_size_fail_in_the_launcher():
    result = run_cli("launch", "--nproc-per-node", "3", "--dp-replicate-size", "2", "--dp-shard-size", "2", SCRIPT)
    assert result.returncode == 2
    assert "ndparallel launch: error: dp_replicate(2) * dp_shard(2) = 4 != world size 3" in result.stderr
    assert "RESULT" not in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--nproc-per-node", "4", "--tp-size", "0"], "tp_size must be >= 1"),
    (["--nproc-per-node", "3", "--tp-size", "2", "--dp-shard-size", "-1"], "world size 3 is not divisible by tp(2) = 2"),
    (["--tp-size", "-1", "--cp-size", "-1"], "at most one size may be -1"),
    (["--nnodes", "2", "--nproc-per-node", "2"], "--rdzv-endpoint HOST:PORT is required with --nnodes 2"),
    (["--rdzv-endpoint", "localhost"], "must be HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:29500"], "--node-rank must be in 0..1"),
    (["--nproc-per-node", "0"], "--nproc-per-node must be an integer >= 1, got 0"),
    (["--nnodes", "0"], "--nnodes must be an integer >= 1, got 0"),
    (["--nproc-per-node", "2", "--gradient-accumulation-steps", "0"], "must be an integer >= 1, got 0"),
    (["--max-restarts", "-1"], "--max-restarts must be >= 0"),
])
def test_launch_rejects_bad_settings(capsys, args, message):
    assert main(["launch", *args, SCRIPT]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ndparallel launch: error: ") and message in err


def test_launch_missing_script(capsys, tmp_path):
    assert main(["launch", "--nproc-per-node", "2", str(tmp_path / "nope.py")]) == 2
    assert "nope.py' does not exist" in capsys.readouterr().err


def test_launch_usage_error_exits_2(capsys):
    assert main(["launch", "--nproc-per-node", "two", SCRIPT]) == 2
    assert "invalid int value: 'two'" in capsys.readouterr().err


@pytest.mark.parametrize("data, message", [
    ({"launch": {"nproc": 2}}, r"unknown key(s) ['nproc'] in 'launch'; valid keys: ['nproc_per_node', 'nnodes'"),
    ({"parallelism": {"tp": 2}}, "unknown parallelism config key(s) ['tp']"),
    ({"parallelsm": {}}, "unknown section(s) ['parallelsm']; valid sections: ['parallelism', 'launch']"),
    ({"launch": {"mixed_precision": "fp4"}}, "launch.mixed_precision must be one of ['no', 'bf16', 'fp16', 'fp8']"),
    ({"launch": {"cpu": "maybe"}}, "launch.cpu must be true or false"),
    ({"parallelism": {"tp_size": "2"}}, "tp_size must be an int"),
    ([1, 2], "must hold a mapping at the top level"),
])
def test_launch_rejects_bad_config_file(capsys, tmp_path, data, message):
    path = write_yaml(tmp_path / "c.yaml", data)
    assert main(["launch", "--config-file", path, SCRIPT]) == 2
    assert message in capsys.readouterr().err


def test_launch_rejects_malformed_and_missing_yaml(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("parallelism: [tp_size: 2\n")
    assert main(["launch", "--config-file", str(path), SCRIPT]) == 2
    assert "is not valid YAML" in capsys.readouterr().err
    assert main(["launch", "--config-file", str(tmp_path / "none.yaml"), SCRIPT]) == 2
    assert "none.yaml' does not exist" in capsys.readouterr().err


# ---- launch: what the ranks receive ---------------------------------------------------------------------
def test_flags_override_config_file_which_overrides_defaults(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {
        "parallelism": {"dp_shard_size": 4, "tp_size": 2},
        "launch": {"nproc_per_node": 8, "mixed_precision": "fp16", "gradient_accumulation_steps": 4},
    })
    p = plan("--config-file", path, "--dp-shard-size", "2", "--nproc-per-node", "4", "--mixed-precision", "bf16",
             SCRIPT)
    assert p.nproc_per_node == 4
    assert p.env["NDPARALLEL_DP_SHARD_SIZE"] == "2" and p.env["NDPARALLEL_TP_SIZE"] == "2"  # flag, file
    assert p.env["NDPARALLEL_MIXED_PRECISION"] == "bf16"
    assert p.env["NDPARALLEL_GRADIENT_ACCUMULATION_STEPS"] == "4"
    assert "--nproc-per-node=4" in p.torchrun_args and "--standalone" in p.torchrun_args


def test_nproc_defaults_to_product_of_sizes_and_minus_one_is_resolved():
    p = plan("--dp-shard-size", "2", "--tp-size", "2", SCRIPT)
    assert p.nproc_per_node == 4
    p = plan("--nproc-per-node", "6", "--tp-size", "2", "--dp-shard-size", "-1", SCRIPT)
    assert p.env["NDPARALLEL_DP_SHARD_SIZE"] == "3"


def test_no_sizes_passes_none_and_drops_stale_size_variables(monkeypatch):
    monkeypatch.setenv("NDPARALLEL_TP_SIZE", "4")
    p = plan("--nproc-per-node", "2", SCRIPT)
    assert p.parallelism is None
    assert p.env["NDPARALLEL_TP_SIZE"] is None  # removed from the ranks' environment
    assert not [k for k, v in p.env.items() if k.endswith("_SIZE") and v is not None]
    assert any("ignoring NDPARALLEL_TP_SIZE" in w for w in p.warnings)
    # With sizes given, the stale variable is neither checked nor passed on.
    p = plan("--nproc-per-node", "2", "--dp-shard-size", "2", SCRIPT)
    assert p.env["NDPARALLEL_TP_SIZE"] == "1"


def test_module_multinode_and_unquoted_no(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {"launch": {"mixed_precision": False, "cpu": True}})  # `no` in YAML
    p = plan("--config-file", path, "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "head:29400",
             "-m", "pkg.train", "--lr", "1")
    assert p.env["NDPARALLEL_MIXED_PRECISION"] == "no" and p.env["NDPARALLEL_CPU"] == "1"
    # torchrun runs ndparallel's worker, which runs the module (as `python -m` would) once it is tied to the launcher.
    assert p.torchrun_args[-5:] == [WORKER, "-m", "pkg.train", "--lr", "1"]
    assert {"--master-addr=head", "--master-port=29400", "--node-rank=1", "--rdzv-conf=timeout=300"} <= \
        set(p.torchrun_args)
    assert p.rendezvous is not None and (p.rendezvous.nnodes, p.rendezvous.node_rank) == (2, 1)


def test_a_cpu_launch_tells_accelerate_and_transformers_it_runs_on_the_cpu():
    """As Accelerate's launcher does: ACCELERATE_USE_CPU, which transformers' TrainingArguments read to build a
    distributed CPU state (without it, a Trainer script given no --use_cpu takes every rank for a process of its own).
    A GPU launch leaves the variable alone."""
    assert plan("--cpu", "--nproc-per-node", "2", SCRIPT).env["ACCELERATE_USE_CPU"] == "true"
    if torch.cuda.is_available():
        assert "ACCELERATE_USE_CPU" not in plan("--nproc-per-node", "2", SCRIPT).env


def test_script_arguments_that_prefix_launcher_flags_go_to_the_script():
    """The Trainer's --fsdp (a prefix of the launcher's --fsdp_* flags) after SCRIPT is the script's, not an ambiguous
    abbreviation of a launcher flag."""
    args = build_parser().parse_args(["launch", "--nproc-per-node", "2", SCRIPT, "--fsdp", "full_shard",
                                      "--fsdp_version", "2", "--nproc", "4"])
    assert args.script_args == ["--fsdp", "full_shard", "--fsdp_version", "2", "--nproc", "4"]
    assert args.nproc_per_node == 2


def test_config_file_handlers_are_warned_about(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {"parallelism": {"cp_size": 2, "cp_handler": {"cp_comm_strategy": "ring"}}})
    p = plan("--config-file", path, SCRIPT)
    assert p.nproc_per_node == 2 and any("cp_handler is not passed" in w for w in p.warnings)


@pytest.mark.slow
def test_end_to_end_launch_passes_sizes_to_every_rank():
    result = run_cli("launch", "--nproc-per-node", "2", "--dp-shard-size", "2", "--gradient-accumulation-steps",
                     "2", SCRIPT, env={"NDPARALLEL_TP_SIZE": "4"})  # a stale size in the shell
    assert result.returncode == 0, result.stderr
    records = [json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert sorted(r["rank"] for r in records) == [0, 1]
    for r in records:
        assert r["world_size"] == 2
        assert r["sizes"] == {"pp_size": 1, "dp_replicate_size": 1, "dp_shard_size": 2, "cp_size": 1, "sp_size": 1,
                              "tp_size": 1}
        assert r["env"]["NDPARALLEL_GRADIENT_ACCUMULATION_STEPS"] == "2"
        if not torch.cuda.is_available():
            assert r["env"]["NDPARALLEL_CPU"] == "1"
    assert "2 process(es)" in result.stderr and "dp_shard(2)" in result.stderr


@pytest.mark.slow
def test_launch_exit_code_is_the_failed_ranks():
    result = run_cli("launch", "--nproc-per-node", "2", SCRIPT, "--fail-rank", "1", "--exit-code", "3")
    assert result.returncode == 3, result.stderr
    assert "rank 1 failed with exit code 3" in result.stderr


# ---- config ---------------------------------------------------------------------------------------------
def test_config_writes_a_file_that_launch_and_from_yaml_read(capsys, tmp_path):
    path = tmp_path / "sub" / "c.yaml"
    assert main(["config", "--config-file", str(path), "--dp-replicate-size", "2", "--dp-shard-size", "2",
                 "--mixed-precision", "bf16", "--cpu"]) == 0
    assert str(path) in capsys.readouterr().out
    pc = ParallelismConfig.from_yaml(path)
    assert (pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size, pc.sp_size) == (2, 2, 1, 1, 1)
    launch = yaml.safe_load(path.read_text())["launch"]
    assert launch == {"nproc_per_node": 4, "nnodes": 1, "mixed_precision": "bf16",
                      "gradient_accumulation_steps": 1, "cpu": True}
    p = plan("--config-file", str(path), SCRIPT)
    assert p.nproc_per_node == 4 and p.env["NDPARALLEL_DP_REPLICATE_SIZE"] == "2"


def test_config_without_flags_or_terminal_writes_defaults(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False)
    assert main(["config"]) == 0
    data = yaml.safe_load((tmp_path / "ndparallel_config.yaml").read_text())
    assert data["parallelism"] == {}  # no sizes: `launch` passes none, the script brings its own
    assert data["launch"]["nproc_per_node"] == 1 and data["launch"]["mixed_precision"] == "no"
    assert main(["config", "--nproc-per-node", "4"]) == 0  # plain data parallel on 4 processes
    assert plan("--config-file", "ndparallel_config.yaml", SCRIPT).nproc_per_node == 4


def test_config_prompts_on_a_terminal(monkeypatch, tmp_path):
    # pp, dp_replicate, dp_shard, cp, sp, tp (0 and "x" refused), ep, nnodes, nproc (3 refused), mixed precision
    # ("fp4" refused), gradient accumulation, cpu
    answers = iter(["", "", "2", "", "", "0", "x", "2", "", "", "3", "", "fp4", "bf16", "", "yes"])
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: next(answers))
    path = tmp_path / "c.yaml"
    assert main(["config", "--config-file", str(path)]) == 0
    data = yaml.safe_load(path.read_text())
    assert data["parallelism"]["dp_shard_size"] == 2 and data["parallelism"]["tp_size"] == 2
    assert data["launch"] == {"nproc_per_node": 4, "nnodes": 1, "mixed_precision": "bf16",
                              "gradient_accumulation_steps": 1, "cpu": True}


def test_config_checks_sizes_against_nproc(capsys, tmp_path):
    assert main(["config", "--config-file", str(tmp_path / "c.yaml"), "--nproc-per-node", "3", "--tp-size", "2"]) == 2
    assert "ndparallel config: error: tp(2) = 2 != world size 3" in capsys.readouterr().err
    assert not (tmp_path / "c.yaml").exists()


def test_ep_size_travels_from_flags_and_files_without_changing_the_process_count(tmp_path, capsys):
    """--ep-size is carved out of dp_shard x cp x sp: no factor of the process count, checked to divide it."""
    p = plan("--dp-shard-size", "4", "--ep-size", "2", SCRIPT)
    assert p.nproc_per_node == 4 and p.env["NDPARALLEL_EP_SIZE"] == "2"
    path = tmp_path / "c.yaml"
    assert main(["config", "--config-file", str(path), "--dp-shard-size", "4", "--ep-size", "2"]) == 0
    assert yaml.safe_load(path.read_text())["parallelism"]["ep_size"] == 2
    assert ParallelismConfig.from_yaml(path).ep_size == 2
    assert plan("--config-file", str(path), SCRIPT).env["NDPARALLEL_EP_SIZE"] == "2"
    assert main(["config", "--config-file", str(path), "--dp-shard-size", "2", "--ep-size", "4"]) == 2
    assert "ep_size=4 must divide the ranks the experts are split over, dp_shard(2)" in capsys.readouterr().err


# ---- env ------------------------------------------------------------------------------------------------
def test_env_text_and_json(capsys, monkeypatch):
    monkeypatch.setenv("NDPARALLEL_TP_SIZE", "2")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"torch: {torch.__version__}" in out and "gloo_available: True" in out
    assert "NDPARALLEL_TP_SIZE: 2" in out
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torch"] == torch.__version__ and report["env"] == {"NDPARALLEL_TP_SIZE": "2"}
    assert report["cuda_available"] == torch.cuda.is_available()
