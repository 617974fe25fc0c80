"""``cpu_ram_efficient_loading`` from a Hub checkpoint that stores one tensor per expert, every rank on the meta device:
each rank reads only the per-expert tensors of its own experts and stacks them as the model does
(`ndparallel.checkpoint.per_expert`); the result is bitwise one process's ``from_pretrained`` (fp32, no arithmetic).

The checkpoints are what transformers' ``save_pretrained`` writes for the tiny models (the Hub's names: Qwen3-MoE and
DeepSeek-V3 ``mlp.experts.N.{gate,up,down}_proj.weight``, Mixtral ``block_sparse_moe.experts.N.{w1,w3,w2}.weight``),
split into several files with an index. What a rank reads is recorded by wrapping `per_expert.ExpertReader.slice`.
Layouts that do not fit the family table are refused naming what is wrong, on every rank alike.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint  # noqa: F401 - imported once here, not again in every forked rank
import transformers

from harness import run_ranks
from tiny_models import build_model
from ndparallel.checkpoint import per_expert
from ndparallel.parallel import state_module
from ndparallel.checkpoint.storage import CheckpointError
from ndparallel.models.families import FAMILIES

PER_EXPERT = re.compile(r".*\.experts\.(\d+)\..*")
LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _write(directory: Path, family: str, **overrides) -> Path:
    """The tiny model as save_pretrained writes it, in files of at most 20 KB (several, and an index)."""
    torch.manual_seed(0)
    build_model(family, **overrides).save_pretrained(directory, max_shard_size="20KB")
    assert (directory / "model.safetensors.index.json").is_file()
    return directory


def _load(path: str, layout: dict) -> dict:
    """Rank: every parameter on the meta device, prepared under `layout` with cpu_ram_efficient_loading; what it read,
    which experts it holds, and (rank 0) every tensor's full value."""
    from ndparallel import (
        Accelerator,
        FullyShardedDataParallelPlugin,
        ParallelismConfig,
        init_empty_weights,
    )

    read: list[str] = []
    original = per_expert.ExpertReader.slice

    def recording(self, name, rows, columns):
        read.append(name)
        return original(self, name, rows, columns)

    per_expert.ExpertReader.slice = recording
    plugin = FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True)
    accelerator = Accelerator(parallelism_config=ParallelismConfig(**layout), fsdp_plugin=plugin)
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    model = accelerator.prepare(model)
    layers = {int(m[1]) for n, _ in state_module(model).named_parameters() for m in [LAYER.match(n)] if m}
    full = accelerator.get_state_dict(model)  # rank 0: every tensor's full value (all stages')
    mesh = accelerator.mesh
    result = {"read": read, "ep": (mesh.rank("ep"), mesh.size("ep")), "layers": layers,
              "expert_shard": (mesh.rank("expert_shard"), mesh.size("expert_shard")),
              "full": full if accelerator.is_main_process else None}
    accelerator.end_training()
    return result


def _refused(path: str, layout: dict) -> str:
    try:
        _load(path, layout)
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _check(directory: Path, results: list[dict]) -> None:
    """Every tensor equals one process's from_pretrained bitwise; each rank read exactly its own experts' tensors (of
    its own pipeline stage's layers)."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    full = results[0]["full"]
    assert set(full) == set(reference)
    assert [n for n in reference if not torch.equal(full[n], reference[n])] == []
    names = [n for n in json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
             if PER_EXPERT.fullmatch(n)]
    experts = 1 + max(int(PER_EXPERT.fullmatch(n)[1]) for n in names)
    for r in results:
        (ep_rank, ep), (shard_rank, shards) = r["ep"], r["expert_shard"]
        per_rank = experts // ep // shards  # this rank's ep slice, then its FSDP2 shard of it
        first = ep_rank * experts // ep + shard_rank * per_rank
        mine = sorted(n for n in names if first <= int(PER_EXPERT.fullmatch(n)[1]) < first + per_rank
                      and int(LAYER.match(n)[1]) in r["layers"])
        assert sorted(r["read"]) == mine  # each of its experts' tensors once, no other expert's
    assert sorted(n for r in results for n in r["read"]) == sorted(names)  # together, every expert once


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_each_rank_reads_only_its_experts_of_a_per_expert_hub_checkpoint(tmp_path, family):
    directory = _write(tmp_path, family)
    _check(directory, run_ranks(_load, 2, str(directory), {"dp_shard_size": 2, "ep_size": 2}))


def test_each_rank_reads_its_fsdp_shard_of_its_ep_slice(tmp_path):
    """ep 2 x expert_shard 2: 4 experts, 2 per ep rank, 1 per rank after FSDP2; non-experts sharded over 4."""
    directory = _write(tmp_path, "qwen3_moe")
    results = run_ranks(_load, 4, str(directory), {"dp_shard_size": 4, "ep_size": 2})
    assert [len({PER_EXPERT.fullmatch(n)[1] for n in r["read"]}) for r in results] == [1, 1, 1, 1]
    _check(directory, results)


def test_each_pipeline_stage_reads_its_layers_experts(tmp_path):
    """pp 2 x ep 2 (4 layers): each rank reads its experts of its stage's 2 layers."""
    directory = _write(tmp_path, "qwen3_moe_token_loss", num_hidden_layers=4)
    results = run_ranks(_load, 4, str(directory), {"pp_size": 2, "dp_shard_size": 2, "ep_size": 2})
    assert [sorted(r["layers"]) for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    _check(directory, results)


# ---- refusals -------------------------------------------------------------------------------------------------------
def _headers(directory: Path, family: str) -> dict[str, list[int]]:
    """Names and shapes of the tensors save_pretrained writes for the tiny model."""
    torch.manual_seed(0)
    build_model(family).save_pretrained(directory)
    return {k: list(v.shape) for k, v in safetensors.torch.load_file(directory / "model.safetensors").items()}


def _plan(saved: dict[str, list[int]], family: str = "qwen3_moe") -> per_expert.Sources:
    experts = FAMILIES[family].experts
    return per_expert.plan(saved, experts.per_expert, experts.modules, 4, family, Path("ckpt"))


def test_the_table_maps_every_family_it_names_as_transformers_converts(tmp_path):
    """The plan's stacked shapes are the model's own, and the rest of its names are the model's (Mixtral's router
    renamed back from block_sparse_moe)."""
    for family in ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]:
        torch.manual_seed(0)
        model = build_model(family)
        sources = _plan(_headers(tmp_path / family, family), family)
        assert sources.shapes == {k: list(v.shape) for k, v in model.state_dict().items()}
        assert set(sources.experts) == {n for n in sources.shapes
                                        if re.fullmatch(r".*\.mlp\.experts\.(gate_up_proj|down_proj)", n)}
        assert all(len(names) == 4 for parts in sources.experts.values() for _, names in parts)


