"""The hooks that give a prepared model context/sequence-parallel attention without changing its code.

`prepare_model` registers ndparallel's attention function in transformers' `AttentionInterface` (and a mask
function beside it) and switches the model to it. While a sequence is sharded (`sharding.active()`), that function
computes exact attention over the whole sequence through `sharding.context_parallel_attention`, restoring the
model's mask from global positions (causal or full, sliding windows included) and from the batch's documents
(padded rows, packed rows: `masking`); otherwise it hands over to the model's own implementation (``sdpa`` or
``eager``), so evaluation of unsharded batches, padding masks included, works as before. A forward pre-hook checks
the model's inputs first (`_check_hf_inputs`): it refuses what sharded attention would silently get wrong,
describes the batch's padding and packed documents once (from the full-sequence ``attention_mask`` and
``position_ids``) and gives the model global ``position_ids``. Models that are not Hugging Face models get the
pre-hook only; they call `context_parallel_attention` themselves.
"""

from __future__ import annotations

import inspect
import sys
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from ...training.loss import IGNORE_INDEX, count_loss_tokens
from ..adapted import adapter_free
from . import packed
from .masking import DocumentMask, attention_work, check_document_lengths, document_ids
from .sharding import ShardedSequence, active, context_parallel_attention

ATTN_IMPLEMENTATION = "ndparallel_context_parallel"  # the name registered in transformers' registries
SUPPORTED_HF_IMPLEMENTATIONS = ("sdpa", "eager")
# Keyword arguments of HF attention functions that change what attention computes and that this one cannot honour.
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias", "cu_seq_lens_q", "cu_seq_lens_k")
LABELS_HELP = (
    "pass shift_labels instead: labels shifted by one before sharding, e.g. "
    "batch['shift_labels'] = torch.nn.functional.pad(batch['labels'][:, 1:], (0, 1), value=-100), and list them in "
    "maybe_context_parallel(buffers=...)"
)

_ORIGINAL: dict[int, tuple[weakref.ref, str]] = {}  # id(config) -> (config, its attn_implementation before ours)


def _original_implementation(config: Any) -> str:
    entry = _ORIGINAL.get(id(config))
    return entry[1] if entry is not None and entry[0]() is config else "sdpa"


@torch.compiler.disable  # collectives and the per-batch sharding state: kept out of compiled graphs
def _hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The function registered in transformers' `AttentionInterface` (its calling convention)."""
    state = active()
    if state is None:
        if module.training and torch.is_grad_enabled():
            raise RuntimeError(
                "attention of a model prepared for context parallelism ran in training mode outside "
                "accelerator.maybe_context_parallel(); activation checkpointing recomputes attention during "
                "backward, so call accelerator.backward(loss) inside the maybe_context_parallel block"
            )
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        impl = _original_implementation(getattr(module, "config", None))
        fallback = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if impl == "eager" and fallback is not None:
            return fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                               scaling=scaling, is_causal=is_causal, **kwargs)
    where = f"context parallelism ({type(module).__name__})"
    if attention_mask is not None:
        raise ValueError(f"{where}: an explicit attention mask reached attention; only causal or full attention "
                         "over whole sequences can be sharded (no padding, packing or custom masks)")
    if dropout:
        raise ValueError(f"{where}: attention dropout {dropout} is not supported; set the model config's "
                         "attention_dropout to 0.0")
    if kwargs.get("output_attentions"):
        raise ValueError(f"{where}: output_attentions=True is not supported (the full attention matrix is never built)")
    unsupported = [k for k in _UNSUPPORTED_KWARGS if kwargs.get(k) is not None]
    if unsupported:
        raise ValueError(f"{where}: {', '.join(unsupported)} cannot be honoured by context-parallel attention")
    window = kwargs.get("sliding_window")
    configured = _config_window(getattr(module, "config", None))
    if "sliding_window" not in kwargs and configured is not None and configured < state.shards.seq_len:
        raise ValueError(f"{where}: the config has a sliding window ({configured}) but the attention call does not "
                         "say which layers use it, so context-parallel attention cannot honour it; use a layout "
                         "without cp_size/sp_size (FSDP, TP: they run the model's own attention)")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = context_parallel_attention(query, key, value, is_causal=causal, scale=scaling, sliding_window=window)
    return out.transpose(1, 2).contiguous(), None


