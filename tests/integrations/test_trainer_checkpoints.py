"""Saving and resuming with the Hugging Face Trainer on ndparallel's layouts
(`ndparallel.integrations.trainer_checkpoints`).

Checkpoints written under one layout resume under another and log the uninterrupted run's losses; resuming continues
the epoch it stopped in, with data loader workers; ``load_best_model_at_end`` loads the best checkpoint; ``save_model``
writes weights plain transformers loads, also for a model transformers split on load; and a ``save_pretrained`` of
sharded weights on the main process only fails at once. Runs are compared as in test_trainer.py (its helpers), within
1e-5.
"""

from __future__ import annotations

import os

import pytest
import torch

import trainer_run
from harness import run_ranks
from ndparallel.launch.worker import attach_integrations
from test_trainer import GLOBAL_BATCH, TOL, assert_same_run, layout_env, merged_parameters, reference, run_layout


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


def test_load_best_model_at_end_loads_the_best_checkpoint(tmp_path, tmp_path_factory):
    """load_best_model_at_end: the parameters at the end are the best checkpoint's, as in one process. "Best" is the
    highest evaluation loss here, so it is not the last checkpoint (whose parameters the run ends with anyway)."""
    options = {"eval_steps": 2, "save_steps": 2, "extra": {"load_best_model_at_end": True, "greater_is_better": True,
                                                           "metric_for_best_model": "eval_loss"}}
    results = run_layout(tmp_path, {"dp_shard": 2}, **options)
    ref = reference(tmp_path_factory, **options)
    assert max(ref["eval_losses"]) != ref["eval_losses"][-1]
    assert_same_run(results, ref)


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