def test_missing_experts_unknown_names_and_disagreeing_shapes_are_refused_naming_them(tmp_path):
    saved = _headers(tmp_path, "qwen3_moe")
    gate = "model.layers.0.mlp.experts.3.gate_proj.weight"
    missing = {k: v for k, v in saved.items() if k != gate}
    with pytest.raises(CheckpointError, match=r"1 expert tensor\(s\) are missing \(4 experts\): " + re.escape(gate)):
        _plan(missing)
    renamed = {**missing, "model.layers.0.mlp.experts.3.gate_lin.weight": saved[gate]}
    with pytest.raises(CheckpointError, match=r"fit no name the family table knows for 'qwen3_moe' \(layers.L.mlp."
                                              r"experts.N.gate_proj.weight.*: model.layers.0.mlp.experts.3.gate_lin"):
        _plan(renamed)
    extra = {**saved, "model.layers.0.mlp.experts.4.up_proj.weight": [32, 32]}
    with pytest.raises(CheckpointError, match=r"beyond the model's 4: model.layers.0.mlp.experts.4.up_proj.weight"):
        _plan(extra)
    shorter = {**saved, gate: [31, 32]}
    with pytest.raises(CheckpointError, match=re.escape(f"disagree in shape: {gate} (31, 32) vs model.layers.0.mlp."
                                                        "experts.0.gate_proj.weight (32, 32)")):
        _plan(shorter)
    narrower = {**saved, **{f"model.layers.1.mlp.experts.{e}.up_proj.weight": [32, 16] for e in range(4)}}
    with pytest.raises(CheckpointError, match=r"has 16 input features where the other projection\(s\) of gate_up_proj "
                                              r"have 32"):
        _plan(narrower)


def test_a_family_without_per_expert_names_is_refused():
    model = build_model("gpt_oss")  # its Hub checkpoints stack the experts: the table has no per-expert names
    saved = {"model.layers.0.mlp.experts.0.gate_up_proj": [64, 32]}
    with pytest.raises(CheckpointError, match=r"no per-expert names for model_type 'gpt_oss'.*load the real weights "
                                              r"on rank 0"):
        per_expert.stacked_sources(saved, model, Path("ckpt"))


def _rewrite(directory: Path, change) -> None:
    """Apply `change` (name -> tensor or None: dropped) to every tensor of the checkpoint's files."""
    for file in directory.glob("*.safetensors"):
        tensors = {name: change(name, t) for name, t in safetensors.torch.load_file(file).items()}
        safetensors.torch.save_file({n: t for n, t in tensors.items() if t is not None}, file, metadata={"format": "pt"})


GONE = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
REFUSALS = {  # what is changed in a Mixtral checkpoint -> the end of the message every rank raises
    "an expert tensor missing": (lambda name, t: None if name == GONE else t,
                                 r"which cannot be stacked into the model's experts: 1 expert tensor\(s\) are missing "
                                 rf"\(4 experts\): {re.escape(GONE)}"),
    "every w3 half as tall": (lambda name, t: t[: len(t) // 2] if name.endswith(".w3.weight") else t,
                              r"\(experts stacked from one tensor per expert\) does not match the model .*differ in "
                              r"shape: model.layers.0.mlp.experts.gate_up_proj: checkpoint \(4, 96, 32\) vs model "
                              r"\(4, 128, 32\)"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_refusal_reaches_every_rank_before_any_collective(tmp_path, case):
    directory = _write(tmp_path, "mixtral")
    change, expected = REFUSALS[case]
    _rewrite(directory, change)
    messages = run_ranks(_refused, 2, str(directory), {"dp_shard_size": 2, "ep_size": 2})
    assert messages[0] == messages[1]
    assert re.fullmatch(r"CheckpointError: pretrained weights in .*" + expected + ".*", messages[0]), messages[0]
