"""Causal language modelling with the Hugging Face Trainer, written as any Trainer script is: nothing in it names
ndparallel. ``ndparallel launch`` with sizes trains it on that layout; ``python`` or ``torchrun`` as always.

    python examples/trainer_clm.py --output_dir runs/clm                              # one process
    ndparallel launch --nproc-per-node 2 --cp-size 2 examples/trainer_clm.py --output_dir runs/clm
    ndparallel launch --nproc-per-node 4 --dp-shard-size 2 --tp-size 2 examples/trainer_clm.py --output_dir runs/clm

A small Llama built from a config (random weights) learns the bundled corpus, tokenized by a BPE tokenizer trained
on it (`corpus_tokenizer.py`) and cut into blocks of ``--block_size`` tokens. Every ``TrainingArguments`` flag works
(``--max_steps``, ``--per_device_train_batch_size``, ``--gradient_accumulation_steps``, ``--save_steps``...); the
trained model and the Trainer's state (its log history) are saved to ``--output_dir`` at the end.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus_tokenizer import CORPUS, corpus_tokenizer  # noqa: E402


@dataclass
class ModelArguments:
    hidden_size: int = field(default=64, metadata={"help": "model width (the MLP is 4x)"})
    layers: int = field(default=2, metadata={"help": "decoder layers"})
    heads: int = field(default=4, metadata={"help": "attention heads (2 key/value heads)"})
    block_size: int = field(default=64, metadata={"help": "tokens per training sample"})


def blocks(tokenizer, block_size: int) -> list[dict[str, torch.Tensor]]:
    """The corpus as consecutive blocks of `block_size` tokens (labels = inputs: the model shifts them)."""
    ids = torch.tensor(tokenizer(CORPUS.read_text())["input_ids"])
    rows = ids[: len(ids) // block_size * block_size].view(-1, block_size)
    return [{"input_ids": row, "labels": row.clone()} for row in rows]


def main() -> None:
    parser = HfArgumentParser((ModelArguments, TrainingArguments))
    model_args, training_args = parser.parse_args_into_dataclasses()
    tokenizer = corpus_tokenizer()
    torch.manual_seed(training_args.seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=model_args.hidden_size,
                         intermediate_size=4 * model_args.hidden_size, num_hidden_layers=model_args.layers,
                         num_attention_heads=model_args.heads, num_key_value_heads=2,
                         max_position_embeddings=model_args.block_size, pad_token_id=tokenizer.pad_token_id)
    data = blocks(tokenizer, model_args.block_size)
    split = len(data) // 10
    trainer = Trainer(model=LlamaForCausalLM(config), args=training_args, train_dataset=data[split:],
                      eval_dataset=data[:split], processing_class=tokenizer)
    result = trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model()
    trainer.save_state()
    trainer.log_metrics("train", result.metrics)
    trainer.log_metrics("eval", metrics)


if __name__ == "__main__":
    main()
