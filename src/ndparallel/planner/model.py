"""What the planner needs to know about a model, read from a Hugging Face ``config.json``.

`ModelSpec` describes a decoder-only transformer of the Llama shape (the families whose tensor-parallel plan the
library splits as Megatron does: q/k/v and the MLP's input projections column-wise, o and the MLP's output projection
row-wise, the LM head column-wise with its logits gathered; the input embedding replicated unless it is tied to the
head). `ModelSpec.parameters` lists every weight with the dimension tensor parallelism splits, so that memory and
bytes can be counted tensor by tensor, FSDP2's padding included.

Built-in configs (``data/models/*.json``) are the published ``config.json`` files' fields, trimmed to what matters.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
# Families whose plan is the Megatron split above (`ndparallel.parallel.tensor.families`, transformers' own plans).
KNOWN_TYPES = ("llama", "mistral", "qwen2")
BUILTIN_ALIASES = {"mistral-7b": "mistral-7b-v0.3", "llama-3-8b": "llama-3.1-8b", "llama-3-70b": "llama-3.1-70b"}


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # the dimension tensor parallelism splits; None: replicated over tp
    block: bool  # inside a decoder layer (one FSDP2 unit per layer); else the root unit


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    gated: bool = True  # gate, up and down projections (Llama); False: up and down only
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    max_positions: int | None = None
    sliding_window: int | None = None  # effective window, None when every layer attends to the whole sequence
    softcap: float | None = None

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_parameters(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        """(name, shape, tp_dim) of one decoder layer's weights. Linear weights are (out, in): column-wise splits
        dim 0, row-wise dim 1."""
        h, qw, kw, inter = self.hidden, self.q_width, self.kv_width, self.intermediate
        layer: list[tuple[str, tuple[int, ...], int | None]] = [
            ("input_layernorm.weight", (h,), None),
            ("self_attn.q_proj.weight", (qw, h), 0), ("self_attn.k_proj.weight", (kw, h), 0),
            ("self_attn.v_proj.weight", (kw, h), 0), ("self_attn.o_proj.weight", (h, qw), 1),
            ("post_attention_layernorm.weight", (h,), None),
            ("mlp.up_proj.weight", (inter, h), 0), ("mlp.down_proj.weight", (h, inter), 1),
        ]
        if self.gated:
            layer.append(("mlp.gate_proj.weight", (inter, h), 0))
        if self.qkv_bias:
            layer += [("self_attn.q_proj.bias", (qw,), 0), ("self_attn.k_proj.bias", (kw,), 0),
                      ("self_attn.v_proj.bias", (kw,), 0)]
        if self.o_bias:
            layer.append(("self_attn.o_proj.bias", (h,), None))
        if self.mlp_bias:
            layer += [("mlp.up_proj.bias", (inter,), 0), ("mlp.down_proj.bias", (h,), None)]
            if self.gated:
                layer.append(("mlp.gate_proj.bias", (inter,), 0))
        return layer

    def root_parameters(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        """Weights outside the decoder layers (FSDP2's root unit). A head tied to the embedding is split once,
        along the vocabulary, for both uses; an untied embedding stays replicated over tp."""
        out = [("embed_tokens.weight", (self.vocab, self.hidden), 0 if self.tied else None),
               ("norm.weight", (self.hidden,), None)]
        if not self.tied:
            out.append(("lm_head.weight", (self.vocab, self.hidden), 0))
        return out

    def parameters(self) -> list[Param]:
        """Every weight, with the dimension the tensor-parallel plan splits."""
        out = [Param(f"layers.{i}.{name}", shape, dim, True)
               for i in range(self.layers) for name, shape, dim in self.layer_parameters()]
        return out + [Param(name, shape, dim, False) for name, shape, dim in self.root_parameters()]

    def num_parameters(self) -> int:
        return (self.layers * sum(math.prod(shape) for _, shape, _ in self.layer_parameters())
                + sum(math.prod(shape) for _, shape, _ in self.root_parameters()))

    def metrics_config(self) -> SimpleNamespace:
        """The fields `ndparallel.metrics.flops_per_token` reads, so MFU is counted as the library's step timer does."""
        return SimpleNamespace(hidden_size=self.hidden, num_hidden_layers=self.layers, num_attention_heads=self.heads,
                               num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                               intermediate_size=self.intermediate, vocab_size=self.vocab,
                               hidden_act="silu" if self.gated else "gelu")

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, the convention of `ndparallel.metrics` (whole S x S score matrix)."""
        from ..metrics import flops_per_token

        return flops_per_token(self.metrics_config(), seq_len)


# ---- reading configs -------------------------------------------------------------------------------------------
def builtin_names() -> list[str]:
    folder = resources.files("ndparallel.planner").joinpath("data/models")
    return sorted(entry.name[:-5] for entry in folder.iterdir() if entry.name.endswith(".json"))


def _builtin(name: str) -> dict[str, Any] | None:
    key = BUILTIN_ALIASES.get(name.lower(), name.lower())
    if key not in builtin_names():
        return None
    return json.loads(resources.files("ndparallel.planner").joinpath(f"data/models/{key}.json").read_text())


def read_config(source: str | Path) -> tuple[dict[str, Any], str]:
    """(config dict, where it came from) for a built-in name, a config.json path or a model directory."""
    text = str(source)
    builtin = _builtin(text)
    if builtin is not None:
        return builtin, f"built-in {builtin.get('_name', text)}"
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{str(source)!r} is a directory without a config.json")
    if not path.is_file():
        raise FileNotFoundError(f"--model {text!r}: no such file or directory, and not a built-in config; built-in: "
                                f"{', '.join(builtin_names())}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config.json holds a JSON object, got {type(data).__name__}")
    return data, str(path)


def _positive_int(data: dict[str, Any], key: str, source: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def spec_from_config(data: dict[str, Any], source: str = "config") -> ModelSpec:
    """A `ModelSpec` from a Hugging Face config dict; raises naming every missing field."""
    if isinstance(data.get("text_config"), dict):  # multimodal wrappers: the language model's config
        data = {**data["text_config"], "model_type": data["text_config"].get("model_type", data.get("model_type"))}
    for expert_key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if isinstance(data.get(expert_key), int) and data[expert_key] > 1:
            raise ValueError(f"{source}: a mixture-of-experts model ({expert_key}={data[expert_key]}); the planner "
                             "models dense decoders only (`ndparallel estimate-memory --ep-size N` gives its expert "
                             "states per rank and all-to-all bytes)")
    missing = [key for key in REQUIRED_FIELDS if data.get(key) is None]
    if missing:
        raise ValueError(f"{source}: the config lacks {', '.join(missing)}; the planner needs "
                         f"{', '.join(REQUIRED_FIELDS)} (and reads num_key_value_heads, head_dim, "
                         "tie_word_embeddings, attention_bias, mlp_bias, sliding_window, max_position_embeddings when "
                         "present)")
    hidden, layers, heads, inter, vocab = (_positive_int(data, key, source) for key in REQUIRED_FIELDS)
    kv_heads = _positive_int(data, "num_key_value_heads", source) if data.get("num_key_value_heads") else heads
    if heads % kv_heads:
        raise ValueError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    head_dim = _positive_int(data, "head_dim", source) if data.get("head_dim") else hidden // heads
    model_type = str(data.get("model_type") or "unknown")
    if model_type not in KNOWN_TYPES:
        warnings.warn(f"{source}: model_type {model_type!r} is modelled as a Llama-style decoder (q/k/v/o attention, "
                      f"gated MLP, Megatron tensor-parallel split); known types: {', '.join(KNOWN_TYPES)}",
                      stacklevel=2)
    window = data.get("sliding_window")
    if data.get("use_sliding_window") is False:
        window = None
    layer_types = data.get("layer_types")
    if isinstance(layer_types, list) and not any("sliding" in str(t) for t in layer_types):
        window = None
    return ModelSpec(
        name=str(data.get("_name") or data.get("_name_or_path") or source), model_type=model_type, hidden=hidden,
        layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim, intermediate=inter, vocab=vocab,
        tied=bool(data.get("tie_word_embeddings", False)), gated=True,
        qkv_bias=model_type == "qwen2" or bool(data.get("attention_bias", False)),
        o_bias=model_type != "qwen2" and bool(data.get("attention_bias", False)),
        mlp_bias=bool(data.get("mlp_bias", False)), max_positions=data.get("max_position_embeddings"),
        sliding_window=window if isinstance(window, int) else None, softcap=data.get("attn_logit_softcapping"))


def load_model(source: str | Path) -> ModelSpec:
    """`ModelSpec` for ``--model``: a built-in name, a config.json or a model directory."""
    data, where = read_config(source)
    return spec_from_config(data, where)
