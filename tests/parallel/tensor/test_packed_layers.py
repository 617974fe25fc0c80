"""Fused layers under tensor parallelism ("packed_colwise"): Phi-3's qkv_proj and gate_up_proj, GPT-2's c_attn.

Each tp rank must end up with its slice of every projection packed in the layer (its heads of q, of k and of v; its
part of gate and of up), the model's attention then running on its own heads; the weight stays one matrix split in
contiguous rows, so checkpoints and exports are those of any colwise layer. Checked here against the unsplit
model's own outputs and the single-process training reference (tests/reference.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import accelerate_style  # noqa: E402
from harness import run_ranks  # noqa: E402
from ndparallel import TorchTensorParallelConfig  # noqa: E402
from ndparallel.parallel.tensor import plan_styles  # noqa: E402
from ndparallel.parallel.tensor.styles import per_projection_plan  # noqa: E402
from test_families import loss_diff, train_save_load  # noqa: E402
from test_parity import reference, run_layout  # noqa: E402
from tiny_models import build_model  # noqa: E402


@pytest.mark.parametrize("sizes,tp", [((8, 4, 4), 2), ((8, 4, 4), 4), ((6, 6), 3), ((12, 12, 12), 4), ((4, 4), 1)])
def test_the_exchange_plan_routes_every_column_to_its_projection_slice(sizes, tp):
    """Every rank's local output columns (a contiguous block of the packed output) are sent where they belong:
    what rank d receives, in order, is its slice of each projection, in projection order."""
    total, width = sum(sizes), sum(sizes) // tp
    plans = [per_projection_plan(sizes, tp, r, "cpu") for r in range(tp)]
    sent = [list(torch.arange(r * width, (r + 1) * width)[plans[r][0]].split(plans[r][2])) for r in range(tp)]
    for d in range(tp):
        received = torch.cat([sent[r][d] for r in range(tp)])
        assert [len(sent[r][d]) for r in range(tp)] == plans[d][3]
        starts = [sum(sizes[:j]) for j in range(len(sizes))]
        expected = [c for start, size in zip(starts, sizes) for c in range(start + d * size // tp,
                                                                            start + (d + 1) * size // tp)]
        assert received.tolist() == expected and total == sum(sizes)
        assert torch.equal(plans[d][0][plans[d][1]], torch.arange(width))  # backward undoes the order


def _local_outputs(model_name: str, layers: list[str]) -> dict:
    """Under tp 2: each packed layer's output on this rank, and the unsplit model's full outputs."""
    from ndparallel import Accelerator, ParallelismConfig

    torch.manual_seed(0)
    full = build_model(model_name)
    model = build_model(model_name)
    model.load_state_dict(full.state_dict())
    accelerator = Accelerator(parallelism_config=ParallelismConfig(tp_size=2))
    model = accelerator.prepare(model)
    ids = (torch.arange(32).reshape(2, 16) * 5) % 96
    seen: dict[str, dict[str, torch.Tensor]] = {"local": {}, "full": {}}

    def keep(where: str, name: str):
        return lambda _m, _a, out: seen[where].__setitem__(name, out.detach().clone())

    for name in layers:
        model.get_submodule(name).register_forward_hook(keep("local", name))
        full.get_submodule(name).register_forward_hook(keep("full", name))
    with torch.no_grad():
        model(input_ids=ids)
        full(input_ids=ids)
    attention = model.get_submodule(layers[0].rpartition(".")[0])
    return {**seen, "rank": accelerator.process_index, "config_heads": model.config.num_attention_heads,
            "attention_heads": getattr(attention.config, "num_attention_heads", None),
            "attention_kv": getattr(attention, "num_key_value_heads", None),
            "split_size": getattr(attention, "split_size", None)}


def _slices(full: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
    """Rank `rank`'s slice of each projection of a packed output (2 ranks), concatenated in order."""
    return torch.cat([piece.chunk(2, dim=-1)[rank] for piece in full.split(sizes, dim=-1)], dim=-1)


