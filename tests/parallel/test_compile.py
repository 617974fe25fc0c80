"""Compilation (`TorchDynamoPlugin`): regional (each block) and whole-model, under every layout, exact against the
single-process run, with no recompilation after the first step.

The tests compile with the ``aot_eager`` backend: Dynamo traces and AOT autograd splits forward and backward as with
inductor, without generating code (inductor's compile time on this CPU is the benchmark's business:
benchmarks/compile.py). The attention of CP/SP is kept out of the graph deliberately (a graph break), so those
layouts compile more graphs, once.
"""

from __future__ import annotations

import pytest
from torch import nn

from harness import assert_refused, outcomes, run_ranks
from test_parity import reference, run_layout

LAYOUTS = {
    "ddp2": (2, ["--dp-replicate-size", "2", "--no-fsdp-plugin"]), "fsdp2": (2, ["--dp-shard-size", "2"]),
    "hsdp2x2": (4, ["--dp-replicate-size", "2", "--dp-shard-size", "2"]),
    "tp2": (2, ["--tp-size", "2"]), "cp2_ring": (2, ["--cp-size", "2", "--cp-strategy", "ring"]),
    "sp2": (2, ["--sp-size", "2"]), "cp2_sp2": (4, ["--cp-size", "2", "--sp-size", "2"]),
}
CASES = [(layout, "regional") for layout in LAYOUTS] + [(layout, "whole") for layout in ("ddp2", "fsdp2", "cp2_ring")]


@pytest.mark.slow
@pytest.mark.parametrize("layout,how", CASES, ids=[f"{layout}-{how}" for layout, how in CASES])
def test_compiled_training_matches_and_never_recompiles(layout, how):
    world, flags = LAYOUTS[layout]
    extra = ["--dynamo-backend", "aot_eager"] + (["--regional-compilation"] if how == "regional" else [])
    result = run_layout("llama", world, flags, 1, *extra)[0]
    ref = reference("llama")
    diff = max(abs(a - b) for a, b in zip(result["losses"], ref["losses"]))
    assert diff <= 1e-5, f"{layout} ({how}): losses differ by {diff:.2e}"
    graphs = result["graphs"]  # graphs compiled so far, after each of the 6 steps
    assert graphs[0] > 0 and graphs == [graphs[0]] * len(graphs), f"{layout} ({how}): graphs per step {graphs}"


def _refusals() -> dict:
    from ndparallel import Accelerator, TorchDynamoPlugin

    def no_blocks():
        acc = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True))
        acc.prepare(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))

    return outcomes({
        "unknown-backend": lambda: TorchDynamoPlugin(backend="warp_speed"),
        "no-repeated-blocks": no_blocks,
    })


def test_bad_compile_settings_are_refused():
    results = run_ranks(_refusals, 1)
    assert_refused(results, ("ValueError", r"unknown dynamo backend 'warp_speed'; known: \[.*'aot_eager'"),
                   "unknown-backend")
    assert_refused(results, ("ValueError", r"use_regional_compilation=True\): Sequential has no repeated blocks .*"
                                           r"transformer_cls_names_to_wrap"), "no-repeated-blocks")


def _from_environment() -> dict:
    from ndparallel import Accelerator

    plugin = Accelerator()._settings.dynamo_plugin
    return {"backend": plugin.backend, "regional": plugin.use_regional_compilation}


def test_the_launchers_environment_turns_compilation_on():
    env = {"ACCELERATE_DYNAMO_BACKEND": "AOT_EAGER", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "true"}
    assert run_ranks(_from_environment, 1, env=env)[0] == {"backend": "aot_eager", "regional": True}
