"""Axolotl's configs under ``ndparallel launch`` (`ndparallel.integrations.axolotl`).

The launched tests run Axolotl 0.19.0's own command, ``-m axolotl.cli.train config.yml``, as its users do: a tiny
Llama, a word-level tokenizer and a jsonl dataset built here (nothing downloaded), a config written as Axolotl's docs
write them. Each layout is compared with the same config trained by ``python -m axolotl.cli.train`` in one process
on the same global batch (the same micro-batch size, the accumulation steps times the data-parallel ranks: Axolotl
orders its samples by micro-batch): the loss and gradient norm of every step (from the checkpoint's
trainer_state.json; Axolotl's printed log rounds them) to 1e-5, and the saved model or adapter, which plain
transformers / PEFT load, after three Adam steps (`WEIGHT_TOL`).

They need Axolotl, which the main environment does not install (it pins transformers 5.16, Accelerate 1.13 and
more): ``.ci/oldest.sh`` runs them in the oldest-versions environment with Axolotl 0.19.0 added (.ci/axolotl.txt).
The checks of the config (what is refused, and why) run everywhere.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ndparallel.integrations import axolotl as integration

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
# Adam's step is lr * m / sqrt(v): for an element whose gradient is nearly 0, the last bits of a sum taken in another
# order move it by a visible fraction of lr (measured: 3.7e-5 at most with lr 1e-3 over 3 steps, packed rows under
# cp; the losses and gradient norms after those steps agree to 5e-7). A tenth of one step's lr:
WEIGHT_TOL = 1e-4
HAS_AXOLOTL = subprocess.run([sys.executable, "-c", "import axolotl"], capture_output=True).returncode == 0
needs_axolotl = pytest.mark.skipif(not HAS_AXOLOTL, reason="Axolotl is not installed (.ci/oldest.sh installs it)")
WORDS = [f"w{i}" for i in range(120)]


# ---- the config checks, without Axolotl ---------------------------------------------------------------------------
@pytest.mark.parametrize("cfg, key", [
    ({"deepspeed": "zero3.json"}, "deepspeed"),
    ({"fsdp_config": {"reshard_after_forward": True}, "fsdp_version": 1}, "fsdp_version"),
    ({"fsdp_config": {"reshard_after_forward": True}}, "fsdp_version"),  # Axolotl's default is FSDP1
    ({"fsdp_config": {"final_state_dict_type": "SHARDED_STATE_DICT"}, "fsdp_version": 2},
     "fsdp_config.final_state_dict_type"),
    ({"fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}, "fsdp_version": 2}, "fsdp_config.final_state_dict_type"),
    ({"qat": {"weight_dtype": "int8"}}, "qat"),
    ({"relora": True}, "relora"),
    ({"llmcompressor": {"recipe": {}}}, "llmcompressor"),
    ({"fp8": True}, "fp8"),
    ({"use_ray": True}, "use_ray"),
    ({"expert_parallel_size": 2}, "expert_parallel_size"),
    ({"context_parallel_size": 2, "flash_attention": True}, "attn_implementation"),
    ({"context_parallel_size": 2, "attn_implementation": "flash_attention_2"}, "attn_implementation"),
    ({"context_parallel_size": 2, "ring_attn_func": "varlen_llama3"}, "ring_attn_func"),
    ({"context_parallel_size": 2, "heads_k_stride": 1}, "heads_k_stride"),
    ({"context_parallel_size": 2, "rl": "grpo"}, "rl"),
])
def test_each_key_ndparallel_cannot_honour_is_refused_by_name(cfg, key):
    problems = integration.refusals(cfg, int(cfg.get("context_parallel_size", 1)))
    assert len(problems) == 1 and problems[0].startswith(f"`{key}`: "), problems


@pytest.mark.parametrize("cfg", [
    {},
    {"fsdp_config": {"reshard_after_forward": True, "final_state_dict_type": "FULL_STATE_DICT"}, "fsdp_version": 2},
    {"context_parallel_size": 2, "sdp_attention": True},
    {"context_parallel_size": 2, "attn_implementation": "eager"},
    {"flash_attention": True, "tensor_parallel_size": 2},  # flash attention is refused only with context parallelism
    {"adapter": "lora", "lora_r": 4, "fsdp_config": {}, "fsdp_version": "2"},
])
def test_what_ndparallel_honours_is_not_refused(cfg):
    assert integration.refusals(cfg, int(cfg.get("context_parallel_size", 1))) == []


def test_an_axolotl_function_that_changed_is_named(monkeypatch):
    """Capability, not version number: the replaced functions are checked against the parameters they were written
    for (a run that would be taken over is refused with this list, before anything trains)."""
    import types

    module = types.ModuleType("axolotl.utils.distributed")
    module.build_parallelism_config = lambda cfg, device_type: None
    module._get_parallel_config_kwargs = lambda *args: {}
    monkeypatch.setitem(sys.modules, "axolotl.utils.distributed", module)
    for name in integration.EXPECTED:
        if name != module.__name__:
            monkeypatch.delitem(sys.modules, name, raising=False)
    assert integration.api_problems() == [
        ("axolotl.utils.distributed.build_parallelism_config",
         "takes (cfg, device_type), where ndparallel's integration was written for (cfg) (Axolotl 0.19.0)"),
        ("axolotl.utils.distributed._get_parallel_config_kwargs",
         "takes (args), where ndparallel's integration was written for (world_size, tensor_parallel_size, "
         "context_parallel_size, dp_shard_size, dp_replicate_size, is_fsdp, expert_parallel_size) (Axolotl 0.19.0)")]


def test_the_modules_the_launcher_watches_are_the_ones_replaced_or_copying():
    from ndparallel.launch.worker import AXOLOTL_HOOKS

    assert set(AXOLOTL_HOOKS) == set(integration.REPLACEMENTS) | set(integration.COPIES)
    assert set(integration.REPLACEMENTS) == set(integration.EXPECTED)


# ---- the launched runs -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A tiny Llama with a word-level tokenizer, a jsonl of texts, and a LoRA adapter of it, built here."""
    if not HAS_AXOLOTL:
        pytest.skip("Axolotl is not installed (.ci/oldest.sh installs it)")
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("axolotl")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{w: 4 + i for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(root / "model")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                         eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(root / "model")
    # Axolotl creates LoRA weights before anything seeds torch (the Trainer seeds later), so two one-process runs of
    # one config start from different adapters: both sides of the comparison start from this one (lora_model_dir).
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                                     init_lora_weights="gaussian")).save_pretrained(root / "adapter")
    rng = random.Random(0)  # rows of 8 to 40 words: every batch pads, and ranks hold different numbers of tokens
    (root / "data.jsonl").write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(
        rng.randint(8, 40)))}) + "\n" for _ in range(64)))
    return root


