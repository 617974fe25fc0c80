"""An ordinary TRL SFTTrainer run, as a user writes it; nothing in it names ndparallel.

The tokenizer examples/corpus_tokenizer.py trains on the bundled corpus (no download), a tiny Llama, the corpus's
first lines as a text dataset. `sft(...)` returns the loss the trainer logged at each step.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from corpus_tokenizer import corpus_lines, corpus_tokenizer  # noqa: E402


def sft(output_dir: str, per_device: int = 2, steps: int = 4, lora: bool = False, **config: Any) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    tokenizer = corpus_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa"))
    args = SFTConfig(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=per_device,
                     learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True, bf16=False, seed=0,
                     save_strategy="no", disable_tqdm=True, dataloader_drop_last=True, **{"max_length": 48, **config})
    dataset = Dataset.from_list([{"text": text} for text in corpus_lines(96)])
    peft_config = None
    if lora:  # PEFT's LoRA on every projection, B initialised nonzero so the first steps move the loss
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, init_lora_weights=False,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"])
        torch.manual_seed(1)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=peft_config)
    trainer.train()
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "accelerator": type(trainer.accelerator).__module__}
