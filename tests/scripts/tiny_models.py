"""Tiny Hugging Face causal LMs built from configs (no downloads) and a deterministic token dataset."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

VOCAB = 96


def build_model(name: str = "llama", **overrides):
    """A 2-layer GQA model (4 query heads, 2 KV heads) in fp32 with eager-equivalent SDPA attention."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False, attn_implementation="sdpa")
    common.update(overrides)
    configs = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    if name not in configs:
        raise ValueError(f"unknown tiny model {name!r}; choose from {sorted(configs)}")
    config_cls, model_cls = configs[name]
    return model_cls(config_cls(**common))


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
    """AdamW for loss parity; SGD where parameters are compared (Adam magnifies rounding in near-zero grads)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
