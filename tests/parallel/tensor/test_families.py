"""Popular causal-LM families under every layout, against the single-process reference -- and the docs' support
table, rendered from the same matrix so the two cannot drift.

`CASES` is the matrix: a tiny model of each family (tests/scripts/tiny_models.py: FAMILIES) under FSDP2 2, TP 2,
FSDP2 2 x TP 2, CP 2 and Ulysses SP 2. A case either trains 6 AdamW steps with clipping through the Accelerate-style
script (tests/scripts/accelerate_style.py) and matches the reference's per-step losses within 1e-5 (fp32; as in
tests/parallel/test_parity.py, reduce-scatters and split matmuls sum floats in another order), or must be refused on every rank
with the error given. `python tests/parallel/tensor/test_families.py` rewrites that table (docs/supported.md) from `CASES`.

Beyond the matrix: the tie of input and output embeddings survives prepare, save_state / load_state under another
layout, and save_model; every style transformers' own plans use for these families resolves; what a layout cannot
split is refused with an error that says what works instead.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # run as a script (docs table regeneration): the import paths conftest.py gives pytest
    _tests = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(_tests), str(_tests / "parallel"), str(_tests / "scripts")]

import pytest  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import accelerate_style  # noqa: E402
from harness import assert_refused, outcomes, run_ranks  # noqa: E402
from readme_sections import read_section, write_section  # noqa: E402
from ndparallel import TorchTensorParallelConfig  # noqa: E402
from ndparallel.parallel.tensor import plan_styles, tensor_parallel_styles  # noqa: E402
from test_parity import max_param_diff, reference, run_layout  # noqa: E402
from tiny_models import build_model  # noqa: E402


LAYOUTS = {  # id -> (column title, world size, flags of tests/scripts/accelerate_style.py)
    "fsdp2": ("FSDP2 2", 2, ["--dp-shard-size", "2"]),
    "tp2": ("TP 2", 2, ["--tp-size", "2"]),
    "fsdp2_tp2": ("FSDP2 2 x TP 2", 4, ["--dp-shard-size", "2", "--tp-size", "2"]),
    "cp2": ("CP 2", 2, ["--cp-size", "2"]),
    "sp2": ("SP 2 (Ulysses)", 2, ["--sp-size", "2"]),
}
ROWS = {  # table row -> what its tiny model has (tests/scripts/tiny_models.py)
    "llama_tied": "Llama, tied embeddings",
    "qwen3": "Qwen3: per-head q/k norms, tied",
    "gemma3": "Gemma 3: sliding-window layers (window 8, sequences of 16), final-logit soft-capping, tied",
    "phi3": "Phi-3: fused qkv_proj and gate_up_proj, GQA",
    "gpt2": "GPT-2: Conv1D layers, fused c_attn, learned positions, tied",
    "olmo2": "OLMo 2: q/k norms over the whole projection",
    "qwen3_moe": "Qwen3-MoE: 4 experts, top-2, load-balancing loss (coefficient 0.1) in the loss",
    "mixtral": "Mixtral: 4 experts, top-2, load-balancing loss (coefficient 0.1) in the loss",
    "olmoe": "OLMoE: 4 experts, top-2, q/k norms over the whole projection, load-balancing loss (coefficient 0.1)",
}
VARIANTS = {  # tiny model -> (its row, how it differs from the row's model)
    "gemma3_window16": ("gemma3", "with window 16 (the whole sequence)"),
    "gemma3_attn_softcap": ("gemma3", "with attention soft-capping"),
}
SOFTCAP = r"soft-caps its attention logits \(attn_logit_softcapping=50.0\).*layout without cp_size/sp_size"


@dataclass(frozen=True)
class Case:
    model: str  # a key of tiny_models.FAMILIES
    layout: str  # a key of LAYOUTS
    refused: str | None = None  # the error (regex) every rank must raise; None: trains like the reference
    reason: str = ""  # why it is refused, for the docs table


CASES = [Case(model, layout) for model in ("llama_tied", "qwen3", "phi3", "gpt2", "olmo2", "qwen3_moe", "mixtral",
                                           "olmoe") for layout in LAYOUTS]
CASES += [Case("gemma3", layout) for layout in ("fsdp2", "tp2", "fsdp2_tp2")]
CASES += [case for layout in ("cp2", "sp2") for case in (
    Case("gemma3", layout),  # the window-8 layers: CP/SP attention masks the window
    Case("gemma3_window16", layout),
    Case("gemma3_attn_softcap", layout, SOFTCAP,
         "CP/SP attention cannot soft-cap logits; refused at prepare (works: FSDP2, TP)"))]


def _id(case: Case) -> str:
    return f"{case.model}-{case.layout}"


# ---- the docs table ----------------------------------------------------------------------------------------------
def _cell(cases: list[Case]) -> str:
    parts = []
    for case in cases:
        variant = VARIANTS.get(case.model, (None, ""))[1]
        outcome = f"refused: {case.reason}" if case.refused else "tested"
        parts.append(f"{variant}: {outcome}" if variant else outcome)
    return "<br>".join(parts) or "-"


def render_table(cases: list[Case] = CASES) -> str:
    """The docs section between the markers, rendered from `cases`."""
    lines = [
        "Families (`tests/parallel/tensor/test_families.py`, which holds this table as data): each tiny model trains 6 "
        "AdamW steps "
        "with clipping and matches the single-process losses within 1e-5 (\"tested\"), or the layout refuses it on "
        "every rank with the reason given. Mixture-of-experts: FSDP2 shards the experts along the expert dimension; "
        "under TP they stay whole on every tp rank; with `ep_size`, see the table in Expert parallelism.",
        "",
        "| family | " + " | ".join(title for title, _, _ in LAYOUTS.values()) + " |",
        "|---|" + "---|" * len(LAYOUTS),
    ]
    for row, title in ROWS.items():
        cells = [_cell([c for c in cases if VARIANTS.get(c.model, (c.model,))[0] == row and c.layout == layout])
                 for layout in LAYOUTS]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def readme_section() -> str:
    return read_section("families", "tests/parallel/tensor/test_families.py")


def write_readme():
    return write_section("families", render_table(), "tests/parallel/tensor/test_families.py")


def test_readme_table_is_rendered_from_the_matrix():
    assert readme_section() == render_table(), "docs/supported.md's family table is stale: run `python tests/parallel/tensor/test_families.py`"


def test_every_cell_of_the_matrix_is_decided():
    for row in ROWS:
        for layout in LAYOUTS:
            assert any(VARIANTS.get(c.model, (c.model,))[0] == row and c.layout == layout for c in CASES), (row, layout)


# ---- the matrix: parity and refusals -----------------------------------------------------------------------------
PARITY = [c for c in CASES if c.refused is None]
REFUSED = [c for c in CASES if c.refused is not None]


def loss_diff(results: list[dict], ref: dict) -> float:
    assert all(len(r["losses"]) == len(ref["losses"]) == 6 for r in results)
    return max(abs(a - b) for r in results for a, b in zip(r["losses"], ref["losses"]))


@pytest.mark.slow
@pytest.mark.parametrize("case", PARITY, ids=_id)
def test_family_matches_single_process(case):
    _, world, flags = LAYOUTS[case.layout]
    diff = loss_diff(run_layout(case.model, world, flags, 1), reference(case.model))
    assert diff <= 1e-5, f"{_id(case)}: per-step losses differ from one process by {diff:.2e}"


def _refused_run(argv: list[str]) -> dict:
    return outcomes({"run": lambda: accelerate_style.main(argv)})


@pytest.mark.parametrize("case", REFUSED, ids=_id)
def test_family_layout_is_refused(case):
    _, world, flags = LAYOUTS[case.layout]
    argv = ["--model", case.model, "--micro-batch", "4", *flags]
    assert_refused(run_ranks(_refused_run, world, argv, timeout=120), ("ValueError", case.refused), "run")



# ---- plans: transformers' own styles, tied weights, fused layers (no processes) ---------------------------------
def _styles(model: str, **config) -> tuple[dict[str, str], str]:
    return plan_styles(build_model(model), 2, TorchTensorParallelConfig(**config))


@pytest.mark.parametrize("model,source,expected", [
    ("llama_tied", "own plan", {"lm_head": "colwise_gather_output", "model.embed_tokens": "embedding_rowwise"}),
    ("qwen3", "own plan", {"model.layers.0.self_attn.q_norm": "replicated_with_grad_allreduce",
                           "model.embed_tokens": "embedding_rowwise"}),
    ("gemma3", "own plan", {"model.layers.1.self_attn.k_norm": "replicated_with_grad_allreduce",
                            "model.embed_tokens": "embedding_rowwise"}),
    ("phi3", "plan for 'phi3' (used because", {"model.layers.0.self_attn.qkv_proj": "packed_colwise",
                                               "model.layers.0.self_attn.o_proj": "rowwise",
                                               "model.layers.0.mlp.gate_up_proj": "packed_colwise"}),
    ("gpt2", "built-in plan for 'gpt2'", {"transformer.h.0.attn.c_attn": "packed_colwise",
                                          "transformer.h.0.mlp.c_fc": "colwise",
                                          "transformer.wte": "embedding_rowwise"}),
    ("olmo2", "plan for 'olmo2' (used because", {"model.layers.0.self_attn.q_norm": "sharded_norm",
                                                 "model.layers.0.self_attn.q_proj": "colwise"}),
    # Experts stay whole: through transformers' expert entries up to 5.24 (moe_tp_experts, with packed_colwise /
    # rowwise on the weights, which resolve to 'unsplit'), and by being left out of the plan from 5.25 on (None: no
    # style, ordinary parameters) -- `_experts_whole` below. Entries for dense MLP layers this configuration does
    # not have are skipped.
    ("qwen3_moe", "own plan", {"model.layers.0.mlp.experts": "unsplit",
                               "model.layers.0.self_attn.k_norm": "replicated_with_grad_allreduce"}),
    ("mixtral", "own plan", {"model.layers.1.mlp.experts": "unsplit", "model.layers.1.self_attn.o_proj": "rowwise"}),
    ("olmoe", "plan for 'olmoe' (used because", {"model.layers.0.self_attn.k_norm": "sharded_norm",
                                                 "model.layers.0.mlp.experts": "unsplit", "lm_head":
                                                 "colwise_gather_output"}),
], ids=["llama_tied", "qwen3", "gemma3", "phi3", "gpt2", "olmo2", "qwen3_moe", "mixtral", "olmoe"])
def test_each_family_plan_resolves_with_transformers_styles(model, source, expected):
    styles, where = _styles(model)
    assert source in where
    got = {k: styles.get(k) for k in expected}
    for name in [k for k in expected if k.endswith(".mlp.experts")]:
        assert got[name] == _experts_whole(model), (name, got[name])
        got[name] = expected[name]
    assert got == expected
    assert tensor_parallel_styles(build_model(model), 2, TorchTensorParallelConfig())  # and builds


def _experts_whole(model: str) -> str | None:
    """How the model's own plan keeps its experts whole: 'unsplit' where it names them (transformers <= 5.24), None
    where it leaves them out (5.25)."""
    plan = build_model(model).config.base_model_tp_plan or {}
    return "unsplit" if any(pattern.endswith("mlp.experts") for pattern in plan) else None


def test_an_unknown_style_keeps_the_clear_error():
    with pytest.raises(ValueError, match=r"unknown tensor-parallel style 'mla_kv_a_proj' for 'layers.\*.mlp.up_proj'; "
                                         r"known styles: \[.*'replicated_with_grad_allreduce'"):
        _styles("llama_tied", plan={"layers.*.mlp.up_proj": "mla_kv_a_proj"})


def test_a_fused_layer_left_split_is_refused():
    """'colwise' would give rank 0 all of gate and rank 1 all of up: Phi-3's chunk(2) would pair the wrong halves."""
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_up_proj' packs gate and up in one weight; "
                                         r"'colwise' would .* 'colwise_gather_output'"):
        _styles("phi3", plan={"layers.*.mlp.gate_up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"})


