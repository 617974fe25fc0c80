"""PEFT LoRA adapters in every layout (`ndparallel.parallel.tensor.adapters`, `ndparallel.checkpoint.adapters`).

LoRA (r 8, B initialised nonzero) on every projection of a tiny Llama, Qwen3 and Phi-3 (fused qkv_proj and
gate_up_proj), trained 6 AdamW steps in the README's loop with -100 labels spread unevenly, against the same run in
one process: losses and adapter weights within 1e-5 (fp32; gradients reduced in another order), the frozen base
bit-identical to its initial values, with no gradients and no optimizer state. The adapters saved from a layout load
in PEFT (and merged, in plain transformers) and give the one-process model's logits.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script (docs table regeneration): the import paths conftest.py gives pytest
    _tests = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(_tests), str(_tests / "scripts")]

import pytest  # noqa: E402
import torch  # noqa: E402

from ndparallel.distributed.layout import Layout  # noqa: E402

import lora_run  # noqa: E402
from harness import run_ranks  # noqa: E402
from readme_sections import read_section, write_section  # noqa: E402

TOL = 1e-5

# The matrix, as data: docs/adapters.md's table (<!-- adapters:start -->) is rendered from it.
CASES = [  # (model, sizes, options, slow)
    ("llama", {"tp": 2}, {}, False),
    ("llama", {"tp": 2}, {"sequence_parallel": True}, False),
    ("llama", {"dp_shard": 2, "tp": 2}, {}, True),
    ("llama", {"cp": 2}, {}, False),
    ("llama", {"sp": 2}, {}, False),
    ("llama", {"pp": 2}, {}, False),
    ("llama", {"dp_shard": 2}, {"accumulation": 2}, False),
    ("qwen3", {"tp": 2}, {}, False),
    ("phi3", {"tp": 2}, {}, False),
]
_references: dict[tuple, dict] = {}


def world(sizes: dict[str, int]) -> int:
    out = 1
    for size in sizes.values():
        out *= size
    return out


def describe(sizes: dict[str, int], options: dict) -> str:
    layout = " x ".join(f"{axis} {size}" for axis, size in sizes.items())
    extra = {"sequence_parallel": "Megatron SP", "accumulation": "accumulation {}"}
    return ", ".join([layout] + [extra[k].format(v) for k, v in options.items()])


def reference(name: str, **options) -> dict:
    key = (name, tuple(sorted(options.items())))
    if key not in _references:
        _references[key] = run_ranks(lora_run.train, 1, {}, name, 6, options.get("accumulation", 1))[0]
    return _references[key]


def merged_parameters(results: list[dict]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for result in results:
        out.update(result["params"])
    return out


def render_table() -> str:
    lines = ["Tested (`tests/parallel/test_adapters.py`, which holds this table as data; `python tests/parallel/test_adapters.py` "
             "rewrites it): LoRA (r 8) on every projection, 6 AdamW steps with uneven `-100` labels; losses and "
             "adapter weights equal one process's within 1e-5, the frozen base bit-identical, without gradients or "
             "optimizer state.", "", "| model | layout | ranks |", "|---|---|---|"]
    lines += [f"| {name} | {describe(sizes, options)} | {world(sizes)} |" for name, sizes, options, _ in CASES]
    return "\n".join(lines)


def test_readme_table_is_rendered_from_the_matrix():
    assert read_section("adapters", "tests/parallel/test_adapters.py") == render_table(), \
        "docs/adapters.md's table is stale: run `python tests/parallel/test_adapters.py`"


@pytest.mark.parametrize("name,sizes,options", [
    pytest.param(name, sizes, options, id=f"{name}-{describe(sizes, options)}",
                 marks=[pytest.mark.slow] if slow else []) for name, sizes, options, slow in CASES])
def test_lora_trains_as_one_process(name, sizes, options):
    accumulation = options.get("accumulation", 1)
    results = run_ranks(lora_run.train, world(sizes), sizes, name, 6, accumulation,
                        options.get("sequence_parallel", False), timeout=600)
    ref = reference(name, accumulation=accumulation)
    assert len(results[0]["losses"]) == len(ref["losses"]) == 6
    assert max(abs(a - b) for a, b in zip(results[0]["losses"], ref["losses"])) < TOL, (results[0]["losses"],
                                                                                       ref["losses"])
    params = merged_parameters(results)
    assert params.keys() == ref["params"].keys()
    adapters = [k for k in params if ".lora_" in k]
    assert sorted(adapters) == sorted(ref["trained"]) and adapters
    assert max((params[k] - ref["params"][k]).abs().max().item() for k in adapters) < TOL
    moved = max((ref["params"][k] - lora_run.lora_model(name).state_dict()[k]).abs().max().item() for k in adapters)
    assert moved > 1e-3  # the adapters trained: equal untrained weights would prove nothing
    for result in results:
        assert result["frozen_unchanged"] and result["frozen_without_grads"]
        local_adapters = sum(".lora_" in k for k in result["params"])
        assert result["optimizer_state"] == local_adapters  # state for the adapters only


def test_saved_adapters_load_in_peft_and_merged_in_transformers(tmp_path):
    """Saved from tp 2: the adapter (PEFT's format: adapter_config.json + adapter weights, full size) loads with
    PeftModel.from_pretrained; merged (merge_adapters=True), the model loads with plain transformers; both give the
    one-process model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tiny_models import build_model

    run_ranks(lora_run.train, 2, {"tp": 2}, "llama", 6, 1, False, str(tmp_path / "adapter"),
              str(tmp_path / "merged"), timeout=600)
    ref = reference("llama", accumulation=1)
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["README.md", "adapter_config.json",
                                                                        "adapter_model.safetensors"]
    torch.manual_seed(0)
    loaded = PeftModel.from_pretrained(build_model("llama"), tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in k for k in merged.state_dict())
    with torch.no_grad():
        for model in (loaded, merged):
            diff = (model(input_ids=lora_run.PROBE).logits - ref["probe_logits"]).abs().max().item()
            assert diff < 1e-5, (type(model).__name__, diff)


def test_a_checkpoint_saved_under_tp_resumes_in_one_process_and_under_dp_shard(tmp_path):
    """save_state after 2 steps under tp 2; load_state then 4 more steps in one process and under dp_shard 2: the
    losses of the uninterrupted run."""
    full = run_ranks(lora_run.train, 2, {"tp": 2}, "llama", 6, 1, False, None, None, str(tmp_path / "state"),
                     timeout=600)[0]
    for sizes in ({}, {"dp_shard": 2}):
        resumed = run_ranks(lora_run.train, world(sizes), sizes, "llama", 6, 1, False, None, None, None,
                            str(tmp_path / "state"), timeout=600)[0]
        assert len(resumed["losses"]) == 4
        assert max(abs(a - b) for a, b in zip(resumed["losses"], full["losses"][2:])) < TOL, sizes


def refused(case: str) -> str:
    from ndparallel import Accelerator, ParallelismConfig, TorchTensorParallelConfig

    sequence_parallel = case == "embedding_sp"
    acc = Accelerator(parallelism_config=ParallelismConfig(
        tp_size=2, tp_handler=TorchTensorParallelConfig(sequence_parallel=sequence_parallel)))
    if case == "dora":
        model = lora_run.lora_model(use_dora=True)
    elif case == "embedding_sp":
        model = lora_run.lora_model(target_modules=["embed_tokens", "q_proj"])
    else:
        from peft import IA3Config, get_peft_model

        from tiny_models import build_model

        model = get_peft_model(build_model("llama"), IA3Config(target_modules=["q_proj", "down_proj"],
                                                               feedforward_modules=["down_proj"]))
    try:
        acc.prepare(model)
    except ValueError as exc:
        return str(exc)
    return "prepared"


@pytest.mark.parametrize("case,pattern", [
    ("dora", r"'base_model\.model\.model\.layers\.0\.self_attn\.q_proj' \(Linear, PEFT\) is a DoRA adapter"),
    ("embedding_sp", r"'base_model\.model\.model\.embed_tokens' is a LoRA adapter on an embedding"),
    ("ia3", r"the plan splits '.*q_proj' \(Linear, PEFT\), an adapter ndparallel cannot split"),
], ids=["dora", "lora_embedding_with_sequence_parallel", "ia3"])
def test_adapters_that_cannot_be_split_exactly_are_refused_on_every_rank(case, pattern):
    import re

    for message in run_ranks(refused, 2, case, timeout=120):
        assert re.search(pattern, message), message


if __name__ == "__main__":
    print(f"wrote the adapter table of {write_section('adapters', render_table(), 'tests/parallel/test_adapters.py')}")


def loaded(sizes: dict[str, int], base_dir: str, adapter_dir: str | None, every_rank_meta: bool) -> dict:
    """A PEFT model whose base comes from `base_dir`: with cpu_ram_efficient_loading (real weights on rank 0 only,
    or on no rank), or an adapter loaded with PeftModel.from_pretrained; its parameters after prepare, in full."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from torch.distributed.tensor import DTensor
    from transformers import AutoConfig, AutoModelForCausalLM

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig, init_empty_weights

    acc = Accelerator(parallelism_config=ParallelismConfig(**{f"{k}_size": v for k, v in sizes.items()}),
                      fsdp_plugin=FullyShardedDataParallelPlugin(
                          fsdp_version=2, cpu_ram_efficient_loading=adapter_dir is None))
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir,
                                          is_trainable=True)
    else:
        if acc.is_main_process and not every_rank_meta:
            base = AutoModelForCausalLM.from_pretrained(base_dir)
        else:
            with init_empty_weights():
                base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_dir))
        torch.manual_seed(1)
        model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=lora_run.ALL_PROJECTIONS,
                                                lora_dropout=0.0, init_lora_weights=False))
    try:
        model = acc.prepare(model)
    except Exception as exc:  # noqa: BLE001 -- the refusal is the result
        return {"error": str(exc)}
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
            for n, p in acc.unwrap_model(model).named_parameters()}


def test_pretrained_bases_and_adapters_load_into_a_sharded_peft_model(tmp_path):
    """cpu_ram_efficient_loading with the base's real weights on rank 0 only (FSDP2 x TP): base and adapter arrive
    as rank 0 built them; PeftModel.from_pretrained(base, adapter_dir) under TP; all ranks on the meta device:
    refused, saying what to do (no pretrained file holds the adapter)."""
    from tiny_models import build_model

    torch.manual_seed(0)
    build_model("llama").save_pretrained(tmp_path / "base")
    expected = lora_run.lora_model("llama")
    expected.save_pretrained(tmp_path / "adapter")
    expected = expected.state_dict()
    for sizes, adapter in (({"dp_shard": 2}, None), ({"tp": 2}, str(tmp_path / "adapter"))):
        results = run_ranks(loaded, 2, sizes, str(tmp_path / "base"), adapter, False, timeout=300)
        for result in results:
            assert set(result) <= set(expected) and len(result) == len(expected), sizes  # every parameter
            assert all(torch.equal(result[k], expected[k]) for k in result), sizes
    for result in run_ranks(loaded, 2, {"dp_shard": 2}, str(tmp_path / "base"), None, True, timeout=300):
        assert "the adapter's weights are in no pretrained file" in result["error"], result


@pytest.mark.parametrize("sizes", [{"dp_shard": 2}, {"dp_replicate": 2}], ids=["fsdp2", "ddp"])
def test_only_the_adapters_gradients_are_reduced(sizes):
    """The frozen base is not reduced: a LoRA step's gradient reductions (FSDP2's reduce-scatters, DDP's
    all-reduces, counted as sent bytes by ndparallel.test_utils.collectives) are exactly what the adapters' gradients need,
    and the optimizer keeps state (two AdamW moments) for the adapters only."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import adapters as bench

    options = {"hidden": 64, "layers": 2, "rank": 4, "seq": 16, "batch": 2}
    result = run_ranks(bench.step, 2, options, Layout(**sizes), True, timeout=300)[0]
    assert result["reduced"] == result["needed"] > 0
    assert result["optimizer"] == 2 * result["grads"] > 0