@torch.compiler.disable
def _hf_mask(*args: Any, **kwargs: Any) -> Any:
    """The mask function registered beside `_hf_attention`: none while sharded (attention rebuilds it from global
    positions), else the mask the model's own implementation would get."""
    if active() is not None:
        return None
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS[_original_implementation(kwargs.get("config"))](*args, **kwargs)


def _config_window(config: Any) -> int | None:
    """The sliding window a config applies to some of its layers, or None."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is not None and (layer_types is None or any("sliding" in str(t) for t in layer_types)):
        return int(window)
    return None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _hf_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _hf_mask)


def _is_hf(model: nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "_attn_implementation", None) is not None and hasattr(
        model, "set_attn_implementation")


def check_model(model: nn.Module, sizes: str) -> None:
    """Raise if `model` is a Hugging Face model whose attention implementation CP/SP cannot replace exactly;
    `sizes` names the sizes for messages ("cp_size=2", "sp_size=2", "cp_size=2 x sp_size=2")."""
    if not _is_hf(model):
        return
    impl = model.config._attn_implementation
    if impl not in SUPPORTED_HF_IMPLEMENTATIONS:
        raise ValueError(
            f"{sizes}: {type(model).__name__} uses attn_implementation={impl!r}; context parallelism "
            f"supports {list(SUPPORTED_HF_IMPLEMENTATIONS)}: load the model with attn_implementation='sdpa'"
        )
    softcap = getattr(model.config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(
            f"{sizes}: {type(model).__name__} soft-caps its attention logits (attn_logit_softcapping={softcap}), "
            "which ndparallel's context-parallel attention does not compute; use a layout without cp_size/sp_size "
            "(FSDP, TP: they run the model's own attention), or a config with attn_logit_softcapping=None"
        )
    if hasattr(model, "_can_set_attn_implementation") and not model._can_set_attn_implementation():
        raise ValueError(
            f"{sizes}: {type(model).__name__} does not dispatch attention through transformers' "
            "AttentionInterface, so ndparallel cannot make it context-parallel"
        )


def prepare_model(model: nn.Module, sizes: str, inner: nn.Module | None = None) -> None:
    """Make `model` compute context-parallel attention while a sequence is sharded (see the module docstring).

    Hugging Face models are switched to ndparallel's attention function; for every model, a forward pre-hook
    refuses training forwards outside ``maybe_context_parallel`` and (Hugging Face models) inputs CP cannot honour.
    `inner`: `model` under its adapter wrapper, as `parallelize` peeled it (peeled here when not given).
    """
    check_model(model, sizes)
    is_hf = _is_hf(model)
    if is_hf:
        impl = model.config._attn_implementation
        configs = {id(m.config): m.config for m in model.modules() if getattr(m, "config", None) is not None}
        for cfg in configs.values():
            _ORIGINAL[id(cfg)] = (weakref.ref(cfg), getattr(cfg, "_attn_implementation", None) or impl)
        _register()
        packed.install()  # transformers' packed-sequence detection skipped while sharded (nothing read for it)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"{sizes}: {type(model).__name__} does not dispatch attention through transformers' "
                "AttentionInterface, so ndparallel cannot make it context-parallel"
            )
    check = _InputCheck(model if is_hf else None, sizes, inner)
    model.register_forward_pre_hook(check, with_kwargs=True, prepend=True)
    # Under pipeline stages the model's own forward never runs (its stages do): the pipeline calls the check itself.
    model.sequence_input_check = check


class _InputCheck:
    """Forward pre-hook of a model prepared for context parallelism."""

    def __init__(self, hf_model: nn.Module | None, sizes: str, inner: nn.Module | None = None) -> None:
        self.config = getattr(hf_model, "config", None)
        self.is_hf = hf_model is not None
        # What the model's forward takes by name (under PEFT, whose forward passes **kwargs on: the adapted model's).
        if hf_model is not None and inner is None:
            inner = adapter_free(hf_model)
        self.accepts = set(inspect.signature(inner.forward).parameters) if hf_model is not None else set()
        self.sizes = sizes  # e.g. "cp_size=2 x sp_size=2", for messages
        self.counted_on_host = False  # whether a training forward's loss tokens were checked on the host yet

    @torch.compiler.disable
    def __call__(self, model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        state = active()
        if state is None:
            if model.training and torch.is_grad_enabled():
                raise RuntimeError(
                    f"{type(model).__name__} was prepared with {self.sizes} and is called in training mode "
                    "outside accelerator.maybe_context_parallel(...): every rank would train on whole sequences. Run "
                    "forward and backward inside `with accelerator.maybe_context_parallel(buffers=..., "
                    "buffer_seq_dims=...)`, or call model.eval() / torch.no_grad() for evaluation"
                )
            return None
        state.forwards += 1
        if not self.is_hf:
            return None
        if len(args) > 1:
            raise TypeError("under context parallelism, call the model with keyword arguments (input_ids=..., ...)")
        if args:
            kwargs = {"input_ids": args[0], **kwargs}
        return (), _check_hf_inputs(kwargs, state, self.config, self.accepts, self)


def _full(state: ShardedSequence, t: torch.Tensor) -> torch.Tensor | None:
    return state.full.get(id(t))


def _check_hf_inputs(kwargs: dict, state: ShardedSequence, config: Any, accepts: set[str], checks: Any) -> dict:
    """Refuse inputs CP would silently get wrong; describe the batch's padding and packed documents for attention;
    give the model global position_ids. Checks use the full-sequence copies of sharded buffers, so every rank of
    ``cp`` decides alike."""
    shards = state.shards
    local, total = shards.local_len, shards.seq_len
    for name in ("input_ids", "inputs_embeds", "shift_labels", "position_ids"):
        t = kwargs.get(name)
        if not isinstance(t, torch.Tensor) or t.dim() < (1 if name == "position_ids" else 2):
            continue
        length = t.shape[-1] if name == "position_ids" else t.shape[1]
        if length != local:
            hint = "it was not sharded: list it in" if length == total else "shard it with"
            raise ValueError(f"context parallelism: {name} has {length} positions, but this rank's shard of the "
                             f"{total}-token sequence has {local}; {hint} maybe_context_parallel(buffers=...)")
    if kwargs.get("shift_labels") is not None and kwargs.get("labels") is None and "labels" in accepts:
        kwargs["labels"] = kwargs["shift_labels"]  # HF models compute a loss only when labels are given; with
        # shift_labels present, their loss functions read those and ignore labels
    if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        raise ValueError("context parallelism: the batch has labels but no shift_labels. The model would shift each "
                         "rank's shard on its own, dropping or mispairing the tokens at shard boundaries; "
                         + LABELS_HELP)
    if kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
        raise ValueError("context parallelism: a KV cache (past_key_values, use_cache=True) cannot be used with "
                         "sharded sequences")
    # Models whose config says use_cache=True would otherwise fill a cache in training; activation checkpointing
    # would then recompute each layer against its own cached keys.
    if "use_cache" in accepts:
        kwargs["use_cache"] = False
    device = next((t.device for t in kwargs.values() if isinstance(t, torch.Tensor)), None)
    mask, positions = (_whole(state, kwargs.get(name), name) for name in ("attention_mask", "position_ids"))
    batch = _batch_size(kwargs)
    doc = document_ids(positions, mask, (batch, total)) if batch is not None else None
    if doc is not None:
        check_document_lengths(doc, getattr(config, "max_position_embeddings", None), "context parallelism")
    state.set_documents(DocumentMask(doc) if doc is not None else None)
    if doc is not None:
        _report_imbalance(state)
    if "attention_mask" in kwargs:
        kwargs["attention_mask"] = None  # attention rebuilds the mask from the documents
    if kwargs.get("position_ids") is None and "position_ids" in accepts:
        # Without them the model would number each shard 0..local-1 and rotary embeddings would be wrong.
        kwargs["position_ids"] = shards.positions(device).unsqueeze(0)
    _check_config(config, total)
    shift = kwargs.get("shift_labels")
    expected = state.expected_tokens if torch.is_grad_enabled() else None
    if isinstance(shift, torch.Tensor) and expected is not None:
        # The data loader counted this shard's loss tokens on the host batch: nothing is read here (a GPU would
        # stall for it), except on a prepared model's first training forward, whose count is checked on the host so
        # a mismatch gets a clear error; later ones are checked on the device (`_check_count`).
        got = count_loss_tokens(kwargs) if not checks.counted_on_host else None
        checks.counted_on_host = True
        _check_count(kwargs, got, expected)
    else:
        got = count_loss_tokens(kwargs) if isinstance(shift, torch.Tensor) else None
    if (expected if expected is not None else got) == 0 and kwargs.get("num_items_in_batch") is None:
        # A shard without loss tokens (say, all prompt): a mean over zero tokens is NaN and would poison every
        # gradient. Summed over no tokens the loss is 0; backward still runs, and `backward` weights it by 0.
        kwargs["num_items_in_batch"] = 1
    return kwargs


COUNT_MISMATCH = ("context parallelism: this rank's shift_labels hold {got} loss tokens, but the prepared data loader "
                  "counted {expected} for this shard (from the batch's shift_labels, or its labels shifted by one), so "
                  "the loss would be weighted wrongly; build shift_labels in the data loader's collate_fn, or exactly "
                  "as labels[:, 1:] padded with -100")


def _check_count(kwargs: dict, got: int | None, expected: int) -> None:
    """Raise when the shard's ``shift_labels`` hold another number of loss tokens than the data loader counted: with
    `got` (read on the host) a ValueError; without, an assertion on the device, which stops the step without the
    host waiting for the device (on a GPU: a device-side assertion with this message)."""
    if got is not None:
        if got != expected:
            raise ValueError(COUNT_MISMATCH.format(got=got, expected=expected))
        return
    labels = kwargs["shift_labels"]
    counted = (labels != IGNORE_INDEX).sum()
    torch._assert_async(counted == expected, COUNT_MISMATCH.format(got="another number of", expected=expected))


IMBALANCE_WARNING = 1.3  # the busiest cp rank's attention work over the mean, above which the first batch warns
_imbalance_reported = False


def _report_imbalance(state: ShardedSequence) -> None:
    """Once per process, on the first padded or packed batch: if its attention work is badly unbalanced over cp
    (the load-balanced layout evens out whole causal rows only), say so and what evens it out."""
    global _imbalance_reported
    sharding = state.sharding
    if _imbalance_reported or sharding.cp_size == 1 or sharding.balance_documents or state.documents is None:
        return
    _imbalance_reported = True
    cp = state.shards.cp
    work = [w["visible"] for w in attention_work(state.documents, cp.seq_len, cp.size, cp.chunk_ids)]
    mean = sum(work) / len(work)
    if mean and max(work) / mean > IMBALANCE_WARNING and sharding.cp_rank == 0 and sharding.sp_rank == 0:
        warnings.warn(f"context parallelism: in the first packed/padded batch the busiest of the {cp.size} cp ranks "
                      f"does {max(work) / mean:.2f}x the mean attention work (visible query-key pairs per rank: "
                      f"{work}); TorchContextParallelConfig(balance_documents=True) deals each batch's chunks over "
                      "the ranks by their work instead (exact either way)", stacklevel=2)


def _batch_size(kwargs: dict) -> int | None:
    for name in ("input_ids", "inputs_embeds", "shift_labels"):
        if isinstance(kwargs.get(name), torch.Tensor) and kwargs[name].dim() >= 2:
            return kwargs[name].shape[0]
    return None


def _whole(state: ShardedSequence, t: Any, name: str) -> torch.Tensor | None:
    """The full-sequence contents of an input (its copy from before sharding, or the input itself when it was not
    sharded); raises when only a shard is known, since documents cannot be seen whole from a shard."""
    if not isinstance(t, torch.Tensor):
        return None
    whole = _full(state, t)
    if whole is not None:
        return whole
    if t.shape[-1] == state.shards.seq_len:
        return t
    if name == "position_ids":  # sharded by the caller: fine if they are the shards' positions (plus a row offset)
        offsets = t - state.shards.positions(t.device)
        if bool((offsets == offsets[..., :1]).all()):
            return None
    raise ValueError(f"context parallelism: {name} was sharded outside maybe_context_parallel, so padding and "
                     f"packed documents cannot be seen whole; list {name} in maybe_context_parallel(buffers=...)")


def _check_config(config: Any, seq_len: int) -> None:
    where = f"context parallelism ({type(config).__name__})"
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is not None and chunk < seq_len:
        raise ValueError(f"{where}: chunked attention (chunks of {chunk}) over {seq_len}-token sequences cannot be "
                         f"context-parallel; use sequences of at most {chunk} tokens")