def config_text(root: Path, name: str, micro: int, accumulation: int, extra: str) -> str:
    return f"""base_model: {root}/model
datasets:
  - path: {root}/data.jsonl
    ds_type: json
    type: completion
dataset_prepared_path: {root}/prepared
output_dir: {root}/out-{name}
sequence_len: 64
micro_batch_size: {micro}
gradient_accumulation_steps: {accumulation}
max_steps: 3
num_epochs: 1
learning_rate: 0.001
optimizer: adamw_torch
lr_scheduler: constant
val_set_size: 0
seed: 42
bf16: false
fp16: false
tf32: false
logging_steps: 1
save_strategy: steps
save_steps: 3
{extra}"""


FSDP = "fsdp_version: 2\nfsdp_config:\n  reshard_after_forward: true\n"
LORA = ("adapter: lora\nlora_model_dir: {root}/adapter\nlora_r: 4\nlora_alpha: 8\nlora_dropout: 0.0\n"
        "lora_target_linear: true\n"
        # Axolotl's LoRA kernels are Triton GPU kernels; on the CPU its own one-process run needs them off
        "lora_mlp_kernel: false\nlora_qkv_kernel: false\nlora_o_kernel: false\n")
ENV = {"AXOLOTL_DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}


def train(root: Path, name: str, micro: int, accumulation: int, extra: str = "", launch: list[str] | None = None,
          ok: bool = True) -> subprocess.CompletedProcess:
    (root / f"{name}.yml").write_text(config_text(root, name, micro, accumulation, extra.format(root=root)))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NDPARALLEL_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "ACCELERATE_",
                                "PARALLELISM_CONFIG_"))}
    env.update(ENV, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]))
    runner = [sys.executable, "-m", "ndparallel", "launch", *launch] if launch else [sys.executable]
    proc = subprocess.run([*runner, "-m", "axolotl.cli.train", str(root / f"{name}.yml")], cwd=root,
                          capture_output=True, text=True, env=env, timeout=600)
    if ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def steps_of(root: Path, name: str) -> list[tuple[float, float]]:
    state = json.loads((root / f"out-{name}" / "checkpoint-3" / "trainer_state.json").read_text())
    return [(entry["loss"], entry["grad_norm"]) for entry in state["log_history"] if "loss" in entry]


_REFERENCES: dict[tuple, str] = {}


