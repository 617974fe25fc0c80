"""Supervised fine-tuning with TRL's SFTTrainer, written as any TRL script is: nothing in it names ndparallel.

    python examples/sft.py --output_dir runs/sft                                      # one process
    ndparallel launch --nproc-per-node 2 --sp-size 2 examples/sft.py --output_dir runs/sft --packing
    ndparallel launch --nproc-per-node 2 --cp-size 2 examples/sft.py --output_dir runs/sft --padding_free \\
        --max_length None

The corpus's lines are the text dataset; the tokenizer is trained on it (`corpus_tokenizer.py`); the model is a
small Llama built from a config. Every ``SFTConfig`` flag works (``--packing``, ``--padding_free``,
``--max_length``, ``--max_steps``...). Under context parallelism TRL refuses ``--packing`` (for Accelerate, whose
context parallelism drops the mask between packed documents); ndparallel keeps documents apart, and
``--padding_free`` gives packed rows there.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM
from trl import SFTConfig, SFTTrainer, TrlParser

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus_tokenizer import corpus_lines, corpus_tokenizer  # noqa: E402


def main() -> None:
    (args,) = TrlParser((SFTConfig,)).parse_args_and_config()
    tokenizer = corpus_tokenizer()
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id))
    dataset = Dataset.from_list([{"text": line} for line in corpus_lines()])
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    trainer.save_model()
    trainer.save_state()


if __name__ == "__main__":
    main()
