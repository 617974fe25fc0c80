"""The Hugging Face Trainer and TRL's SFTTrainer on ndparallel's layouts (`ndparallel.integrations.trainer`).

Each layout runs an ordinary Trainer script (scripts/trainer_run.py, scripts/sft_run.py: nothing in them names
ndparallel) on forked ranks whose NDPARALLEL_* variables say the sizes, as ``ndparallel launch`` sets them, and is
compared with the same script in one process on the same global batch under stock Accelerate: the loss the Trainer
logged at every step, its gradient norms and evaluation losses, and the parameters after 6 steps. Labels are -100 on
a different number of positions in every sample, so ranks and micro-batches hold different numbers of loss tokens.
Tolerances: fp32, with gradients reduced in another order than one process sums them: 1e-5.

The other groups, which share this file's helpers: test_trainer_checkpoints.py (saving and resuming),
test_trainer_support.py (which transformers and Trainers are taken over, and what is refused), test_trainer_launch.py
(the example scripts, unmodified, under ``ndparallel launch``).
"""

from __future__ import annotations

import json
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
    assert got["accelerator"] == "ndparallel.integrations.trainer_accelerator"
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


@pytest.mark.slow
def test_ranks_reading_the_same_rows_as_different_dataset_classes_train_as_one_process(tmp_path, tmp_path_factory):
    """dp_shard 2, rank 1 reading the training rows as a datasets.Dataset (as loaded from rank 0's cache), rank 0 as
    the torch dataset that made them: prepare's agreement check compares the datasets' kind and length, not their
    class, and the run trains as one process does."""
    results = run_layout(tmp_path, {"dp_shard": 2}, cached_on=1)
    assert_same_run(results, reference(tmp_path_factory))


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
    assert results[0]["accelerator"] == "ndparallel.integrations.trainer_accelerator"
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


if __name__ == "__main__":
    print(f"wrote the Trainer table of {write_section('trainer', render_table(), 'tests/integrations/test_trainer.py')}")