def test_plan_entries_naming_parameters_outside_experts_are_refused():
    with pytest.raises(ValueError, match=r"names parameters \(model.layers.0.mlp.up_proj.weight...\), not modules"):
        _styles("llama_tied", plan={"layers.*.mlp.up_proj.weight": "colwise"})


def test_tied_weights_get_one_split():
    # the head alone in the plan: the embedding it shares its weight with becomes vocabulary-parallel too
    styles, _ = _styles("gpt2", plan={"lm_head": "colwise_gather_output"})
    assert styles == {"lm_head": "colwise_gather_output", "transformer.wte": "embedding_rowwise"}
    with pytest.raises(ValueError, match=r"tied parameter used as .*the plan splits it differently in each place"):
        _styles("llama_tied", plan={"embed_tokens": "colwise", "lm_head": "colwise_gather_output"})


def test_megatron_sequence_parallel_refuses_what_the_plan_leaves_on_sequence_shards():
    """An MoE's router and experts would see each rank's tokens only, with gradients never summed over tp."""
    with pytest.raises(ValueError, match=r"sequence_parallel=True\): \['model.layers.0.mlp.experts', "
                                         r"'model.layers.0.mlp.gate'.*hold parameters the plan does not cover"):
        tensor_parallel_styles(build_model("qwen3_moe"), 2, TorchTensorParallelConfig(sequence_parallel=True))


