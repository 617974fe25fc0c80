"""Expert parallelism for each mixture-of-experts family under each layout, against the single-process reference --
and the expert-parallel table of docs/expert_parallel.md, rendered from the same matrix.

`CASES` is the matrix: a tiny model of each family (tests/scripts/tiny_models.py) under ep 2, ep 4, ep 2 with the
experts sharded over 2 more ranks (dp_shard 4), ep 2 x tp 2, ep 2 x cp 2, ep 2 x sp 2, pp 2 x ep 2 and ep 2 with
gradient accumulation 2. A case trains 6 AdamW steps with clipping through the Accelerate-style script and matches
the reference's per-step losses within 1e-5 (fp32: reduce-scatters, all-to-alls regrouping rows and split matmuls
round differently), or is refused on every rank with the error given. With accumulation the reference is one process
accumulating the same micro-batches (`reference_run(mean_of_chunks=2)`): a load-balancing loss is not linear in the
tokens, so it is the micro-step's, as in one process (`ndparallel.parallel.moe`).

AdamW's update hardly depends on the gradient's scale, so losses alone would not see an expert gradient off by a
factor (such as ep): `test_sgd_trains_the_single_process_parameters` compares SGD-trained parameters (1e-6), and
`test_the_parameter_check_catches_an_expert_gradient_off_by_ep` shows it fails when the experts' gradient is not
divided by ep. `python tests/parallel/experts/test_expert_parallel.py` rewrites that table from `CASES`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # run as a script (docs table regeneration): the import paths conftest.py gives pytest
    _tests = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(_tests), str(_tests / "parallel"), str(_tests / "scripts")]

import pytest  # noqa: E402
import torch  # noqa: E402

import accelerate_style  # noqa: E402
from harness import assert_refused, outcomes, run_ranks  # noqa: E402
from readme_sections import read_section, write_section  # noqa: E402
from test_parity import GLOBAL_BATCH, data_parallel_size, reference, run_layout  # noqa: E402
from ndparallel.models.families import FAMILIES  # noqa: E402

LAYOUTS = {  # id -> (column title, world size, flags of tests/scripts/accelerate_style.py, accumulation steps)
    "ep2": ("EP 2", 2, ["--dp-shard-size", "2", "--ep-size", "2"], 1),
    "ep4": ("EP 4", 4, ["--dp-shard-size", "4", "--ep-size", "4"], 1),
    "ep2_fsdp2": ("EP 2 x FSDP2 2 (dp_shard 4)", 4, ["--dp-shard-size", "4", "--ep-size", "2"], 1),
    "ep2_tp2": ("EP 2 x TP 2", 4, ["--dp-shard-size", "2", "--tp-size", "2", "--ep-size", "2"], 1),
    "ep2_cp2": ("EP 2 x CP 2", 2, ["--cp-size", "2", "--ep-size", "2"], 1),
    "ep2_sp2": ("EP 2 x SP 2 (Ulysses)", 2, ["--sp-size", "2", "--ep-size", "2"], 1),
    "pp2_ep2": ("PP 2 x EP 2", 4, ["--pp-size", "2", "--dp-shard-size", "2", "--ep-size", "2"], 1),
    "ep2_accum2": ("EP 2, accumulation 2", 2, ["--dp-shard-size", "2", "--ep-size", "2"], 2),
}
ROWS = {  # tiny model -> what it has (tests/scripts/tiny_models.py); its family's routing comes from the family table
    "qwen3_moe": "Qwen3-MoE: 4 experts, top-2, load-balancing loss",
    "mixtral": "Mixtral: 4 experts, top-2, load-balancing loss",
    "qwen2_moe": "Qwen2-MoE: 4 experts, top-2, a gated shared expert, load-balancing loss",
    "deepseek_v3": "DeepSeek-V3: 8 experts in 4 groups, top-2 of the top-2 groups, a shared expert, layer 0 dense, "
                   "no auxiliary loss",
    "gpt_oss": "gpt-oss: 4 experts with biases, clamped SwiGLU, router with a bias, attention sinks, "
               "load-balancing loss",
    "olmoe": "OLMoE: 4 experts, top-2, every layer sparse, q/k norms over the whole projection, load-balancing loss",
}
SINKS = r"context parallelism \(GptOssAttention\): s_aux cannot be honoured by context-parallel attention"


@dataclass(frozen=True)
class Case:
    model: str  # a key of ROWS
    layout: str  # a key of LAYOUTS
    refused: str | None = None  # the error (regex) every rank must raise; None: trains like the reference
    reason: str = ""  # why it is refused, for the docs table


def _case(model: str, layout: str) -> Case:
    if layout in ("ep2_cp2", "ep2_sp2") and model == "gpt_oss":
        return Case(model, layout, SINKS, "CP/SP attention has no attention sinks (as without ep)")
    return Case(model, layout)


CASES = [_case(model, layout) for model in ROWS for layout in LAYOUTS]
PARITY = [c for c in CASES if c.refused is None]
REFUSED = [c for c in CASES if c.refused is not None]
CORE = ("qwen3_moe", "mixtral")  # fast loop: their 2-rank cells, and DIAGONAL; every other cell is marked slow
# One 4-rank cell of each other family, together one of each 4-rank layout: every family and every layout kind is in
# the fast loop once (OLMoE's: stages with its load-balancing loss, which the family table's routers make possible).
DIAGONAL = {("qwen2_moe", "ep2_tp2"), ("deepseek_v3", "ep4"), ("gpt_oss", "ep2_fsdp2"), ("mixtral", "pp2_ep2"),
            ("olmoe", "pp2_ep2")}


def _id(case: Case) -> str:
    return f"{case.model}-{case.layout}"


def _marked(cases: list[Case]) -> list:
    fast = {(c.model, c.layout) for c in cases if c.model in CORE and LAYOUTS[c.layout][1] == 2} | DIAGONAL
    return [pytest.param(c, id=_id(c), marks=() if (c.model, c.layout) in fast else pytest.mark.slow) for c in cases]


# ---- the docs table ----------------------------------------------------------------------------------------------
def render_table(cases: list[Case] = CASES) -> str:
    lines = [
        "Expert parallelism (`tests/parallel/experts/test_expert_parallel.py`, which holds this table as data): each "
        "tiny model trains 6 AdamW steps with clipping and matches the single-process losses within 1e-5 "
        "(\"tested\"; with accumulation, one process accumulating the same micro-batches), or the layout refuses it on "
        "every rank with the reason given. Routing, from the family table:",
        "",
    ]
    lines += [f"- {model}: {FAMILIES[model].experts.routing}; balancing: {FAMILIES[model].experts.balancing}"
              + (f"; beside the routed experts: {FAMILIES[model].experts.shared.what}"
                 if FAMILIES[model].experts.shared else "") for model in ROWS]
    lines += ["", "| family | " + " | ".join(title for title, *_ in LAYOUTS.values()) + " |",
              "|---|" + "---|" * len(LAYOUTS)]
    for model, title in ROWS.items():
        cells = []
        for layout in LAYOUTS:
            case = next(c for c in cases if c.model == model and c.layout == layout)
            cells.append(f"refused: {case.reason}" if case.refused else "tested")
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_readme_table_is_rendered_from_the_matrix():
    written = read_section("experts", "tests/parallel/experts/test_expert_parallel.py")
    assert written == render_table(), ("docs/expert_parallel.md's table is stale: run "
                                       "`python tests/parallel/experts/test_expert_parallel.py`")


def test_every_family_with_experts_in_the_table_has_a_row():
    assert set(ROWS) == {name for name, family in FAMILIES.items() if family.experts is not None}


# ---- the matrix -----------------------------------------------------------------------------------------------------
def loss_diff(results: list[dict], ref: dict) -> float:
    assert all(len(r["losses"]) == len(ref["losses"]) == 6 for r in results)
    return max(abs(a - b) for r in results for a, b in zip(r["losses"], ref["losses"]))


@pytest.mark.parametrize("case", _marked(PARITY))
def test_family_under_expert_parallelism_matches_single_process(case):
    _, world, flags, accum = LAYOUTS[case.layout]
    diff = loss_diff(run_layout(case.model, world, flags, accum), reference(case.model, mean_of_chunks=accum))
    assert diff <= 1e-5, f"{_id(case)}: per-step losses differ from one process by {diff:.2e}"


def _refused_run(argv: list[str]) -> dict:
    return outcomes({"run": lambda: accelerate_style.main(argv)})


@pytest.mark.parametrize("case", REFUSED, ids=_id)
def test_family_layout_is_refused(case):
    _, world, flags, _ = LAYOUTS[case.layout]
    argv = ["--model", case.model, "--micro-batch", "4", *flags]
    assert_refused(run_ranks(_refused_run, world, argv, timeout=120), ("ValueError", case.refused), "run")


@pytest.mark.slow
def test_pipeline_stages_take_a_mixture_of_experts_trained_on_the_token_loss():
    """Without the load-balancing term the stages skip its first pass: Qwen3-MoE on the token loss alone, pp 2 x ep 2."""
    _, world, flags, _ = LAYOUTS["pp2_ep2"]
    diff = loss_diff(run_layout("qwen3_moe_token_loss", world, flags, 1), reference("qwen3_moe_token_loss"))
    assert diff <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("world,flags,accum", [
    (2, ["--pp-size", "2", "--activation-checkpointing"], 2),  # recomputation inside backward adds nothing twice
    (4, ["--pp-size", "2", "--dp-shard-size", "2", "--pp-schedule", "gpipe"], 1),  # every forward, then backward
], ids=["pp2_checkpointing_accum2", "pp2_gpipe_fsdp2"])
def test_pipeline_load_balancing_loss_with_options(world, flags, accum):
    """The load-balancing term under stages (`ndparallel.parallel.pipeline.balancing`) with activation checkpointing
    and accumulation (each micro-step's term, as one process accumulating), and under GPipe with FSDP2."""
    diff = loss_diff(run_layout("mixtral", world, flags, accum), reference("mixtral", mean_of_chunks=accum))
    assert diff <= 1e-5, f"{flags}: {diff:.2e} from one process"


def _pipeline_evaluation(_: None) -> dict:
    """One process's evaluation loss (token loss + coef x its load-balancing term) and the same batch's under pp 2."""
    from ndparallel import Accelerator, ParallelismConfig, set_seed
    from tiny_models import VOCAB, build_model

    accelerator = Accelerator(parallelism_config=ParallelismConfig(pp_size=2))
    set_seed(0)
    model = build_model("qwen3_moe").eval()
    ids = (torch.arange(2 * 16).view(2, 16) * 7) % VOCAB
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids)
        model = accelerator.prepare(model)
        got = model(input_ids=ids.to(accelerator.device), labels=ids.to(accelerator.device)).loss
    return {"expected": float(expected.loss), "aux": float(expected.aux_loss), "got": float(got)}


