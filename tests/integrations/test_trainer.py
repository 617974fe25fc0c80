"""The Hugging Face Trainer and TRL's SFTTrainer on ndparallel's layouts (`ndparallel.integrations.trainer`).

Each layout runs an ordinary Trainer script (scripts/trainer_run.py, scripts/sft_run.py: nothing in them names
ndparallel) on forked ranks whose NDPARALLEL_* variables say the sizes, as ``ndparallel launch`` sets them, and is
compared with the same script in one process on the same global batch under stock Accelerate: the loss the Trainer
logged at every step, its gradient norms and evaluation losses, and the parameters after 6 steps. Labels are -100 on
a different number of positions in every sample, so ranks and micro-batches hold different numbers of loss tokens.
Tolerances: fp32, with gradients reduced in another order than one process sums them: 1e-5.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script (docs table regeneration): the import paths conftest.py gives pytest
    _tests = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(_tests), str(_tests / "scripts")]

import pytest  # noqa: E402
import torch  # noqa: E402

import sft_run  # noqa: E402
import trainer_run  # noqa: E402
from harness import run_ranks  # noqa: E402
from ndparallel.launch.worker import attach_integrations  # noqa: E402
from readme_sections import read_section, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GLOBAL_BATCH = 4
TOL = 1e-5

_references: dict[tuple, dict] = {}


def layout_env(**sizes: int) -> dict[str, str]:
    """What `ndparallel launch --<axis>-size N` gives each rank."""
    return {f"NDPARALLEL_{axis.upper()}_SIZE": str(size) for axis, size in sizes.items()}


def world(**sizes: int) -> int:
    out = 1
    for size in sizes.values():
        out *= size
    return out


def batch_ranks(**sizes: int) -> int:
    return sizes.get("dp_replicate", 1) * sizes.get("dp_shard", 1)


def train_job(output_dir: str, kwargs: dict) -> dict:
    attach_integrations()  # what ndparallel's launcher does in each rank before the script
    return trainer_run.train(output_dir, **kwargs)


def reference(tmp_path_factory, **kwargs) -> dict:
    """The same Trainer script in one process (stock Accelerate) on the same global batch; cached."""
    key = json.dumps(kwargs, sort_keys=True)
    if key not in _references:
        out = str(tmp_path_factory.mktemp("reference"))
        _references[key] = run_ranks(train_job, 1, out, {"per_device": GLOBAL_BATCH, **kwargs})[0]
    return _references[key]


def run_layout(tmp_path, sizes: dict[str, int], **kwargs) -> list[dict]:
    per_device = GLOBAL_BATCH // batch_ranks(**sizes)
    return run_ranks(train_job, world(**sizes), str(tmp_path), {"per_device": per_device, **kwargs},
                     env=layout_env(**sizes), timeout=600)


def merged_parameters(results: list[dict]) -> dict[str, torch.Tensor]:
    """Every parameter once (pipeline stages hold different ones)."""
    out: dict[str, torch.Tensor] = {}
    for result in results:
        out.update(result["params"])
    return out


def assert_same_run(results: list[dict], ref: dict) -> None:
    got = results[0]
    assert got["accelerator"] == "ndparallel.integrations.trainer"
    assert ref["accelerator"] == "accelerate.accelerator"
    assert len(got["losses"]) == len(ref["losses"]) == 6
    for name in ("losses", "grad_norms", "eval_losses", "epochs"):
        assert len(got[name]) == len(ref[name])
        diff = max((abs(a - b) for a, b in zip(got[name], ref[name])), default=0.0)
        assert diff < TOL, (name, got[name], ref[name])
    params = merged_parameters(results)
    assert params.keys() == ref["params"].keys()
    diff = max((params[k] - ref["params"][k]).abs().max().item() for k in params)
    assert diff < TOL, diff
    initial = trainer_run.initial_parameters()
    moved = max((ref["params"][k] - initial[k]).abs().max().item() for k in params)
    assert moved > 1e-3  # the run trained: a comparison of untouched weights would prove nothing


def describe(sizes: dict[str, int]) -> str:
    return " x ".join(f"{axis} {size}" for axis, size in sizes.items())


# The matrix, as data: docs/trainer.md's table (<!-- trainer:start -->) is rendered from it (`render_table`).
LAYOUTS = [  # (sizes, options of trainer_run.train, slow)
    ({"dp_shard": 2}, {}, False),
    ({"tp": 2}, {}, False),
    ({"cp": 2}, {}, False),
    ({"sp": 2}, {}, False),
    ({"cp": 2}, {"loss_kwargs": False}, True),
    ({"sp": 2}, {"loss_kwargs": False}, True),
    ({"pp": 2}, {}, False),
    ({"dp_shard": 2}, {"accumulation": 2}, False),
    ({"dp_shard": 2}, {"accumulation": 2, "average_tokens": False}, False),
    ({"cp": 2}, {"accumulation": 2}, False),  # the Trainer draws a window's batches before its first micro-step
    ({"dp_shard": 2}, {"resets_state": True}, True),
    ({"cp": 2}, {"resets_state": True}, True),
    ({"dp_replicate": 2, "dp_shard": 2}, {}, True),
    ({"cp": 2, "sp": 2}, {}, True),
    ({"cp": 2, "sp": 2}, {"loss_kwargs": False}, True),
    ({"dp_shard": 2, "tp": 2}, {}, True),
    ({"pp": 2, "dp_shard": 2}, {"accumulation": 2}, True),
]
SFT_CASES = [  # (sizes, SFTConfig fields, what the rows are, slow)
    ({"dp_shard": 2}, {}, "padded", False),
    ({"cp": 2}, {}, "padded", False),
    ({"cp": 2}, {"padding_free": True, "max_length": None}, "padding-free", False),
    ({"sp": 2}, {"packing": True}, "packed (`packing=True`)", False),
    ({"sp": 2}, {"padding_free": True, "max_length": None}, "padding-free", False),
    ({"cp": 2, "sp": 2}, {"padding_free": True, "max_length": None}, "padding-free", True),
    ({"tp": 2}, {"lora": True}, "padded; LoRA on every projection (`peft_config`)", False),
]


def _param(values: tuple, slow: bool, name: str):
    return pytest.param(*values, id=name, marks=[pytest.mark.slow] if slow else [])


def _options(options: dict) -> str:
    words = {"accumulation": "gradient accumulation {}", "average_tokens": "average_tokens_across_devices={}",
             "loss_kwargs": "the model takes no `num_items_in_batch` (`accepts_loss_kwargs = False`): no token count",
             "resets_state": "a Trainer subclass that resets Accelerate's state before its Accelerator is built and "
                             "writes `state._shared_state` (as Axolotl's)"}
    return ", ".join(words[k].format(v) for k, v in options.items()) or "-"


def render_table() -> str:
    lines = [
        "Tested (`tests/integrations/test_trainer.py`, which holds this table as data; `python tests/integrations/test_trainer.py` rewrites it): "
        "each run's logged loss at every step, its gradient norms and evaluation losses, and the parameters after "
        "6 steps (the SFTTrainer: its 4 logged losses) equal the same script's in one process under stock "
        "Accelerate on the same global batch within 1e-5, with `-100` labels on a different number of positions in "
        "every sample.",
        "",
        "| trainer | layout | ranks | options / rows |",
        "|---|---|---|---|",
    ]
    lines += [f"| Trainer | {describe(sizes)} | {world(**sizes)} | {_options(options)} |"
              for sizes, options, _ in LAYOUTS]
    lines += [f"| SFTTrainer | {describe(sizes)} | {world(**sizes)} | {rows} |" for sizes, _, rows, _ in SFT_CASES]
    return "\n".join(lines)


def test_readme_table_is_rendered_from_the_matrix():
    assert read_section("trainer", "tests/integrations/test_trainer.py") == render_table(), \
        "docs/trainer.md's table is stale: run `python tests/integrations/test_trainer.py`"


@pytest.mark.parametrize("sizes,options", [_param((sizes, options), slow, describe(sizes) + "-" + _options(options))
                                           for sizes, options, slow in LAYOUTS])
def test_the_trainer_trains_as_one_process(tmp_path, tmp_path_factory, sizes, options):
    results = run_layout(tmp_path, sizes, eval_steps=3, **options)
    ref = reference(tmp_path_factory, eval_steps=3, **{k: v for k, v in options.items() if k != "average_tokens"})
    assert_same_run(results, ref)


@pytest.mark.parametrize("sizes", [{"dp_shard": 2}, {"cp": 2}], ids=["dp_shard2", "cp2"])
def test_predict_and_compute_metrics_give_one_process_metrics(tmp_path, tmp_path_factory, sizes):
    """predict() with compute_metrics: logits and labels gathered over the batch ranks, whole rows under cp."""
    results = run_layout(tmp_path, sizes, steps=2, predict=True)
    ref = reference(tmp_path_factory, steps=2, predict=True)
    for key in ("test_loss", "test_accuracy", "test_logit_mean"):
        for result in results:  # every rank reports the metrics
            assert abs(result["predict"][key] - ref["predict"][key]) < TOL, (key, result["predict"], ref["predict"])


def test_fused_adamw_trains_under_tensor_parallelism(tmp_path, tmp_path_factory):
    """The Trainer's adamw_torch_fused with tensor parallelism alone (sharded linears, plain norms: one fused call
    would mix DTensors and tensors)."""
    results = run_layout(tmp_path, {"tp": 2}, optim="adamw_torch_fused")
    assert_same_run(results, reference(tmp_path_factory, optim="adamw_torch_fused"))


def test_checkpoints_resume_exactly_into_another_layout(tmp_path, tmp_path_factory):
    """save_steps with save_total_limit under dp_shard 2, each save after an evaluation (eval_steps = save_steps), then
    resume_from_checkpoint under tp 2: the resumed run logs the uninterrupted run's losses; save_model writes a
    directory plain transformers loads with the trained weights."""
    first = tmp_path / "first"
    full = run_layout(first, {"dp_shard": 2}, save_steps=2, eval_steps=2, extra={"save_total_limit": 2},
                      save_to=str(tmp_path / "hf"))
    assert sorted(p.name for p in first.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-4",
                                                                                           "checkpoint-6"]
    second = tmp_path / "second"
    second.mkdir()
    os.symlink(first / "checkpoint-4", second / "checkpoint-4")
    resumed = run_layout(second, {"tp": 2}, save_steps=2, eval_steps=2, resume=str(second / "checkpoint-4"))
    assert len(resumed[0]["losses"]) == 6
    assert max(abs(a - b) for a, b in zip(full[0]["losses"], resumed[0]["losses"])) < TOL
    params = merged_parameters(resumed)
    assert max((params[k] - full[0]["params"][k]).abs().max().item() for k in params) < TOL

    from transformers import AutoModelForCausalLM

    loaded = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "hf").named_parameters())
    assert loaded.keys() == full[0]["params"].keys()
    assert all(torch.equal(loaded[k].detach(), full[0]["params"][k]) for k in loaded)


def test_resume_with_data_loader_workers_continues_the_epoch_it_stopped_in(tmp_path, tmp_path_factory):
    """dataloader_num_workers=2 under dp_shard 2, 12 samples (epochs of 3 steps), a checkpoint every 2 steps: the run
    equals one process under stock Accelerate, and resume_from_checkpoint from the middle of epoch 0 (step 2) and of
    epoch 1 (step 4: the Trainer skips the batch taken, then sets the epoch) logs its losses."""
    options = {"samples": 12, "extra": {"dataloader_num_workers": 2}}
    first = tmp_path / "first"
    full = run_layout(first, {"dp_shard": 2}, save_steps=2, **options)
    assert_same_run(full, reference(tmp_path_factory, **options))
    for step in (2, 4):
        resumed = run_layout(tmp_path / f"from_{step}", {"dp_shard": 2}, resume=str(first / f"checkpoint-{step}"),
                             **options)
        assert len(resumed[0]["losses"]) == 6
        assert max(abs(a - b) for a, b in zip(full[0]["losses"], resumed[0]["losses"])) < TOL, \
            (step, resumed[0]["losses"], full[0]["losses"])


@pytest.mark.slow
def test_ranks_reading_the_same_rows_as_different_dataset_classes_train_as_one_process(tmp_path, tmp_path_factory):
    """dp_shard 2, rank 1 reading the training rows as a datasets.Dataset (as loaded from rank 0's cache), rank 0 as
    the torch dataset that made them: prepare's agreement check compares the datasets' kind and length, not their
    class, and the run trains as one process does."""
    results = run_layout(tmp_path, {"dp_shard": 2}, cached_on=1)
    assert_same_run(results, reference(tmp_path_factory))


def test_load_best_model_at_end_loads_the_best_checkpoint(tmp_path, tmp_path_factory):
    """load_best_model_at_end: the parameters at the end are the best checkpoint's, as in one process. "Best" is the
    highest evaluation loss here, so it is not the last checkpoint (whose parameters the run ends with anyway)."""
    options = {"eval_steps": 2, "save_steps": 2, "extra": {"load_best_model_at_end": True, "greater_is_better": True,
                                                           "metric_for_best_model": "eval_loss"}}
    results = run_layout(tmp_path, {"dp_shard": 2}, **options)
    ref = reference(tmp_path_factory, **options)
    assert max(ref["eval_losses"]) != ref["eval_losses"][-1]
    assert_same_run(results, ref)


def sft_job(output_dir: str, per_device: int, config: dict) -> dict:
    attach_integrations()
    return sft_run.sft(output_dir, per_device=per_device, **config)


@pytest.mark.parametrize("sizes,config", [_param((sizes, config), slow, f"{describe(sizes)}-{rows}")
                                          for sizes, config, rows, slow in SFT_CASES])
def test_sft_trainer_trains_as_one_process(tmp_path, sizes, config):
    """TRL's SFTTrainer: padded rows, packed rows (packing=True) and padding-free rows (documents flattened into one
    row, positions restarting; TRL's flash-attention fields checked against them and dropped)."""
    results = run_ranks(sft_job, world(**sizes), str(tmp_path / "run"), 2 // batch_ranks(**sizes) or 1, config,
                        env=layout_env(**sizes), timeout=600)
    ref = run_ranks(sft_job, 1, str(tmp_path / "ref"), 2, config)[0]
    assert results[0]["accelerator"] == "ndparallel.integrations.trainer"
    assert len(results[0]["losses"]) == len(ref["losses"]) == 4
    assert max(abs(a - b) for a, b in zip(results[0]["losses"], ref["losses"])) < TOL, (results[0], ref)


def test_sft_packing_under_context_parallelism_is_refused_by_trl_or_trains_as_one_process(tmp_path):
    """TRL >= 1.11 refuses packing=True with cp > 1 for Accelerate's sake (its context parallelism drops the mask);
    with ndparallel padding_free=True is the route (above), and the refusal still comes before any step. TRL 1.9 and
    1.10 let it through: ndparallel keeps the packed documents apart (it reads them from position_ids), so the run
    trains as one process does."""
    import trl
    from packaging.version import Version

    if Version(trl.__version__) >= Version("1.11"):
        with pytest.raises(AssertionError, match="Packing is not compatible with context parallelism"):
            run_ranks(sft_job, 2, str(tmp_path), 2, {"packing": True}, env=layout_env(cp=2), timeout=300)
        return
    results = run_ranks(sft_job, 2, str(tmp_path / "run"), 2, {"packing": True}, env=layout_env(cp=2), timeout=600)
    ref = run_ranks(sft_job, 1, str(tmp_path / "ref"), 2, {"packing": True})[0]
    assert len(results[0]["losses"]) == len(ref["losses"]) == 4
    assert max(abs(a - b) for a, b in zip(results[0]["losses"], ref["losses"])) < TOL, (results[0], ref)


def stock_accelerator(_: int) -> str:
    attach_integrations()
    from accelerate import Accelerator

    try:
        Accelerator(cpu=True)
    except RuntimeError as exc:
        return str(exc)
    return "built"


def test_a_plain_accelerate_accelerator_is_refused_when_the_launch_has_sizes():
    """Never silently something else: under `ndparallel launch --cp-size 2`, accelerate's Accelerator would train
    plain data parallelism; every rank refuses it, before any collective, saying what to do."""
    for message in run_ranks(stock_accelerator, 2, 0, env=layout_env(cp=2), timeout=120):
        assert message.startswith("ndparallel launch was asked for cp(2), but this script builds accelerate's "
                                  "Accelerator"), message
        assert "from ndparallel import Accelerator" in message


def opted_in(output_dir: str) -> dict:
    import ndparallel  # noqa: F401 -- the script names ndparallel's config, so it imports ndparallel
    from ndparallel import ParallelismConfig

    return trainer_run.train(output_dir, per_device=GLOBAL_BATCH,
                             extra={"parallelism_config": ParallelismConfig(cp_size=2)})


def test_an_ndparallel_parallelism_config_in_training_arguments_opts_in(tmp_path, tmp_path_factory):
    """TrainingArguments(parallelism_config=ndparallel.ParallelismConfig(...)) under a launcher that passes no sizes
    (torchrun, accelerate launch): the Trainer is taken over all the same."""
    results = run_ranks(opted_in, 2, str(tmp_path), timeout=600)
    assert_same_run(results, reference(tmp_path_factory))


def test_older_transformers_are_refused_newer_ones_warned_about():
    """The version policy: older than the floor is refused with it; a patch or pre-release of a tested minor is
    tested; a newer minor (or major) than the newest tested gives a warning that names the tested range."""
    from ndparallel.integrations.trainer import TESTED_TRANSFORMERS, check_version

    oldest, newest = TESTED_TRANSFORMERS
    for version in ("5.15.1", "5.15.99", "4.57.0"):
        with pytest.raises(RuntimeError, match=rf"needs transformers >= {oldest} \(tested: {oldest} to {newest}\), "
                                               rf"but transformers {version} is installed"):
            check_version(version)
    for version in ("5.16.0", "5.16.1", "5.20.2", "5.24.0", "5.25.0", "5.25.3", "5.25.0rc1"):
        assert check_version(version) is None, version
    for version in ("5.26.0", "5.26.0.dev0", "6.0.0"):
        warning = check_version(version)
        assert warning is not None and f"transformers {version} is newer than any" in warning
        assert f"({oldest} to {newest})" in warning and "pip install 'transformers<5.26'" in warning


def _fake_transformers_trainer(**methods):
    """A stand-in for ``transformers.trainer`` whose Trainer has the hooked methods with the expected parameters,
    but where `methods` says otherwise (None: the method is gone)."""
    import types

    from ndparallel.integrations.trainer import HOOKS
    from ndparallel.integrations.trainer_versions import EXPECTED_PARAMETERS

    assert HOOKS.keys() == EXPECTED_PARAMETERS.keys()  # every replaced method is checked, and only those

    def stand_in(parameters):
        namespace: dict = {}
        exec(f"def method({', '.join(parameters)}): return 'original'", namespace)  # noqa: S102
        return namespace["method"]

    body = {name: stand_in(expected) for name, expected in EXPECTED_PARAMETERS.items()}
    body["__init__"] = lambda self, args: setattr(self, "args", args)
    for name, parameters in methods.items():
        if parameters is None:
            del body[name]
        else:
            body[name] = stand_in(parameters)
    module = types.ModuleType("transformers.trainer")
    module.Trainer = type("Trainer", (), body)
    module.Accelerator = object
    module.skip_first_batches = stand_in(("dataloader", "num_batches"))
    return module


def test_a_hook_that_is_gone_or_changed_is_refused_by_name_when_a_layout_is_asked_for():
    """Capability, not version number: where a hooked method is gone or takes other parameters, nothing is replaced,
    and a Trainer asked for a layout is refused naming each; without a layout it runs as transformers made it."""
    import types

    from ndparallel import ParallelismConfig
    from ndparallel.integrations.trainer import hook_problems, install

    assert hook_problems(_fake_transformers_trainer()) == []
    module = _fake_transformers_trainer(_get_num_items_in_batch=None, _wrap_model=("self", "model", "training"))
    assert hook_problems(module) == [
        "Trainer._get_num_items_in_batch is gone",
        "Trainer._wrap_model takes (self, model, training), where the integration was written for "
        "(self, model, training, dataloader)"]
    install(module)
    assert module.Trainer.save_model(None, None, False) == "original"  # nothing replaced
    with pytest.raises(RuntimeError, match=r"cannot take over this Trainer \(transformers .*\): Trainer\."
                                           r"_get_num_items_in_batch is gone; Trainer\._wrap_model takes"):
        module.Trainer(types.SimpleNamespace(parallelism_config=ParallelismConfig(cp_size=2))
                       ).create_accelerator_and_postprocess()
    plain = module.Trainer(types.SimpleNamespace(parallelism_config=None))
    assert plain.create_accelerator_and_postprocess() == "original"


def test_a_trainer_subclass_that_bypasses_a_hook_is_refused_by_name():
    """TRL's trainers, Axolotl's and users' subclasses: an override that calls the Trainer's own keeps the hook (TRL's
    GRPOTrainer._load_optimizer_and_scheduler does); one that does not would silently bypass it, and is refused."""
    import transformers.trainer as module

    from ndparallel.integrations.trainer import check_support

    attach_integrations()

    class KeepsTheHook(module.Trainer):
        def save_model(self, output_dir=None, _internal_call=False):
            return super().save_model(output_dir, _internal_call)

    class Bypasses(KeepsTheHook):
        def _load_optimizer_and_scheduler(self, checkpoint):
            return None

    assert check_support(object.__new__(KeepsTheHook), module) is None
    with pytest.raises(RuntimeError, match=r"test_trainer\..*Bypasses\._load_optimizer_and_scheduler overrides it "
                                           r"without calling the Trainer's own"):
        check_support(object.__new__(Bypasses), module)


def test_a_hook_another_library_replaced_on_the_trainer_is_refused_by_name(monkeypatch):
    """A library that assigns its own method to ``Trainer`` after ndparallel attached (Axolotl's ``patch_prepare_cp``
    empties ``_prepare_context_parallel_inputs``) would silently take the layout's step away: refused, naming it."""
    import transformers.trainer as module

    from ndparallel.integrations.trainer import check_support

    attach_integrations()
    assert check_support(object.__new__(module.Trainer), module) is None

    def _prepare_context_parallel_inputs(self, model, inputs):
        return contextlib.nullcontext, inputs

    monkeypatch.setattr(module.Trainer, "_prepare_context_parallel_inputs", _prepare_context_parallel_inputs)
    with pytest.raises(RuntimeError, match=r"Trainer\._prepare_context_parallel_inputs was replaced after ndparallel "
                                           r"attached \(by test_trainer\..*_prepare_context_parallel_inputs\)"):
        check_support(object.__new__(module.Trainer), module)


def newer_transformers_than_tested(output_dir: str) -> dict:
    """A Trainer run under a transformers that says it is newer than any tested: the warnings each rank gave."""
    import warnings

    import transformers

    transformers.__version__ = "5.99.0"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = train_job(output_dir, {"per_device": GLOBAL_BATCH // 2})
    out["warnings"] = [str(w.message) for w in caught if "is newer than any" in str(w.message)]
    return out


@pytest.mark.slow
def test_a_newer_transformers_than_tested_runs_with_one_warning_on_the_main_process(tmp_path, tmp_path_factory):
    results = run_ranks(newer_transformers_than_tested, 2, str(tmp_path), env=layout_env(dp_shard=2), timeout=600)
    assert [len(result["warnings"]) for result in results] == [1, 0]
    assert "transformers 5.99.0 is newer than any" in results[0]["warnings"][0]
    assert_same_run(results, reference(tmp_path_factory))


def launched(tmp_path: Path, name: str, launcher: list[str], script: str, *flags: str,
             use_cpu: bool = True) -> tuple[list[dict], str]:
    """Run an example script as a user would; return the Trainer's log history (trainer_state.json) and what the run
    printed."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NDPARALLEL_", "RANK", "WORLD_SIZE", "MASTER_", "ACCELERATE_"))}
    out = tmp_path / name
    proc = subprocess.run([*launcher, str(ROOT / "examples" / script), "--output_dir", str(out),
                           *(["--use_cpu"] if use_cpu else []), "--report_to", "none", "--logging_steps", "1",
                           "--disable_tqdm", "true", *flags],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "trainer_state.json").read_text())["log_history"], proc.stdout


def launched_history(tmp_path: Path, name: str, launcher: list[str], script: str, *flags: str) -> list[dict]:
    return launched(tmp_path, name, launcher, script, *flags)[0]


def losses_of(history: list[dict]) -> list[float]:
    return [entry["loss"] for entry in history if "loss" in entry]


LAUNCH = [sys.executable, "-m", "ndparallel.cli", "launch", "--nproc-per-node", "2"]


def test_an_unmodified_trainer_script_under_ndparallel_launch(tmp_path):
    """examples/trainer_clm.py, launched with --cp-size 2 and no change to the script, against `python` of it."""
    flags = ["--max_steps", "4", "--per_device_train_batch_size", "4"]
    one = launched_history(tmp_path, "one", [sys.executable], "trainer_clm.py", *flags)
    cp = launched_history(tmp_path, "cp", [*LAUNCH, "--cp-size", "2"], "trainer_clm.py", *flags)
    assert len(losses_of(cp)) == len(losses_of(one)) == 4
    assert max(abs(a - b) for a, b in zip(losses_of(cp), losses_of(one))) < TOL
    assert abs(cp[-1]["eval_loss"] - one[-1]["eval_loss"]) < TOL


@pytest.mark.slow
def test_a_cpu_launch_without_use_cpu_logs_once_from_the_main_process(tmp_path):
    """`ndparallel launch --cpu` of examples/trainer_clm.py without --use_cpu, with the Trainer's --fsdp: the Trainer
    knows it runs distributed (the launcher exports ACCELERATE_USE_CPU, as Accelerate's does), so --fsdp is accepted
    and only the main process logs -- each step's loss once, the one process's loss on the same global batch."""
    flags = ["--max_steps", "3", "--per_device_train_batch_size", "4"]
    one = launched_history(tmp_path, "one", [sys.executable], "trainer_clm.py", *flags)
    history, printed = launched(tmp_path, "fsdp", [*LAUNCH, "--cpu", "--dp-shard-size", "2"], "trainer_clm.py",
                                "--max_steps", "3", "--per_device_train_batch_size", "2", "--fsdp", "full_shard",
                                use_cpu=False)
    logged = [line for line in printed.splitlines() if line.startswith("{'loss'")]
    assert len(logged) == len(losses_of(history)) == len(losses_of(one)) == 3, printed
    assert max(abs(a - b) for a, b in zip(losses_of(history), losses_of(one))) < TOL
    assert [entry["epoch"] for entry in history if "loss" in entry] == [entry["epoch"] for entry in one
                                                                         if "loss" in entry]


def test_an_unmodified_sft_script_under_ndparallel_launch(tmp_path):
    """examples/sft.py with --packing, launched with --sp-size 2, against `python` of it."""
    flags = ["--max_steps", "3", "--per_device_train_batch_size", "2", "--bf16", "false", "--packing",
             "--max_length", "64"]
    one = launched_history(tmp_path, "one", [sys.executable], "sft.py", *flags)
    sp = launched_history(tmp_path, "sp", [*LAUNCH, "--sp-size", "2"], "sft.py", *flags)
    assert len(losses_of(sp)) == len(losses_of(one)) == 3
    assert max(abs(a - b) for a, b in zip(losses_of(sp), losses_of(one))) < TOL


def trained_from_a_split_load(path: str, output_dir: str, split: bool) -> dict:
    """A Trainer on a model loaded as Accelerate's example and Axolotl load it under tensor parallelism:
    ``from_pretrained(tp_plan="auto")`` (transformers splits it on a mesh of its own); then save_model."""
    attach_integrations()
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments
    from tiny_models import TokenDataset

    args = TrainingArguments(output_dir=output_dir, max_steps=3, per_device_train_batch_size=GLOBAL_BATCH,
                             learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True)
    model = LlamaForCausalLM.from_pretrained(path, **({"tp_plan": "auto"} if split else {}))
    torch.manual_seed(0)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(12, 16, uneven_labels=True))
    trainer.train()
    trainer.save_model(os.path.join(output_dir, "saved"))
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "params": trainer_run.full_parameters(trainer.model)}


@pytest.mark.slow
def test_a_model_transformers_split_on_load_trains_and_saves_under_tp(tmp_path):
    """from_pretrained(tp_plan="auto") under tp 2: prepare gathers the model and splits it again on ndparallel's mesh,
    clearing what records transformers' split (config.distributed_config), so save_model -- the main process writes
    -- does not end in a barrier no other rank joins. The losses are one process's, the saved weights the trained ones,
    loadable by plain transformers."""
    from tiny_models import build_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    build_model("llama").save_pretrained(tmp_path / "init")
    ref = run_ranks(trained_from_a_split_load, 1, str(tmp_path / "init"), str(tmp_path / "ref"), False)[0]
    got = run_ranks(trained_from_a_split_load, 2, str(tmp_path / "init"), str(tmp_path / "tp"), True,
                    env=layout_env(tp=2), timeout=120)[0]
    assert len(got["losses"]) == len(ref["losses"]) == 3
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) < TOL, (got["losses"], ref["losses"])
    saved = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "tp" / "saved").named_parameters())
    assert "distributed_config" not in (tmp_path / "tp" / "saved" / "config.json").read_text()
    assert saved.keys() == got["params"].keys()
    assert max((saved[k].detach() - got["params"][k]).abs().max().item() for k in saved) == 0
    assert max((got["params"][k] - ref["params"][k]).abs().max().item() for k in saved) < TOL


def saved_on_the_main_process_only(output_dir: str) -> tuple[str, float]:
    """The idiom of a script written for plain DDP, where every rank holds the whole model: the error, and the seconds
    from the save (or the wait) to it."""
    import time

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
    from tiny_models import build_model

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2),
                      fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = acc.prepare(build_model())
    started = time.perf_counter()
    try:
        if acc.is_main_process:
            acc.unwrap_model(model).save_pretrained(output_dir)
        acc.wait_for_everyone()
    except TimeoutError as exc:
        return str(exc), time.perf_counter() - started
    return "no error", time.perf_counter() - started


def test_save_pretrained_on_the_main_process_only_fails_at_once_naming_it(tmp_path):
    """Item 6: sharded weights make save_pretrained collective. Called under `if is_main_process:` it fails on
    every rank as soon as the others reach their next collective call -- here wait_for_everyone -- instead of
    waiting out the timeout."""
    for message, seconds in run_ranks(saved_on_the_main_process_only, 2, str(tmp_path / "model"), timeout=120):
        # At once: this is the message of a mismatch seen on arrival (a rank that waited out the timeout says "not
        # every rank arrived within"), and the call ended far within the timeout (10 minutes here) -- timed inside
        # the rank, from the call on, so neither the forks, imports and prepare() of a loaded machine nor how late
        # it is there count.
        assert "the ranks reached different collective calls" in message, message
        assert seconds < 60, f"{seconds:.0f} s: it waited for something (the timeout is 10 minutes)"
        assert "'save_pretrained' / 'wait_for_everyone'" in message
        assert "call it on every rank" in message


if __name__ == "__main__":
    print(f"wrote the Trainer table of {write_section('trainer', render_table(), 'tests/integrations/test_trainer.py')}")