# ---- more layouts and paths --------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama_tied", "qwen3", "olmo2", "gpt2"])
def test_tp_without_fsdp_keeps_parity(model):
    """No FSDP2 to reduce gradients to their parameter's layout: q/k norm gradients are summed by the style itself
    (qwen3), the split norm's and Conv1D's by DTensor (olmo2, gpt2), the tied matrix's two uses add up in its one
    DTensor gradient (llama_tied)."""
    diff = loss_diff(run_layout(model, 2, ["--tp-size", "2", "--no-fsdp-plugin"], 1), reference(model))
    assert diff <= 1e-5, f"{model} tp2 without FSDP: {diff:.2e}"


def _without(attribute: str, argv: list[str]) -> dict:
    import ndparallel.parallel as parallel
    from ndparallel.parallel.tensor import plans as tensor

    module, name = {"retie": (tensor, "_retie"), "global_load_balancing": (parallel, "apply_global_load_balancing")}[
        attribute]
    setattr(module, name, lambda model, *args: model)  # in this forked rank only
    return accelerate_style.main(argv)


@pytest.mark.slow
@pytest.mark.parametrize("what,model,flags", [("retie", "llama_tied", ["--tp-size", "2"]),
                                              ("global_load_balancing", "qwen3_moe", ["--dp-shard-size", "2"])])