def reference(root: Path, micro: int, accumulation: int, extra: str) -> str:
    """The one-process run of a config (trained once per module)."""
    key = (micro, accumulation, extra)
    if key not in _REFERENCES:
        name = f"one{len(_REFERENCES)}"
        train(root, name, micro, accumulation, extra)
        _REFERENCES[key] = name
    return _REFERENCES[key]


PACKED = "sample_packing: true\npad_to_sequence_len: true\nsdp_attention: true\n"
LAYOUTS = [  # (id, processes, the config's N-D keys, keys of both runs, micro-batch, accumulation, data-parallel ranks)
    ("dp_shard 2", 2, "dp_shard_size: 2\n" + FSDP, "", 2, 1, 2),
    ("tp 2", 2, "tensor_parallel_size: 2\n", "", 2, 2, 1),
    ("cp 2", 2, "context_parallel_size: 2\nsdp_attention: true\n", "", 2, 2, 1),
    ("cp 2, packed rows", 2, "context_parallel_size: 2\n", PACKED, 2, 2, 1),
    # as Accelerate's docs have it: the final save gathers full weights (the plugin's state_dict_type, set by Axolotl)
    ("hsdp 2x2", 4, "dp_replicate_size: 2\ndp_shard_size: 2\n" + FSDP + "  state_dict_type: FULL_STATE_DICT\n", "",
     1, 1, 4),
    ("LoRA, dp_shard 2", 2, "dp_shard_size: 2\n" + FSDP, LORA, 2, 1, 2),
]


@needs_axolotl
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_an_axolotl_config_trains_as_one_process(workdir, layout):
    """The config as Axolotl users write it, under `ndparallel launch --nproc-per-node N` with no sizes (they are
    the config's), against `python -m axolotl.cli.train` of the same training in one process."""
    label, nproc, keys, shared, micro, accumulation, data_parallel = layout
    name = label.replace(" ", "").replace(",", "_")
    one = reference(workdir, micro, accumulation * data_parallel, shared)
    launch = ["--nproc-per-node", str(nproc)]
    if label == "dp_shard 2":  # the sizes may be given to the launcher as well (the same as the config's)
        launch += ["--dp-shard-size", "2"]
    train(workdir, name, micro, accumulation, keys + shared, launch=launch)
    ours, theirs = steps_of(workdir, name), steps_of(workdir, one)
    assert len(ours) == len(theirs) == 3
    for (loss, norm), (loss1, norm1) in zip(ours, theirs):
        assert abs(loss - loss1) < TOL * abs(loss1) and abs(norm - norm1) < TOL * abs(norm1), (ours, theirs)
    # What was saved loads in plain transformers (PEFT for the adapter) and holds one process's weights.
    if shared is LORA:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        def weights(run: str) -> dict[str, torch.Tensor]:
            base = AutoModelForCausalLM.from_pretrained(workdir / "model")
            model = PeftModel.from_pretrained(base, workdir / f"out-{run}")
            return {k: v for k, v in model.state_dict().items() if "lora_" in k}
    else:
        from transformers import AutoModelForCausalLM

        def weights(run: str) -> dict[str, torch.Tensor]:
            return AutoModelForCausalLM.from_pretrained(workdir / f"out-{run}").state_dict()
    ours, theirs = weights(name), weights(one)
    assert ours.keys() == theirs.keys() and ours
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < WEIGHT_TOL


@needs_axolotl
def test_launch_sizes_that_differ_from_the_configs_are_refused_on_every_rank(workdir):
    proc = train(workdir, "differ", 2, 1, "dp_shard_size: 2\n" + FSDP,
                 launch=["--nproc-per-node", "2", "--tp-size", "2"], ok=False)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    message = "ndparallel launch was given other sizes than the Axolotl config resolves to on 2 processes"
    assert output.count(message) >= 2, output[-4000:]  # both ranks, from the config alone: no collective ran
    assert "dp_shard_size=1 (launch) vs 2 (config)" in output and "tp_size=2 (launch) vs 1 (config)" in output


@needs_axolotl
def test_a_key_ndparallel_cannot_honour_stops_every_rank_before_training(workdir):
    proc = train(workdir, "refused", 2, 1, "dp_shard_size: 2\nfsdp_version: 2\nfsdp_config:\n"
                 "  final_state_dict_type: SHARDED_STATE_DICT\n", launch=["--nproc-per-node", "2"], ok=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert output.count("this Axolotl config cannot run under ndparallel launch as it is: "
                        "`fsdp_config.final_state_dict_type`") >= 2, output[-4000:]
    assert not (workdir / "out-refused" / "checkpoint-3").exists()
