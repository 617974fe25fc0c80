"""`MemoryKwargs`: the long-sequence memory features a prepared model gets (``Accelerator(kwargs_handlers=[...])``).

Activation offloading is the other one; it belongs to activation checkpointing and is set there:
``FullyShardedDataParallelPlugin(activation_checkpointing={"every": 1, "offload": True})``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...configuration.plugins import KwargsHandler, parse_bool

CHUNKED_LOSS_ENV = "NDPARALLEL_CHUNKED_LOSS"
TILED_MLP_ENV = "NDPARALLEL_TILED_MLP"
FUSED_RMS_NORM_ENV = "NDPARALLEL_FUSED_RMS_NORM"
ULYSSES_HEAD_CHUNKS_ENV = "NDPARALLEL_ULYSSES_HEAD_CHUNKS"


@dataclass
class MemoryKwargs(KwargsHandler):
    """What a prepared causal LM does to train long sequences in less memory (README, "Long sequences").

    Attributes:
        chunked_loss: the LM head and the loss over chunks of tokens, so no more than 128 MiB of the ``tokens x
            vocabulary`` fp32 logits exist at once (`ndparallel.parallel.memory.loss_head`); training forwards with
            labels then return ``outputs.logits = None``. "auto" (default): on wherever it is exact (transformers
            causal LMs with their own ``ForCausalLMLoss`` and a plain linear head); True: required, refused with the
            reason where it cannot be; False: off.
        loss_chunk_size: tokens per chunk of the chunked loss (None: the fewest equal chunks of at most 128 MiB of
            fp32 logits each -- one, a single matrix multiply, wherever all the logits fit).
        tiled_mlp: each decoder block's MLP computed over tiles of the sequence and recomputed tile by tile in
            backward, so its ``tokens x intermediate`` activations exist for one tile at a time (`tiled_mlp`).
            Default False.
        mlp_tile_size: tokens per MLP tile (None: the model's hidden size, at least 1024).
        fused_rms_norm: each RMSNorm whose forward is recognised runs ndparallel's, which keeps for backward only
            its input and 1/rms per token instead of fp32 copies (`rms_norm`): the same output, gradients equal to
            rounding. Default False.
        ulysses_head_chunks: under Ulysses sequence parallelism (sp > 1), its all-to-alls, attention and backward run
            over this many groups of each rank's heads, one after the other, each recomputed in backward, so that a
            layer holds ``heads / chunks`` heads' full-sequence q/k/v/o at a time (`ndparallel.parallel.sequence.
            ulysses`): exact against the unchunked path, at the price of each chunk's forward again in backward.
            Under context parallelism alone (sp 1) the cp attention runs over the groups the same way (its gathered
            key/value then exist for one group at a time). An int dividing the query heads each sp rank holds;
            "auto": the fewest chunks whose q/k/v/o fit in 128 MiB (the chunked loss's rule; one wherever all fit);
            None (default) or 1: off.
    """

    chunked_loss: bool | str = "auto"
    loss_chunk_size: int | None = None
    tiled_mlp: bool = False
    mlp_tile_size: int | None = None
    fused_rms_norm: bool = False
    ulysses_head_chunks: int | str | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.chunked_loss, str) and self.chunked_loss.strip().lower() == "auto"):
            self.chunked_loss = parse_bool(self.chunked_loss, "MemoryKwargs.chunked_loss (or 'auto')")
        else:
            self.chunked_loss = "auto"
        self.tiled_mlp = parse_bool(self.tiled_mlp, "MemoryKwargs.tiled_mlp")
        self.fused_rms_norm = parse_bool(self.fused_rms_norm, "MemoryKwargs.fused_rms_norm")
        self.ulysses_head_chunks = _head_chunks(self.ulysses_head_chunks)
        for name in ("loss_chunk_size", "mlp_tile_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"MemoryKwargs.{name} must be None or an int >= 1, got {value!r}")

    @classmethod
    def from_env(cls, handler: MemoryKwargs | None, environ: Mapping[str, str]) -> MemoryKwargs:
        """`handler` (or the defaults) with the fields it leaves at their defaults read from ``NDPARALLEL_CHUNKED_LOSS``
        (auto / true / false), ``NDPARALLEL_TILED_MLP`` and ``NDPARALLEL_FUSED_RMS_NORM`` (true / false) and
        ``NDPARALLEL_ULYSSES_HEAD_CHUNKS`` (an int, auto or off)."""
        fields: dict[str, Any] = dict(handler.__dict__) if handler is not None else {}
        default = cls()
        if environ.get(CHUNKED_LOSS_ENV) and fields.get("chunked_loss", "auto") == default.chunked_loss:
            fields["chunked_loss"] = environ[CHUNKED_LOSS_ENV]
        if environ.get(TILED_MLP_ENV) and not fields.get("tiled_mlp", False):
            fields["tiled_mlp"] = environ[TILED_MLP_ENV]
        if environ.get(FUSED_RMS_NORM_ENV) and not fields.get("fused_rms_norm", False):
            fields["fused_rms_norm"] = environ[FUSED_RMS_NORM_ENV]
        if environ.get(ULYSSES_HEAD_CHUNKS_ENV) and fields.get("ulysses_head_chunks") is None:
            fields["ulysses_head_chunks"] = environ[ULYSSES_HEAD_CHUNKS_ENV]
        return cls(**fields)


def _head_chunks(value: Any) -> int | str | None:
    """`MemoryKwargs.ulysses_head_chunks` from what a user or the environment gives: an int >= 1 (1: off, None),
    "auto", or None / "off" / "none" / "0"."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        if text in ("", "off", "none", "0", "false"):
            return None
        if text.isdigit():
            value = int(text)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"MemoryKwargs.ulysses_head_chunks must be None, 'auto' or an int >= 1, got {value!r}")
    return value if value > 1 else None
