"""Weights in and out of sharded models: `save_model` from any layout and ``ndparallel merge-weights`` give a
Hugging Face directory that `from_pretrained` loads with the same logits; `get_state_dict` gives the full weights;
``cpu_ram_efficient_loading`` fills a meta-device model with a local checkpoint's weights under sharding."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint  # noqa: F401 - imported once here, not again in every forked rank
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401

import checkpoint_train
from harness import run_ranks
from ndparallel.cli import main as cli
from tiny_models import VOCAB, build_model

INPUT = torch.arange(2 * 16).view(2, 16) % VOCAB


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=INPUT).logits
    return (out.full_tensor() if isinstance(out, DTensor) else out).detach()


def _train_and_export(flags: list[str], out: str) -> dict:
    """Train 2 steps under `flags`, then export; returns what each rank saw."""
    args = checkpoint_train.parse([*flags, "--steps", "2"])
    accelerator, model, optimizer, dataloader, scheduler, _ = checkpoint_train.build(args)
    for step, batch in enumerate(dataloader):
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step == 1:
            break
    accelerator.save_model(model, out, max_shard_size="30KB")  # several shards and an index
    state = accelerator.get_state_dict(model)
    result = {"logits": logits(model), "state": {k: v.clone() for k, v in state.items()}}
    accelerator.end_training()
    return result


@pytest.mark.slow
@pytest.mark.parametrize("flags,world", [
    (["--dp-replicate-size", "2", "--dp-shard-size", "2"], 4),
    (["--dp-shard-size", "2", "--tp-size", "2"], 4),
], ids=["hsdp2x2", "fsdp2xtp2"])
def test_save_model_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path, flags, world):
    results = run_ranks(_train_and_export, world, flags, str(tmp_path / "hf"))
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "config.json" in files and "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 1
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert set(index["weight_map"]) == set(loaded.state_dict())
    # The exported model computes what the sharded model computed (logits gathered from the ranks).
    diff = (logits(loaded) - results[0]["logits"]).abs().max().item()
    assert diff <= 1e-5, diff
    # get_state_dict: the full weights on the main process only (parameters are sharded), equal to the export.
    assert all(r["state"] == {} for r in results[1:])
    exported = loaded.state_dict()
    assert results[0]["state"].keys() == exported.keys()
    assert all(torch.equal(results[0]["state"][k], exported[k]) for k in exported)
    untrained = build_model("llama")
    assert max((untrained.state_dict()[k] - exported[k]).abs().max().item() for k in exported) > 1e-3  # it trained


def test_merge_weights_converts_a_sharded_checkpoint_offline(tmp_path, capsys):
    result = run_ranks(checkpoint_train.main, 2, ["--dp-shard-size", "2", "--steps", "2", "--save-at", "2",
                                                  "--save-dir", str(tmp_path), "--return-params"])
    assert cli(["merge-weights", str(tmp_path / "step_2"), str(tmp_path / "hf"), "--max-shard-size", "40KB"]) == 0
    assert "wrote" in capsys.readouterr().out
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    expected = result[0]["params"]
    assert loaded.state_dict().keys() == expected.keys()
    assert all(torch.equal(loaded.state_dict()[k], expected[k]) for k in expected)
    reference = build_model("llama")
    reference.load_state_dict(expected)
    assert torch.equal(logits(loaded), logits(reference))
    # A missing checkpoint is a clear error and exit code 2, not a traceback.
    assert cli(["merge-weights", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---- pretrained weights into a sharded model ---------------------------------------------------------------------
def _load_pretrained(mode: str, path: str, flags: dict) -> dict:
    from transformers import AutoConfig

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig, init_empty_weights

    plugin = FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True)
    accelerator = Accelerator(parallelism_config=ParallelismConfig(**flags), fsdp_plugin=plugin)
    if mode == "broadcast" and accelerator.is_main_process:
        model = AutoModelForCausalLM.from_pretrained(path)  # real weights on rank 0 only
    else:
        with init_empty_weights():  # every parameter on the meta device, buffers real
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    on_meta = all(p.is_meta for p in model.parameters())
    model = accelerator.prepare(model)
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    result = {"on_meta": on_meta, "sharded": sharded, "logits": logits(model)}
    accelerator.end_training()
    return result


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["broadcast", "each_rank_reads_its_slices"])
@pytest.mark.parametrize("flags,world", [
    ({"dp_shard_size": 2}, 2),
    ({"dp_shard_size": 2, "tp_size": 2}, 4),
], ids=["fsdp2", "fsdp2xtp2"])
def test_cpu_ram_efficient_loading_fills_a_meta_model(tmp_path, mode, flags, world):
    torch.manual_seed(0)
    original = build_model("llama")
    original.save_pretrained(tmp_path / "pretrained")
    results = run_ranks(_load_pretrained, world, mode, str(tmp_path / "pretrained"), flags)
    assert [r["on_meta"] for r in results] == [mode != "broadcast" or r > 0 for r in range(world)]
    for res in results:
        assert res["sharded"]
        assert (res["logits"] - logits(original)).abs().max().item() <= 1e-5


def _load_mismatched(path: str) -> str:
    try:
        _load_pretrained("each_rank_reads_its_slices", path, {"dp_shard_size": 2})
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_pretrained_weights_of_another_shape_are_refused_before_loading(tmp_path):
    build_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    messages = run_ranks(_load_mismatched, 2, str(tmp_path))
    assert messages[0] == messages[1]
    assert "CheckpointError: pretrained weights in" in messages[0]
    assert "model.layers.0.mlp.up_proj.weight: checkpoint (64, 32) vs model (48, 32)" in messages[0]


# ---- models offloaded by Accelerate's big-model loading ----------------------------------------------------------------
OFFLOAD_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu", "model.norm": "disk",
               "model.rotary_emb": "cpu", "lm_head": "disk"}


def _save_offloaded(source: str, tmp: str) -> dict:
    """save_model of a model whose weights Accelerate keeps outside it (on the meta device in it, behind hooks): loaded
    by from_pretrained with an offload map (CPU and disk), and put through Accelerate's cpu_offload; then a model of
    meta tensors with nothing behind them."""
    from accelerate import cpu_offload
    from transformers import AutoConfig

    from ndparallel import Accelerator
    from ndparallel.big_modeling import init_empty_weights

    accelerator = Accelerator()
    out: dict = {}
    dispatched = AutoModelForCausalLM.from_pretrained(source, device_map=OFFLOAD_MAP, offload_folder=f"{tmp}/offload")
    offloaded = AutoModelForCausalLM.from_pretrained(source)
    cpu_offload(offloaded, execution_device="cpu")
    for name, model in (("dispatched", dispatched), ("cpu_offload", offloaded)):
        out[name] = {"meta": sum(p.is_meta for p in model.parameters()), "logits": logits(model)}
        accelerator.save_model(model, f"{tmp}/{name}", max_shard_size="30KB")
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
    try:
        accelerator.save_model(empty, f"{tmp}/empty")
    except ValueError as exc:
        out["empty"] = str(exc)
    accelerator.end_training()
    return out


def test_save_model_writes_the_weights_accelerates_offloading_keeps_outside_the_model(tmp_path):
    torch.manual_seed(0)
    model = build_model("llama")
    model.save_pretrained(tmp_path / "source")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    out = run_ranks(_save_offloaded, 1, str(tmp_path / "source"), str(tmp_path))[0]
    for name in ("dispatched", "cpu_offload"):
        assert out[name]["meta"] >= 5, out[name]["meta"]  # offloaded weights: on the meta device in the model
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / name)
        state = loaded.state_dict()
        assert state.keys() == expected.keys()
        assert all(torch.equal(state[k], expected[k]) for k in expected), name
        assert torch.equal(logits(loaded), out[name]["logits"])
    assert "save_model: 21 tensor(s) of the model are on the meta device with no values behind them" in out["empty"]
    assert "nothing was written" in out["empty"]
    assert not (tmp_path / "empty").exists() and not [p for p in tmp_path.iterdir() if "empty" in p.name]
