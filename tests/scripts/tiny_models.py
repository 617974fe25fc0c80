"""Tiny Hugging Face causal LMs built from configs (no downloads) and a deterministic token dataset."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

VOCAB = 96


def build_model(name: str = "llama", float64: bool = False, **overrides):
    """A 2-layer GQA model (8 query heads, 4 KV heads: tp up to 4 splits both) in fp32 with SDPA attention;
    ``"plain"`` is `PlainTransformer`, a decoder written without transformers. `float64`: the model and its loss in
    float64 (transformers' causal-LM loss would compute in float32), for checks of exactness."""
    import transformers

    if name == "plain":
        return PlainTransformer(**overrides)
    if float64:
        model = build_model(name, **overrides).double()
        model.loss_function = float64_causal_lm_loss
        return model
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                  tie_word_embeddings=False, attn_implementation="sdpa")
    common.update(overrides)
    configs = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    if name in FAMILIES:
        return build_family(name, **overrides)
    if name not in configs:
        raise ValueError(f"unknown tiny model {name!r}; choose from {sorted(configs) + sorted(FAMILIES) + ['plain']}")
    config_cls, model_cls = configs[name]
    return model_cls(config_cls(**common))


def float64_causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                           num_items_in_batch: Any = None, ignore_index: int = -100,
                           shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """transformers' ForCausalLMLoss (same arguments and meaning) without its upcast of the logits to float32."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = F.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device),
                           ignore_index=ignore_index, reduction="mean" if num_items_in_batch is None else "sum")
    return loss if num_items_in_batch is None else loss / num_items_in_batch


class TokenDataset(Dataset):
    """`n` random token sequences (fixed seed). With `uneven_labels`, sample i masks a different number of
    leading labels with -100, so ranks and micro-batches hold different numbers of loss tokens."""

    def __init__(self, n: int, seq_len: int, vocab: int = VOCAB, uneven_labels: bool = False) -> None:
        g = torch.Generator().manual_seed(1234)
        self.input_ids = torch.randint(0, vocab, (n, seq_len), generator=g)
        self.labels = self.input_ids.clone()
        if uneven_labels:
            for i in range(n):
                self.labels[i, : (i * 5) % (seq_len - 2)] = -100

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    """AdamW for loss parity; SGD where parameters are compared (Adam magnifies rounding in near-zero grads).
    "adamw_foreach" / "adamw_fused": the same AdamW through torch's multi-tensor kernels."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    kernels = {"adamw": {}, "adamw_foreach": {"foreach": True}, "adamw_fused": {"fused": True}}[name]
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, **kernels)


