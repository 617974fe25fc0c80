"""Checkpoints and weights of expert-parallel models: a state saved under ep 4 resumes under ep 2, without ep and under
another dp / tp layout and takes the step one process takes from it; `save_pretrained` writes what transformers writes for
the unsplit model (the Hub's names: one tensor per expert), `save_model` the model's own state dict (the stacked
experts whole), both loaded by ``from_pretrained``; ``cpu_ram_efficient_loading`` gives every rank
its experts' weights only (each rank reading its slices of a Hub checkpoint stored one tensor per expert:
test_expert_hub_loading.py).

Each expert weight is a DTensor sharded along the experts over ``ep`` (and by FSDP2 over the rest), so
`torch.distributed.checkpoint` writes each expert once under the model's own name and reads whatever slice another
layout asks for. Tolerances: SGD with momentum (its buffers are the saved optimizer state), one step after the load,
against one process loading the same state (1e-6: the gradients pass through reductions in another order).
"""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint  # noqa: F401 - imported once here, not again in every forked rank
import transformers
from torch.distributed.tensor import DTensor

from harness import run_ranks
from test_families import train_save_load
from tiny_models import VOCAB, build_model

MODEL = "qwen3_moe"
INPUT = (torch.arange(2 * 16).view(2, 16) * 5) % VOCAB


def _run(directory: str, layout: dict, load: bool, async_save: bool = False) -> dict:
    return train_save_load(MODEL, directory, layout, load, momentum_sgd=True, async_save=async_save)


def _save_pretrained(directory: str) -> dict:
    """Prepare under ep 2 x dp_shard 2 and write with the model's own save_pretrained (collective)."""
    from ndparallel import Accelerator, ParallelismConfig, set_seed

    accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=4, ep_size=2))
    set_seed(0)
    model = accelerator.prepare(build_model(MODEL))
    experts = accelerator.unwrap_model(model).model.layers[0].mlp.experts.gate_up_proj
    accelerator.unwrap_model(model).save_pretrained(directory)
    return {"local_experts": experts.to_local().shape[0] if isinstance(experts, DTensor) else None}


@pytest.mark.slow
def test_a_state_saved_under_ep4_resumes_under_other_ep_sizes_and_layouts(tmp_path):
    saved = run_ranks(_run, 4, str(tmp_path), {"dp_shard_size": 4, "ep_size": 4}, False)
    reference_step = run_ranks(_run, 1, str(tmp_path), {}, True)[0]["state"]  # the same step in one process
    moved = max((reference_step[k] - saved[0]["state"][k]).abs().max().item() for k in reference_step)
    assert moved > 1e-3  # the step after the load changes the weights: the comparisons below can fail
    for layout, world in [({"dp_shard_size": 2, "ep_size": 2}, 2), ({"dp_shard_size": 2}, 2),
                          ({"dp_shard_size": 2, "tp_size": 2, "ep_size": 2}, 4),
                          ({"dp_replicate_size": 2, "dp_shard_size": 2, "ep_size": 2}, 4)]:
        resumed = run_ranks(_run, world, str(tmp_path), layout, True)[0]["state"]
        assert set(resumed) == set(reference_step)
        diff = max((resumed[k] - reference_step[k]).abs().max().item() for k in resumed)
        assert diff <= 1e-6, f"resumed under {layout}: {diff:.2e} from one process's step"

    # save_model (in train_save_load) wrote the model's own layout: what transformers writes for the unsplit model.
    written = safetensors.torch.load_file(next((tmp_path / "hf").glob("*.safetensors")))
    own = build_model(MODEL).state_dict()
    assert {k: tuple(v.shape) for k, v in written.items()} == {k: tuple(v.shape) for k, v in own.items()}
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert all(torch.equal(p.detach(), saved[0]["state"][name]) for name, p in exported.named_parameters())