def test_pipeline_evaluation_adds_the_load_balancing_term():
    results = run_ranks(_pipeline_evaluation, 2, None)
    assert results[0]["aux"] > 0.1
    assert all(abs(r["got"] - r["expected"]) <= 1e-6 for r in results), results


@pytest.mark.slow
@pytest.mark.parametrize("extra,tolerance", [
    (["--activation-checkpointing"], 1e-5),  # the block recomputed in backward: its all-to-alls run again
    (["--dynamo-backend", "aot_eager", "--regional-compilation"], 1e-5),  # the dispatch is not traced
    (["--mixed-precision", "bf16"], 5e-2),  # tokens travel in bf16; the fp32 trajectory within bf16 rounding
    (["--cpu-offload"], 1e-5),  # the experts' one-rank shard group (expert_shard 1) reshards after forward then
], ids=["activation_checkpointing", "regional_compilation", "bf16", "cpu_offload"])
def test_options_under_expert_parallelism(extra, tolerance):
    results = run_layout("qwen3_moe", 2, LAYOUTS["ep2"][2], 1, *extra)
    diff = loss_diff(results, reference("qwen3_moe"))
    assert diff <= tolerance and (tolerance == 1e-5 or diff > 0), f"{extra}: {diff:.2e} from one process"
    if "--regional-compilation" in extra:
        graphs = results[0]["graphs"]  # compiled once, in the first step: no recompilation afterwards
        assert graphs[0] > 0 and graphs == [graphs[0]] * len(graphs), graphs


