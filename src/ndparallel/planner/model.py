"""What the planner needs to know about a model, read from a Hugging Face ``config.json``.

`ModelSpec` describes a decoder-only transformer of the Llama shape (the families whose tensor-parallel plan the
library splits as Megatron does: q/k/v and the MLP's input projections column-wise, o and the MLP's output projection
row-wise, the LM head column-wise with its logits gathered; the input embedding replicated unless it is tied to the
head). `ModelSpec.parameters` lists every weight with the dimension tensor parallelism splits, so that memory and
bytes can be counted tensor by tensor, FSDP2's padding included.

Mixtures of experts (Mixtral, Qwen2/3-MoE, DeepSeek-V3, gpt-oss) carry their sparse part in ``moe`` (`mixture.MoESpec`:
the routed experts of `experts.ExpertSpec`, routers, shared experts, which layers stay dense) and the attention
variants of their families: Qwen3's per-head q/k norms, gpt-oss's attention sinks and biases, DeepSeek-V3's
multi-head latent attention (`MLA`: low-rank q and kv projections with their norms; queries and keys of
``qk_nope_head_dim + qk_rope_head_dim``, values of ``v_head_dim``). The parameter counts equal those of the models
transformers builds from the same configs (tests/planner/test_planner_moe.py).

Built-in configs (``data/models/*.json``) are the published ``config.json`` files' fields, trimmed to what matters.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from importlib import resources
from typing import NamedTuple
from pathlib import Path
from typing import Any

from ..models.families import ConfigNames, Planned, planned, planned_types
from ..training.flops import training_flops
from .mixture import MoESpec, moe_spec

_NAMES = ConfigNames()  # transformers' usual names: the planner reads configs of the Llama shape
REQUIRED_FIELDS = (_NAMES.hidden, _NAMES.layers, _NAMES.heads, "intermediate_size", "vocab_size")
# The families the planner models (a `Planned` entry in the family table): the Megatron split above, with each
# family's differences (`ndparallel.models.families.Planned`); others are modelled as Llama, with a warning.
KNOWN_TYPES = planned_types()
BUILTIN_ALIASES = {"mistral-7b": "mistral-7b-v0.3", "llama-3-8b": "llama-3.1-8b", "llama-3-70b": "llama-3.1-70b"}


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # the dimension tensor parallelism splits; None: replicated over tp
    block: bool  # inside a decoder layer (one FSDP2 unit per layer); else the root unit


class LayerGroup(NamedTuple):
    """Decoder layers alike: how many, their weights (name, shape, tp_dim), and whether they route to experts."""

    count: int
    params: list[tuple[str, tuple[int, ...], int | None]]
    sparse: bool


@dataclass(frozen=True)
class MLA:
    """DeepSeek's multi-head latent attention: q through a rank-``q_lora_rank`` bottleneck (None: one projection),
    k and v expanded per head from a shared rank-``kv_lora_rank`` latent plus a rotary key shared by all heads."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int


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
    window_layers: int | None = None  # how many layers use the window when not all do (gpt-oss alternates)
    softcap: float | None = None
    v_head_dim: int | None = None  # of the values and the attention output when it differs from head_dim (MLA)
    qk_norm: bool = False  # per-head RMSNorms of q and k (Qwen3), left whole by tp with their gradients summed
    sinks: bool = False  # a learned logit per head (gpt-oss)
    mla: MLA | None = None
    attention_split: bool = True  # the family's tp plan splits attention (Megatron); else it stays whole per rank
    moe: MoESpec | None = None  # the mixture-of-experts part (`mixture.MoESpec`); None: every layer dense

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of the keys (and of the values unless v_head_dim differs)."""
        return self.kv_heads * self.head_dim

    @property
    def v_width(self) -> int:
        return self.kv_heads * (self.v_head_dim or self.head_dim)

    @property
    def o_width(self) -> int:
        """Width of the attention output (o_proj's input)."""
        return self.heads * (self.v_head_dim or self.head_dim)

    @property
    def rope_dim(self) -> int:
        return self.mla.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def dense_layers(self) -> int:
        """Decoder layers with a dense MLP (all of them without experts)."""
        return self.layers if self.moe is None else self.moe.dense_layers

    @property
    def split_mlp_layers(self) -> int:
        """Layers whose MLP tensor parallelism splits (column-wise in, row-wise out): the dense ones, and sparse
        layers whose shared experts the family's plan splits."""
        moe = self.moe
        shared = moe is not None and moe.shared_intermediate > 0 and moe.shared_split
        return self.dense_layers + (moe.sparse_layers if shared else 0)

    def attention_parameters(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        """(name, shape, tp_dim) of one layer's attention. Linear weights are (out, in): column-wise splits dim 0,
        row-wise dim 1."""
        h, qw, kw, vw, ow = self.hidden, self.q_width, self.kv_width, self.v_width, self.o_width
        col, row = (0, 1) if self.attention_split else (None, None)
        if self.mla is not None:
            m = self.mla
            q = ([("self_attn.q_proj.weight", (qw, h), col)] if m.q_lora_rank is None else
                 [("self_attn.q_a_proj.weight", (m.q_lora_rank, h), None),
                  ("self_attn.q_a_layernorm.weight", (m.q_lora_rank,), None),
                  ("self_attn.q_b_proj.weight", (qw, m.q_lora_rank), col)])
            out = q + [("self_attn.kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, h), None),
                       ("self_attn.kv_a_layernorm.weight", (m.kv_lora_rank,), None),
                       ("self_attn.kv_b_proj.weight", (self.heads * (m.qk_nope_head_dim + (self.v_head_dim or 0)),
                                                       m.kv_lora_rank), col),
                       ("self_attn.o_proj.weight", (h, ow), row)]
            if self.qkv_bias:  # attention_bias: the two down-projections (and o_proj, below)
                out += [("self_attn.kv_a_proj_with_mqa.bias", (m.kv_lora_rank + m.qk_rope_head_dim,), None)]
                if m.q_lora_rank is not None:
                    out.append(("self_attn.q_a_proj.bias", (m.q_lora_rank,), None))
        else:
            out = [("self_attn.q_proj.weight", (qw, h), col), ("self_attn.k_proj.weight", (kw, h), col),
                   ("self_attn.v_proj.weight", (vw, h), col), ("self_attn.o_proj.weight", (h, ow), row)]
            if self.qkv_bias:
                out += [("self_attn.q_proj.bias", (qw,), col), ("self_attn.k_proj.bias", (kw,), col),
                        ("self_attn.v_proj.bias", (vw,), col)]
        if self.o_bias:
            out.append(("self_attn.o_proj.bias", (h,), None))
        if self.qk_norm:
            out += [("self_attn.q_norm.weight", (self.head_dim,), None),
                    ("self_attn.k_norm.weight", (self.head_dim,), None)]
        if self.sinks:
            out.append(("self_attn.sinks", (self.heads,), col))
        return [("input_layernorm.weight", (h,), None), ("post_attention_layernorm.weight", (h,), None)] + out

    def layer_parameters(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        """(name, shape, tp_dim) of one dense decoder layer's weights: attention, norms and the MLP."""
        h, inter = self.hidden, self.intermediate
        layer = self.attention_parameters() + [("mlp.up_proj.weight", (inter, h), 0),
                                               ("mlp.down_proj.weight", (h, inter), 1)]
        if self.gated:
            layer.append(("mlp.gate_proj.weight", (inter, h), 0))
        if self.mlp_bias:
            layer += [("mlp.up_proj.bias", (inter,), 0), ("mlp.down_proj.bias", (h,), None)]
            if self.gated:
                layer.append(("mlp.gate_proj.bias", (inter,), 0))
        return layer

    def layer_groups(self) -> list[LayerGroup]:
        """The kinds of decoder layer: the dense ones, then the sparse ones, whose routed experts are left out
        (`moe`: FSDP2 shards them over other ranks)."""
        groups = [LayerGroup(self.dense_layers, self.layer_parameters(), False)]
        if self.moe is not None:
            groups.append(LayerGroup(self.moe.sparse_layers,
                                     self.attention_parameters() + self.moe.sparse_layer_parameters(), True))
        return [group for group in groups if group.count > 0]

    def root_parameters(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        """Weights outside the decoder layers (FSDP2's root unit). A head tied to the embedding is split once,
        along the vocabulary, for both uses; an untied embedding stays replicated over tp."""
        out = [("embed_tokens.weight", (self.vocab, self.hidden), 0 if self.tied else None),
               ("norm.weight", (self.hidden,), None)]
        if not self.tied:
            out.append(("lm_head.weight", (self.vocab, self.hidden), 0))
        return out

    def parameters(self) -> list[Param]:
        """Every weight, with the dimension the tensor-parallel plan splits (routed experts: none, they stay whole
        over tp), layers numbered by kind (dense ones first)."""
        out, index = [], 0
        for count, params, sparse in self.layer_groups():
            experts = self.moe.routed.stacked() if self.moe is not None and sparse else []
            for i in range(index, index + count):
                out += [Param(f"layers.{i}.{name}", shape, dim, True) for name, shape, dim in params]
                out += [Param(f"layers.{i}.mlp.experts.{name}", shape, None, True) for name, shape in experts]
            index += count
        return out + [Param(name, shape, dim, False) for name, shape, dim in self.root_parameters()]

    def num_parameters(self) -> int:
        layers = sum(g.count * sum(math.prod(shape) for _, shape, _ in g.params) for g in self.layer_groups())
        experts = self.moe.routed.num_parameters() if self.moe else 0
        return layers + experts + sum(math.prod(shape) for _, shape, _ in self.root_parameters())

    def active_parameters(self) -> int:
        """Parameters a token goes through: all of them but the routed experts it is not sent to."""
        if self.moe is None:
            return self.num_parameters()
        routed = self.moe.routed
        return self.num_parameters() - routed.num_parameters() // routed.experts * (routed.experts - routed.top_k)

    def matmul_parameters(self) -> tuple[int, int]:
        """(weights in matrix multiplies per token that tensor parallelism splits, those it leaves whole and every
        tp rank multiplies with): every 2-D weight of the layers but the routed experts, of which only the top-k a
        token goes to count, and the head; not the input embedding (a lookup)."""
        split = whole = 0
        for count, params, _ in self.layer_groups():
            for _, shape, dim in params:
                if len(shape) == 2:
                    if dim is None:
                        whole += count * math.prod(shape)
                    else:
                        split += count * math.prod(shape)
        if self.moe is not None:
            whole += self.moe.active_matmul
        return split + self.hidden * self.vocab, whole

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at `seq_len` (`ndparallel.training.flops.training_flops`, MFU's convention: the
        whole S x S score matrix): the weights a token multiplies with (`matmul_parameters`; of a mixture of experts its
        top-k experts, not all) and its own attention widths."""
        split, whole = self.matmul_parameters()
        return training_flops(split + whole, self.layers, self.q_width + self.o_width, seq_len)


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
    facts = planned(model_type)
    if facts is None:
        warnings.warn(f"{source}: model_type {model_type!r} is modelled as a Llama-style decoder (q/k/v/o attention, "
                      f"gated MLP, Megatron tensor-parallel split); known types: {', '.join(KNOWN_TYPES)}",
                      stacklevel=2)
        facts = Planned()
    window = data.get("sliding_window")
    if data.get("use_sliding_window") is False:
        window = None
    layer_types = data.get("layer_types")
    window_layers = None
    if isinstance(layer_types, list):
        sliding = sum("sliding" in str(t) for t in layer_types)
        window = window if sliding else None
        window_layers = sliding if 0 < sliding < len(layer_types) else None
    mla, v_head_dim = None, None
    if data.get("kv_lora_rank"):  # DeepSeek's multi-head latent attention: every head has its own keys and values
        mla = MLA(data.get("q_lora_rank"), _positive_int(data, "kv_lora_rank", source),
                  _positive_int(data, "qk_nope_head_dim", source), _positive_int(data, "qk_rope_head_dim", source))
        kv_heads, head_dim = heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim
        v_head_dim = _positive_int(data, "v_head_dim", source)
    moe = moe_spec(data, source)
    attention_bias = bool(data.get("attention_bias", False))
    if facts.qkv_bias:  # biases on q, k and v only (Qwen2; Qwen2-MoE: unless its qkv_bias is off)
        qkv_bias, o_bias = not facts.qkv_bias_field or bool(data.get(facts.qkv_bias_field, True)), False
    else:
        qkv_bias = o_bias = attention_bias
    return ModelSpec(
        name=str(data.get("_name") or data.get("_name_or_path") or source), model_type=model_type, hidden=hidden,
        layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim, intermediate=inter, vocab=vocab,
        tied=bool(data.get("tie_word_embeddings", False)), gated=True,
        qkv_bias=qkv_bias, o_bias=o_bias,
        mlp_bias=bool(data.get("mlp_bias", False)), max_positions=data.get("max_position_embeddings"),
        sliding_window=window if isinstance(window, int) else None, softcap=data.get("attn_logit_softcapping"),
        window_layers=window_layers if isinstance(window, int) else None, v_head_dim=v_head_dim,
        qk_norm=facts.qk_norm, sinks=facts.sinks, mla=mla,
        attention_split=moe is None or facts.tp_not_modelled is None, moe=moe)


def load_model(source: str | Path) -> ModelSpec:
    """`ModelSpec` for ``--model``: a built-in name, a config.json or a model directory."""
    data, where = read_config(source)
    return spec_from_config(data, where)