def test_a_background_save_under_ep2_resumes_without_ep(tmp_path):
    """save_state(async_save=True): the host copy keeps each expert shard a DTensor over the ep mesh, so the
    background write holds the same global layout as a blocking one."""
    saved = run_ranks(_run, 2, str(tmp_path), {"dp_shard_size": 2, "ep_size": 2}, False, True)
    assert saved[0]["state"] is not None
    resumed = run_ranks(_run, 1, str(tmp_path), {}, True)[0]["state"]
    blocking = tmp_path / "blocking"
    run_ranks(_run, 2, str(blocking), {"dp_shard_size": 2, "ep_size": 2}, False)
    from_blocking = run_ranks(_run, 1, str(blocking), {}, True)[0]["state"]
    assert max((resumed[k] - from_blocking[k]).abs().max().item() for k in resumed) == 0.0
    assert max((resumed[k] - saved[0]["state"][k]).abs().max().item() for k in resumed) > 1e-3  # a step was taken


@pytest.mark.slow
def test_save_pretrained_writes_the_models_own_names_from_an_expert_parallel_model(tmp_path):
    results = run_ranks(_save_pretrained, 4, str(tmp_path))
    assert [r["local_experts"] for r in results] == [1, 1, 1, 1]  # 4 experts over ep 2, then FSDP2 over 2 more
    torch.manual_seed(0)
    original = build_model(MODEL)  # the same initialisation (seed 0) as the prepared model
    original.save_pretrained(tmp_path / "unsplit")  # what transformers writes: the Hub's names, one tensor per expert
    written = safetensors.torch.load_file(tmp_path / "model.safetensors")
    own = safetensors.torch.load_file(tmp_path / "unsplit" / "model.safetensors")
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in own
    assert set(written) == set(own) and all(torch.equal(written[k], own[k]) for k in own)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in original.state_dict().items())


def _load_pretrained(mode: str, path: str, layout: dict) -> dict:
    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig, init_empty_weights

    plugin = FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True)
    accelerator = Accelerator(parallelism_config=ParallelismConfig(**layout), fsdp_plugin=plugin)
    if mode == "broadcast" and accelerator.is_main_process:
        model = transformers.AutoModelForCausalLM.from_pretrained(path)  # real weights on rank 0 only
    else:
        with init_empty_weights():  # every parameter on the meta device
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    model = accelerator.prepare(model)
    experts = accelerator.unwrap_model(model).model.layers[1].mlp.experts.down_proj
    local = experts.to_local()  # this rank's experts, FSDP2-sharded over expert_shard
    rank = accelerator.mesh.rank("ep")
    with torch.no_grad():
        out = model(input_ids=INPUT).logits
    result = {"local": local.detach().clone(), "ep_rank": rank, "logits": out.detach().clone(),
              "full": experts.full_tensor().detach().clone()}
    accelerator.end_training()
    return result


def _write(directory, layout: str) -> torch.nn.Module:
    """The tiny model's weights in `directory`: as transformers' save_pretrained writes them ("hub": one tensor per
    expert, converted back to the stacked layout by from_pretrained), or as accelerator.save_model writes them
    ("stacked": the model's own state dict)."""
    torch.manual_seed(0)
    original = build_model(MODEL)
    if layout == "hub":
        original.save_pretrained(directory)
    else:
        original.config.save_pretrained(directory)
        safetensors.torch.save_file(original.state_dict(), directory / "model.safetensors")
    return original


@pytest.mark.slow
@pytest.mark.parametrize("mode,layout", [("broadcast", "hub"), ("each_rank_reads_its_slices", "stacked")])
def test_cpu_ram_efficient_loading_gives_each_rank_its_experts(tmp_path, mode, layout):
    """Rank 0 broadcasting a Hub-layout checkpoint it loaded, or every rank reading its own slices of a stacked one:
    each rank of ep 4 ends up with its expert alone, and the model computes what the original does."""
    original = _write(tmp_path / "pretrained", layout)
    results = run_ranks(_load_pretrained, 4, mode, str(tmp_path / "pretrained"), {"dp_shard_size": 4, "ep_size": 4})
    weights = original.model.layers[1].mlp.experts.down_proj.detach()
    with torch.no_grad():
        expected = original(input_ids=INPUT).logits
    for res in results:  # ep 4: rank r holds expert r alone
        assert res["local"].shape[0] == 1 and torch.equal(res["local"], weights[res["ep_rank"]:res["ep_rank"] + 1])
        assert torch.equal(res["full"], weights)
        assert (res["logits"] - expected).abs().max().item() <= 1e-5