# ---- parameters: SGD, whose update is the gradient itself ------------------------------------------------------------
def max_param_diff(results: list[dict], ref: dict) -> float:
    """Over every rank's parameters (under pipeline stages each holds its stages'), which together cover the model."""
    seen, diff = set(), 0.0
    for res in results:
        for name, value in res["params"].items():
            seen.add(name)
            diff = max(diff, (value - ref["params"][name]).abs().max().item())
    assert seen == set(ref["params"])
    return diff


SGD_LAYOUTS = {  # id -> (world size, flags)
    "ep2": (2, LAYOUTS["ep2"][2]),
    "ep4": (4, LAYOUTS["ep4"][2]),
    "ep2_fsdp2": (4, LAYOUTS["ep2_fsdp2"][2]),
    "hsdp2x2_ep2": (4, ["--dp-replicate-size", "2", "--dp-shard-size", "2", "--ep-size", "2"]),
    "ep2_tp2": (4, LAYOUTS["ep2_tp2"][2]),
    "pp2_ep2": (4, LAYOUTS["pp2_ep2"][2]),
    "pp2": (2, ["--pp-size", "2"]),  # one sparse layer per stage: the load-balancing term needs both
}


def _sgd(model: str, world: int, flags: list[str], patched: Callable | None = None) -> tuple[float, dict]:
    """SGD-trained parameters against one process's; `patched`: a rank function that breaks something first."""
    args = ("--optimizer", "sgd", "--lr", "0.5", "--return-params")
    if patched is None:
        results = run_layout(model, world, flags, 1, *args)
    else:
        argv = ["--model", model, "--micro-batch", str(GLOBAL_BATCH // data_parallel_size(flags)), *flags, *args]
        results = run_ranks(patched, world, argv)
    return max_param_diff(results, reference(model, optimizer="sgd", lr=0.5)), results[0]


@pytest.mark.slow
@pytest.mark.parametrize("model,layout", [("qwen3_moe", layout) for layout in SGD_LAYOUTS if layout != "pp2"]
                         + [("deepseek_v3", "pp2_ep2")])
def test_sgd_trains_the_single_process_parameters(model, layout):
    world, flags = SGD_LAYOUTS[layout]
    diff, _ = _sgd(model, world, flags)
    assert diff <= 1e-6, f"{model} {layout}: SGD-trained parameters differ from one process by {diff:.2e}"


def _without_gradient_scale(argv: list[str]) -> dict:
    from ndparallel.parallel.experts import compute, dispatch

    run = compute.run_local_experts
    dispatch.run_local_experts = lambda module, x, counts, ep: run(module, x, counts, 1)  # in this forked rank only
    return accelerate_style.main(argv)


@pytest.mark.slow
def test_the_parameter_check_catches_an_expert_gradient_off_by_ep():
    """Guards the test above: the experts' gradient not divided by ep (each rank's experts then get the sum of their
    ep group's contributions, averaged over too few ranks) trains other experts, by far more than its tolerance."""
    diff, _ = _sgd("qwen3_moe", 2, LAYOUTS["ep2"][2], patched=_without_gradient_scale)
    assert diff > 1e-4


def test_pipeline_stages_train_the_single_process_parameters_with_the_load_balancing_loss():
    """pp 2: each stage holds one of the two sparse layers, and the term needs both stages' routing of the batch."""
    diff, _ = _sgd("qwen3_moe", *SGD_LAYOUTS["pp2"])
    assert diff <= 1e-6, f"pp 2: SGD-trained parameters differ from one process by {diff:.2e}"


def _without_balancing_gradient(argv: list[str]) -> dict:
    from ndparallel.parallel.pipeline import balancing

    balancing._AddGradient.apply = lambda scores, logits, extra: scores  # in this forked rank only
    return accelerate_style.main(argv)


@pytest.mark.slow
def test_the_parameter_check_catches_a_missing_load_balancing_gradient():
    """Guards the test above: stages that leave the term's gradient out train other parameters."""
    diff, _ = _sgd("qwen3_moe", *SGD_LAYOUTS["pp2"], patched=_without_balancing_gradient)
    assert diff > 1e-4


# ---- routing made uneven on purpose: ranks that receive nothing -----------------------------------------------------
def _routed_experts(model_name: str) -> set[int]:
    """The experts the reference model's routers pick for the training data, over every step (one process)."""
    from tiny_models import VOCAB, TokenDataset, build_model

    torch.manual_seed(0)
    model = build_model(model_name)
    chosen: set[int] = set()
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(lambda m, args, out: chosen.update(out[2].reshape(-1).tolist()))
    dataset = TokenDataset(6 * GLOBAL_BATCH, 16, VOCAB)
    with torch.no_grad():
        model(input_ids=dataset.input_ids)
    return chosen


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2", "ep4"])
def test_ranks_that_receive_no_tokens_still_train_exactly(layout):
    """DeepSeek-V3 with its score-correction bias steering every token to experts 0 and 1: under ep the ranks holding
    experts 2..7 receive nothing (their experts get zero gradients, and FSDP2 still reduces them), the first rank
    receives every token; SGD-trained parameters and AdamW losses still match one process."""
    assert _routed_experts("deepseek_v3_skewed") == {0, 1}
    world, flags = SGD_LAYOUTS[layout]
    diff, _ = _sgd("deepseek_v3_skewed", world, flags)
    assert diff <= 1e-6
    losses = loss_diff(run_layout("deepseek_v3_skewed", world, flags, 1), reference("deepseek_v3_skewed"))
    assert losses <= 1e-5


if __name__ == "__main__":
    path = write_section("experts", render_table(), "tests/parallel/experts/test_expert_parallel.py")
    print(f"wrote the expert-parallel table of {path}")