@pytest.mark.parametrize("model_name,layers,sizes", [
    ("phi3", {"model.layers.0.self_attn.qkv_proj": [32, 16, 16], "model.layers.1.mlp.gate_up_proj": [64, 64]}, None),
    ("gpt2", {"transformer.h.0.attn.c_attn": [32, 32, 32]}, None),
], ids=["phi3", "gpt2"])
def test_each_rank_holds_its_slice_of_every_projection(model_name, layers, sizes):
    results = run_ranks(_local_outputs, 2, model_name, list(layers))
    for res in results:
        for name, split in layers.items():
            local, full = res["local"][name], res["full"][name]
            assert local.shape[-1] == full.shape[-1] // 2
            assert (local - _slices(full, split, res["rank"])).abs().max() <= 1e-6, name
    if model_name == "phi3":  # the attention counts its own heads; the model's config is untouched
        assert all((r["attention_heads"], r["attention_kv"], r["config_heads"]) == (4, 2, 8) for r in results)
    else:
        assert all(r["split_size"] == 16 for r in results)


@pytest.mark.slow
@pytest.mark.parametrize("model_name,world,flags", [
    ("phi3", 2, ["--tp-size", "2", "--sequence-parallel"]),
    ("gpt2", 2, ["--tp-size", "2", "--sequence-parallel"]),
    ("phi3", 4, ["--pp-size", "2", "--tp-size", "2"]),
    ("phi3", 4, ["--tp-size", "2", "--cp-size", "2"]),  # attention on this rank's heads and sequence shard
    ("phi3", 4, ["--tp-size", "2", "--sp-size", "2"]),
], ids=["phi3-tp2-sequence-parallel", "gpt2-tp2-sequence-parallel", "phi3-pp2-tp2", "phi3-tp2-cp2", "phi3-tp2-sp2"])
def test_packed_layers_keep_parity_in_more_layouts(model_name, world, flags):
    diff = loss_diff(run_layout(model_name, world, flags, 1), reference(model_name))
    assert diff <= 1e-5, f"{model_name} {flags}: {diff:.2e}"


def _without_exchange(argv: list[str]) -> dict:
    from ndparallel.parallel.tensor import styles as tensor_styles

    tensor_styles._PerProjection.apply = staticmethod(lambda y, plan, group: y)  # in this forked rank only
    return accelerate_style.main(argv)


def test_the_parity_check_catches_a_missing_exchange():
    """Guards the cases above: without the all-to-all each rank pairs whole projections' parts wrongly, and the
    losses leave the reference by far more than the tolerance."""
    argv = ["--model", "phi3", "--micro-batch", "8", "--tp-size", "2"]
    assert loss_diff(run_ranks(_without_exchange, 2, argv), reference("phi3")) > 1e-4


def _phi3_run(directory: str, tp: int, load: bool) -> dict:
    return train_save_load("phi3", directory, {"tp_size": tp}, load, momentum_sgd=True, save=tp > 1)["state"]


def test_checkpoints_and_exports_hold_the_unsplit_weights(tmp_path):
    """Saved under tp 2, resumed under tp 2 and in one process: the same next step; the saved weights and the
    exported Hugging Face directory equal one process's after the same two steps."""
    saved = run_ranks(_phi3_run, 2, str(tmp_path), 2, False)[0]
    single = run_ranks(_phi3_run, 1, str(tmp_path), 1, False)[0]
    assert max((saved[k] - single[k]).abs().max().item() for k in single) <= 1e-6
    resumed_tp, resumed_single = (run_ranks(_phi3_run, n, str(tmp_path), n, True)[0] for n in (2, 1))
    assert max((resumed_tp[k] - resumed_single[k]).abs().max().item() for k in resumed_single) <= 1e-6
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert all(torch.equal(p.detach(), saved[name]) for name, p in exported.named_parameters())


def test_packed_colwise_needs_to_know_the_projections():
    with pytest.raises(ValueError, match=r"'packed_colwise' for 'model.layers.0.self_attn.q_proj': ndparallel does "
                                         r"not know which projections LlamaForCausalLM packs there"):
        plan_styles(build_model("llama_tied"), 2, TorchTensorParallelConfig(
            plan={"layers.*.self_attn.q_proj": "packed_colwise"}))