def test_the_matrix_catches_a_broken_tie_or_per_rank_load_balancing(what, model, flags):
    """Guards the matrix: with the tie left broken after splitting, or each rank's own load-balancing loss, the losses
    leave the reference by far more than the tolerance, so the parity cases above can fail."""
    argv = ["--model", model, "--micro-batch", str(8 // (2 if "--dp-shard-size" in flags else 1)), *flags]
    assert loss_diff(run_ranks(_without, 2, what, argv), reference(model)) > 1e-4


def _own_plan_run(model: str, argv: list[str]) -> dict:
    from ndparallel.models import families

    families.FAMILIES[model] = families.Family()  # in this forked rank only: transformers' plan, not ndparallel's
    return accelerate_style.main(argv)


@pytest.mark.slow
def test_olmo2_with_transformers_own_plan_keeps_parity():
    """transformers' OLMo 2 plan (q, k, v gathered: 'colwise_gather_output' and 'rowwise_split_input') works too."""
    argv = ["--model", "olmo2", "--micro-batch", "8", "--tp-size", "2"]
    diff = loss_diff(run_ranks(_own_plan_run, 2, "olmo2", argv), reference("olmo2"))
    assert diff <= 1e-5


@pytest.mark.slow
def test_tied_weight_trains_to_the_single_process_parameters():
    """SGD on FSDP2 x TP: the one embedding/head matrix ends where the single process's does (its gradient adds the
    embedding's and the head's parts), and every rank reassembles the same weights."""
    ref = reference("llama_tied", optimizer="sgd", lr=0.5)
    results = run_layout("llama_tied", 4, LAYOUTS["fsdp2_tp2"][2], 1, "--optimizer", "sgd", "--lr", "0.5",
                         "--return-params")
    assert list(results[0]["params"]) == list(ref["params"])  # one name for the tied matrix, as in the model
    assert max_param_diff(results[0]["params"], ref["params"]) <= 1e-6
    for res in results[1:]:
        assert max_param_diff(res["params"], results[0]["params"]) == 0.0


def train_save_load(model_name: str, directory: str, layout: dict, load: bool, momentum_sgd: bool = False,
                    save: bool = True, async_save: bool = False) -> dict:
    """Two steps then save_state (in the background with `async_save`) + save_model under `layout` (`save`), or: load
    the state saved there and take one more step. Returns whether the embedding and head are tied, and the gathered
    state dict (rank 0)."""
    from ndparallel import Accelerator, ParallelismConfig, set_seed

    accelerator = Accelerator(parallelism_config=ParallelismConfig(**layout))
    set_seed(1 if load else 0)  # the loading run starts from other weights
    model = build_model(model_name)
    # SGD with momentum: state to save and restore, and updates linear in the gradients (Adam's normalised step
    # turns fp32 summation-order noise in near-zero gradients into differences of order lr)
    optimizer = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if momentum_sgd else
                 torch.optim.AdamW(model.parameters(), lr=1e-2))
    model, optimizer = accelerator.prepare(model, optimizer)
    if load:
        accelerator.load_state(f"{directory}/state")
    ids = (torch.arange(64).reshape(4, 16) * 7) % 96
    for _ in range(1 if load else 2):
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
    if not load and save:
        model.eval()  # an evaluation forward first, as a training loop has: it must change nothing saved
        with torch.no_grad():
            model(input_ids=ids, labels=ids)
        model.train()
        accelerator.save_state(f"{directory}/state", async_save=async_save)
        accelerator.save_model(model, f"{directory}/hf")
        accelerator.wait_for_checkpoint()
    inner = accelerator.unwrap_model(model)
    state = accelerator.get_state_dict(model)
    return {"tied": getattr(inner, "lm_head").weight is inner.get_input_embeddings().weight,
            "state": {k: v.clone() for k, v in state.items()} if state else None}


def _tied_run(directory: str, layout: dict, load: bool) -> dict:
    return train_save_load("llama_tied", directory, layout, load)


@pytest.mark.slow
def test_the_tie_survives_prepare_checkpoints_resharding_and_save_model(tmp_path):
    saved = run_ranks(_tied_run, 4, str(tmp_path), {"dp_shard_size": 2, "tp_size": 2}, False)
    resumed = run_ranks(_tied_run, 2, str(tmp_path), {"tp_size": 2}, True)  # loaded under another layout
    assert all(r["tied"] for r in saved + resumed)
    first, second = saved[0]["state"], resumed[0]["state"]
    assert torch.equal(first["lm_head.weight"], first["model.embed_tokens.weight"])
    assert torch.equal(second["lm_head.weight"], second["model.embed_tokens.weight"])
    reference_step = run_ranks(_tied_run, 1, str(tmp_path), {}, True)[0]["state"]  # the same step in one process
    assert max((second[k] - reference_step[k]).abs().max().item() for k in second) <= 1e-6

    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    assert all(torch.equal(p.detach(), first[name]) for name, p in exported.named_parameters())
    written = set(safetensors.torch.load_file(next((tmp_path / "hf").glob("*.safetensors"))))
    assert "model.embed_tokens.weight" in written and "lm_head.weight" not in written  # once, as save_pretrained


if __name__ == "__main__":
    print(f"wrote the family table of {write_readme()}")
