"""A Hugging Face tokenizer for the bundled corpus, built here (no download): byte-level BPE, 300 tokens.

The Trainer and TRL examples need a ``PreTrainedTokenizerFast`` (TRL tokenizes its text datasets itself);
`corpus_tokenizer()` trains one on ``data/corpus.txt`` in about a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


def corpus_lines(limit: int | None = None) -> list[str]:
    """The corpus's non-empty lines (the first `limit` of them)."""
    return [line for line in CORPUS.read_text().splitlines() if line.strip()][:limit]


def corpus_tokenizer(vocab_size: int = 300) -> Any:
    """A byte-level BPE tokenizer trained on the corpus, with ``<pad>``, ``<s>`` and ``</s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus_lines(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