class PlainAttention(nn.Module):
    """Causal multi-head attention that takes its head count from the local projection width (so it runs on
    tensor-parallel shards unchanged)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(batch, length, -1))


class PlainMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class PlainBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), PlainAttention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), PlainMLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class LMOutput(NamedTuple):
    """A pytree (NamedTuple) output: FSDP2 finds the tensors in it to hook its backward (not a SimpleNamespace)."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class PlainTransformer(nn.Module):
    """A small decoder LM in plain PyTorch: a user's own model, parallelised by the user's plan `PLAIN_PLAN`."""

    _no_split_modules = ["PlainBlock"]

    def __init__(self, vocab: int = VOCAB, dim: int = 32, heads: int = 8, hidden: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(PlainBlock(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> LMOutput:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return LMOutput(loss, logits)


PLAIN_PLAN = {
    "embed": "embedding_rowwise",
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.o": "rowwise",
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise",
    "head": "colwise_gather_output",
}


# ---- one tiny model per popular causal-LM family (tests/parallel/tensor/test_families.py) ------------------------------------------
# Each is fp32 with SDPA attention, no dropout, a vocabulary tp 2 divides, and 2 layers; what makes the family itself
# (tied embeddings, fused projections, q/k norms, sliding windows, soft-capping, Conv1D, experts) is kept.
_SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=128, attn_implementation="sdpa")
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}  # not the families' YaRN for 128 positions
_DEEPSEEK_V3 = dict(_SMALL, num_key_value_heads=8, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                    first_k_dense_replace=1, n_shared_experts=1, moe_intermediate_size=32, q_lora_rank=16,
                    kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, routed_scaling_factor=2.5,
                    rope_parameters=_ROPE, tie_word_embeddings=False)
_GEMMA3 = dict(_SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
               layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=2.0,
               tie_word_embeddings=True, pad_token_id=0)
FAMILIES: dict[str, tuple[str, str, dict]] = {  # name -> (config class, model class, config fields)
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(_SMALL, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_SMALL, head_dim=4, tie_word_embeddings=True)),
    # Alternating sliding-window (8 tokens, shorter than the tests' 16) and full layers, final-logit soft-capping.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_GEMMA3, sliding_window=8)),
    # Gemma 3 variants: a window covering the 16-token sequences (plain causal attention), attention soft-capping.
    "gemma3_window16": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_GEMMA3, sliding_window=16)),
    "gemma3_attn_softcap": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                            dict(_GEMMA3, sliding_window=16, attn_logit_softcapping=50.0)),
    # Fused qkv_proj and gate_up_proj.
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(_SMALL, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Conv1D layers, a fused c_attn, learned positions, tied embeddings.
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=VOCAB, n_embd=32, n_inner=64, n_layer=2, n_head=8, n_positions=128, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True,
                  attn_implementation="sdpa")),
    # q/k RMSNorms over the whole projection (not per head).
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM",
              dict(_SMALL, tie_word_embeddings=False, pad_token_id=0, eos_token_id=2)),
    # 4 experts, 2 per token, every layer sparse; the load-balancing loss is part of the training loss.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_SMALL, head_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       output_router_logits=True, router_aux_loss_coef=0.1, tie_word_embeddings=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(_SMALL, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                     router_aux_loss_coef=0.1, tie_word_embeddings=False)),
    # Qwen3-MoE trained on the token loss alone (no load-balancing term): what pipeline stages take.
    "qwen3_moe_token_loss": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                             dict(_SMALL, head_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                  output_router_logits=False, tie_word_embeddings=False)),
    # A shared expert beside the routed ones, scaled by a sigmoid gate.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(_SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, output_router_logits=True, router_aux_loss_coef=0.1,
                       tie_word_embeddings=False)),
    # Multi-head latent attention; 8 experts in 4 groups, sigmoid scores, each token's top-2 taken from its top-2
    # groups; a shared expert; layer 0 dense; no auxiliary loss (a score-correction bias steers the routing).
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", _DEEPSEEK_V3),
    # Every token routed to experts 0 and 1 (the score-correction bias): under ep the other ranks receive nothing.
    "deepseek_v3_skewed": ("DeepseekV3Config", "DeepseekV3ForCausalLM", _DEEPSEEK_V3),
    # Experts with biases, a clamped SwiGLU on interleaved gate/up columns, weights stored (experts, in, out); a router
    # with a bias; attention sinks (eager attention: transformers has no SDPA path for them).
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(_SMALL, num_local_experts=4, num_experts_per_tok=2, head_dim=4, output_router_logits=True,
                     router_aux_loss_coef=0.1, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                     rope_parameters=_ROPE, tie_word_embeddings=False, attn_implementation="eager")),
    # OLMoE: every layer sparse (4 experts as wide as intermediate_size, top-2), q/k RMSNorms over the whole projection
    # as OLMo 2; the load-balancing loss is part of the training loss.
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(_SMALL, intermediate_size=32, num_experts=4, num_experts_per_tok=2, output_router_logits=True,
                   router_aux_loss_coef=0.1, tie_word_embeddings=False, pad_token_id=0, eos_token_id=2,
                   bos_token_id=None)),
}


def _skew_routing(model) -> None:
    """Every token's top-2: experts 0 and 1 (their score-correction bias outweighs any sigmoid score)."""
    for layer in model.model.layers:
        bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
        if bias is not None:
            bias.zero_()[:2] = 1.0


AFTER_BUILD = {"deepseek_v3_skewed": _skew_routing}  # tiny model -> what is done to it once built


def build_family(name: str, **overrides):
    """The tiny model of family `name` (a key of `FAMILIES`), with config fields `overrides` changed."""
    import transformers

    config_cls, model_cls, fields = FAMILIES[name]
    config = getattr(transformers, config_cls)(**{**fields, **overrides})
    model = getattr(transformers, model_cls)(config)
    if name in AFTER_BUILD:
        with torch.no_grad():
            AFTER_BUILD[name](model)
    return model
