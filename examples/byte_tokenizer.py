"""A byte-level tokenizer that needs no download.

Every UTF-8 byte is its own token (ids 0..255), plus three special tokens:
``<pad>`` = 256, ``<bos>`` = 257 and ``<eos>`` = 258, so ``vocab_size`` is 259.
It is slow-ish and makes long sequences, but it works offline, on any text, and
round-trips exactly, which is all the example needs.

    >>> tok = ByteTokenizer()
    >>> ids = tok.encode("hi")
    >>> ids
    [257, 104, 105, 258]
    >>> tok.decode(ids)
    'hi'
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ByteTokenizer", "PAD_ID", "BOS_ID", "EOS_ID", "VOCAB_SIZE"]

PAD_ID: int = 256
BOS_ID: int = 257
EOS_ID: int = 258
VOCAB_SIZE: int = 259


class ByteTokenizer:
    """Maps text to UTF-8 byte ids and back; ids >= 256 are special tokens."""

    pad_token_id: int = PAD_ID
    bos_token_id: int = BOS_ID
    eos_token_id: int = EOS_ID
    vocab_size: int = VOCAB_SIZE
    special_tokens: dict[str, int] = {"<pad>": PAD_ID, "<bos>": BOS_ID, "<eos>": EOS_ID}

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as ids, optionally wrapped in ``<bos>``/``<eos>``."""
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, BOS_ID)
        if add_eos:
            ids.append(EOS_ID)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Turn ids back into text, skipping special tokens; invalid UTF-8 becomes U+FFFD."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return VOCAB_SIZE

    def __call__(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        """Same as :meth:`encode`."""
        return self.encode(text, add_bos=add_bos, add_eos=add_eos)
