"""Pipeline stages and saved weights: checkpoints that move between pipeline and other layouts, full weights of
every stage exported to one directory, pretrained weights loaded into the stages after the split. The training
layouts themselves are in test_pipeline.py."""

from __future__ import annotations

import os

import pytest
import torch

import checkpoint_train
from harness import run_ranks
from tiny_models import build_model

LAYERS = 4


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_checkpoints_move_between_pipeline_and_other_layouts(tmp_path, tied):
    """Saved under pp 2, resumed under pp 1 and under pp 2; saved under dp_shard 2, resumed under pp 2: each continues
    as the run that was never interrupted (a tied embedding and head too: its two copies save and load under their
    names). pp 2 -> pp 2 needs each stage's optimizer parameter groups: the optimizer state is written keyed by
    parameter (nested by group, the checkpoint kept one stage's groups, and the other stage lost its settings)."""
    base = ["--layers", str(LAYERS), "--steps", "6", *(["--tied"] if tied else [])]
    uninterrupted = run_ranks(checkpoint_train.main, 1, base)[0]["losses"]
    run_ranks(checkpoint_train.main, 2, [*base, "--pp-size", "2", "--save-at", "3", "--save-dir", str(tmp_path / "a")])
    resumed = run_ranks(checkpoint_train.main, 1, [*base, "--load", str(tmp_path / "a" / "step_3")])[0]["losses"]
    pp_to_pp = run_ranks(checkpoint_train.main, 2, [*base, "--pp-size", "2", "--load",
                                                    str(tmp_path / "a" / "step_3")])[0]["losses"]
    run_ranks(checkpoint_train.main, 2, [*base, "--dp-shard-size", "2", "--save-at", "3", "--save-dir",
                                         str(tmp_path / "b")])
    into_pp = run_ranks(checkpoint_train.main, 2, [*base, "--pp-size", "2", "--load",
                                                   str(tmp_path / "b" / "step_3")])[0]["losses"]
    for what, losses in (("pp2 -> pp1", resumed), ("pp2 -> pp2", pp_to_pp), ("dp_shard2 -> pp2", into_pp)):
        assert sorted(losses) == [4, 5, 6], what
        diff = max(abs(losses[k] - uninterrupted[k]) for k in losses)
        assert diff <= 1e-5, f"{what}: {diff:.2e} from the uninterrupted run"


@pytest.mark.slow
def test_a_pipeline_run_with_data_loader_workers_resumes_exactly(tmp_path):
    """pp 2 with the data loaded by 2 worker processes on each rank (every stage reads the batches): resumed from
    mid-epoch (step 2) and from the epoch's last step (4), the losses are the uninterrupted run's (the same layout:
    within 1e-6, fp32)."""
    base = ["--layers", str(LAYERS), "--steps", "6", "--pp-size", "2", "--workers", "2"]
    full = run_ranks(checkpoint_train.main, 2, [*base, "--save-at", "2", "4", "--save-dir", str(tmp_path)])[0]
    for point in (2, 4):
        resumed = run_ranks(checkpoint_train.main, 2, [*base, "--load", str(tmp_path / f"step_{point}")])[0]
        assert sorted(resumed["losses"]) == list(range(point + 1, 7))
        diff = max(abs(resumed["losses"][k] - full["losses"][k]) for k in resumed["losses"])
        assert diff <= 1e-6, f"from step {point}: {resumed['losses']} vs {full['losses']}"


def _load_under_pp(directory: str) -> tuple[str, str]:
    from ndparallel import CheckpointError

    try:
        checkpoint_train.main(["--layers", str(LAYERS), "--steps", "4", "--pp-size", "2", "--load", directory])
    except CheckpointError as exc:
        return type(exc).__name__, str(exc)
    return "loaded", ""


def test_a_nested_optimizer_state_saved_under_stages_is_refused_under_stages(tmp_path):
    """A checkpoint whose optimizer state is nested by parameter group (what earlier versions wrote, so its metadata
    names no `optimizer_layout`) holds one stage's groups: under pipeline stages it is refused, saying why and what
    to do, on every rank alike."""
    import json

    base = ["--layers", str(LAYERS), "--steps", "3", "--pp-size", "2"]
    run_ranks(checkpoint_train.main, 2, [*base, "--save-at", "3", "--save-dir", str(tmp_path)])
    meta_file = tmp_path / "step_3" / "ndparallel_checkpoint.json"
    meta = json.loads(meta_file.read_text())
    assert meta.pop("optimizer_layout") == "flat"
    meta_file.write_text(json.dumps(meta))
    outcomes = run_ranks(_load_under_pp, 2, str(tmp_path / "step_3"))
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == "CheckpointError", outcomes
    assert "one stage only" in outcomes[0][1] and "without pipeline stages" in outcomes[0][1]


def _export(directory: str, tied: bool) -> object:
    from ndparallel import Accelerator, ParallelismConfig

    accelerator = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, dp_shard_size=2))
    torch.manual_seed(0)
    model = build_model("llama", num_hidden_layers=LAYERS, tie_word_embeddings=tied)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    model = accelerator.prepare(model)
    accelerator.save_model(model, os.path.join(directory, "save_model"))
    accelerator.unwrap_model(model).save_pretrained(os.path.join(directory, "save_pretrained"))
    state = accelerator.get_state_dict(model)
    accelerator.wait_for_everyone()
    main = accelerator.is_main_process
    accelerator.end_training()
    if not main:
        return state == {}
    import transformers

    diffs = []
    for sub in ("save_model", "save_pretrained"):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(directory, sub)).state_dict()
        diffs.append(max((loaded[k] - expected[k]).abs().max().item() for k in expected))
    diffs.append(max((state[k] - expected[k]).abs().max().item() for k in expected))
    return diffs


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_full_weights_of_every_stage_export_to_one_directory(tmp_path, tied):
    results = run_ranks(_export, 4, str(tmp_path), tied)
    assert results[0] == [0.0, 0.0, 0.0] and results[1:] == [True] * 3


def _pretrained_after_split(directory: str, mode: str) -> float | None:
    import transformers

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig, init_empty_weights

    accelerator = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, dp_shard_size=2),
                              fsdp_plugin=FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True))
    if mode == "broadcast" and accelerator.is_main_process:  # rank 0 holds the weights, the others a meta model
        model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    else:  # every rank a meta model; each reads its stage's slices of the files
        with init_empty_weights():
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
        model.config.name_or_path = directory
    model = accelerator.prepare(model)
    state = accelerator.get_state_dict(model)
    accelerator.end_training()
    if not state:
        return None
    expected = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    assert state.keys() == expected.keys()
    return max((state[k] - expected[k]).abs().max().item() for k in expected)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["files", "broadcast"])
def test_pretrained_weights_load_into_pipeline_stages_after_splitting(tmp_path, mode):
    """cpu_ram_efficient_loading under pp2 x dp_shard2: every stage's weights arrive (read by each rank from the
    files, or broadcast from rank 0), and the gathered model equals the saved one."""
    torch.manual_seed(0)
    build_model("llama", num_hidden_layers=LAYERS).save_pretrained(tmp_path)
    results = run_ranks(_pretrained_after_split, 4, str(tmp_path), mode)
    assert results[0] == 0.0 and results[1:] == [None] * 3
