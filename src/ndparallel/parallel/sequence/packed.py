"""transformers' packed-sequence detection, skipped where ndparallel already knows the answer.

A transformers model run without a cache and without an attention mask (as training under context / sequence
parallelism and pipeline stages runs: ``use_cache=False``) asks of its ``position_ids`` whether several documents are
packed into a row (``masking_utils.find_packed_sequence_indices``); the answer is read on the host, which on a GPU
stalls it until the device has drained its queue, once per forward. Two places know the answer without reading:

- while a sequence is sharded (`sharding.active()`): the mask transformers would build is not used
  (`hooks._hf_mask` returns none; attention rebuilds visibility from the documents the input check
  described);
- inside `known_positions()`: the caller made the positions itself, ``0..n-1`` on every row (a pipeline stage given
  no ``position_ids``).

There the detection answers "not packed" without reading anything; everywhere else it runs as transformers wrote it.
`install` puts the wrapper in place once per process (idempotent); ``KNOWN`` counts the open `known_positions`
blocks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from .sharding import active

_KNOWN = 0
_WRAPPED = "_ndparallel_wraps"


@contextlib.contextmanager
def known_positions() -> Iterator[None]:
    """Positions made by the caller (every row ``0..n-1``): transformers' packed-sequence detection is skipped."""
    global _KNOWN
    _KNOWN += 1
    try:
        yield
    finally:
        _KNOWN -= 1


def install() -> None:
    """Wrap transformers' ``find_packed_sequence_indices`` (see the module docstring); a no-op without transformers
    or when already wrapped."""
    try:
        from transformers import masking_utils
    except ImportError:
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None or hasattr(original, _WRAPPED):
        return

    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids: Any) -> Any:
        if _KNOWN or active() is not None:
            return None
        return original(position_ids)

    setattr(find_packed_sequence_indices, _WRAPPED, original)
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
