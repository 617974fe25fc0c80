"""benchmarks/long_context.py's settings and its planner side agree (parts 6 and 7 compare measured steps with
`predicted_step_peak`): every MemoryKwargs field a setting turns on is one the library accepts and the planner's
Recipe models with the same value, the planner counts the head chunks the ranks run, and the norm's chunk budget a
setting sets reaches the planner. Nothing is forked or measured here."""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import long_context as lc  # noqa: E402

from ndparallel import MemoryKwargs  # noqa: E402
from ndparallel.planner import Recipe  # noqa: E402

# Part 7's documented command (docs/long_context.md section 7)
ARGS = argparse.Namespace(hidden=256, layers=2, head_dim=16, heads=8, kv_heads=2, vocab=512, seq=8192, cap_mib=96,
                          max_seq=65536, step=128)
ALL = {**lc.SETTINGS, **lc.NORM_SETTINGS, **lc.feature_settings(ARGS.heads // 2)}


@pytest.mark.parametrize("name", list(ALL))
def test_each_settings_recipe_models_its_memory_kwargs(name):
    setting = ALL[name]
    kwargs = MemoryKwargs(**setting.fields)  # the library accepts them (and normalises them)
    _, layout, recipe = lc.planned(ARGS.seq, setting, ARGS)
    assert (layout.sp, layout.dp_shard) == ((2, 1) if setting.sp == 2 else (1, 2))
    assert recipe.offload == setting.offload and recipe.checkpointing and recipe.mixed_precision == "fp32"
    assert recipe.tiled_mlp == kwargs.tiled_mlp and recipe.mlp_tile == kwargs.mlp_tile_size
    assert recipe.fused_norms == kwargs.fused_rms_norm
    assert recipe.head_chunks == (kwargs.ulysses_head_chunks is not None)
    # the library's "auto" chunked loss is on for these Llama/Qwen2 models, as the Recipe's default is
    assert recipe.chunked_loss == (kwargs.chunked_loss in ("auto", True))


def test_a_field_the_planner_does_not_model_is_refused():
    setting = replace(lc.feature_settings(4)["llama sp2"], fields={"tiled_mlp": True, "not_modelled": 1})
    with pytest.raises(ValueError, match=r"no Recipe field models MemoryKwargs \['not_modelled'\]"):
        lc.planned(ARGS.seq, setting, ARGS)
    assert set(lc.RECIPE_FIELDS.values()) <= set(Recipe.__dataclass_fields__)


def test_the_planner_counts_the_head_chunks_the_ranks_run():
    """Part 7's ranks run an explicit count; the planner, asked for "auto" with no budget, must count the same (and a
    count it would not take raises instead of predicting another step)."""
    ulysses = importlib.import_module("ndparallel.parallel.sequence.ulysses")
    settings = lc.feature_settings(ARGS.heads // 2)
    for setting in settings.values():
        lc.predicted_step_peak(ARGS.seq, setting, ARGS)  # raises on a mismatch
    assert ulysses.HEAD_CHUNK_BYTES == 128 * 2**20  # restored
    with pytest.raises(ValueError, match="the planner counts 4 head chunks where the ranks run 2"):
        lc.predicted_step_peak(ARGS.seq, lc.feature_settings(2)["llama sp2 + head chunks (block)"], ARGS)
    for before, after, _ in lc.FEATURE_STEPS:
        assert before in settings and after in settings


def test_the_norms_chunk_budget_reaches_the_planner_and_is_restored():
    """At 8,192 tokens (4,096 a rank) the fused norm's one-chunk backward (4,096 x 3,076 B) is the largest buffer of
    the rebuilt layer in part 7's Llama base; over chunks of 1 MiB it is not, so the prediction falls."""
    rms_norm = importlib.import_module("ndparallel.parallel.memory.rms_norm")
    settings = lc.feature_settings(ARGS.heads // 2)
    base = lc.predicted_step_peak(ARGS.seq, settings["llama sp2"], ARGS)
    chunked = lc.predicted_step_peak(ARGS.seq, settings["llama sp2 + norm chunks"], ARGS)
    assert rms_norm.CHUNK_BYTES == 128 * 2**20
    one_chunk = 4096 * rms_norm.token_bytes(ARGS.hidden)
    assert base - chunked == pytest.approx(one_chunk - 4096 * (128 + 128 + 32 + 32) * 4)  # down to attention's
