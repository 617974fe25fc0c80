"""Context and sequence parallelism under the Hugging Face Trainer (`ndparallel.integrations.trainer`'s docstring,
item 3): each training batch's sequence tensors readied and sharded (`prepare_context_parallel_inputs`:
``shift_labels`` made before sharding, ``position_ids`` added, TRL's padding-free fields checked and dropped, the rows
padded to a length that splits over cp x sp), a model's mean loss weighted by its shard's share of the rows' loss
tokens when the Trainer counts none (`_sequence_sharded`), sharded inputs left where they are (`prepare_input`), and
the Trainer's batches per epoch under sp as many as ndparallel's loader yields (`set_initial_training_values`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..training.loss import IGNORE_INDEX
from .trainer_accelerator import taken_over


def prepare_context_parallel_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, model: Any, inputs: dict[str, Any]) -> tuple[Callable[[], Any], dict[str, Any]]:
        if not taken_over(self):
            return original(self, model, inputs)
        acc = self.accelerator
        if acc.sequence_sharding is None or not torch.is_grad_enabled():
            # evaluation runs whole rows: see `ndparallel.integrations.trainer`'s docstring, item 3
            return contextlib.nullcontext, inputs
        acc._start_batch()
        inputs = dict(inputs)
        ids = inputs.get("input_ids")
        if not isinstance(ids, torch.Tensor):
            raise ValueError("context/sequence parallelism with the Trainer needs input_ids in every batch")
        if "shift_labels" not in inputs and isinstance(inputs.get("labels"), torch.Tensor):
            # Shifted before sharding: the last token of one shard predicts the first of the next.
            inputs["shift_labels"] = F.pad(inputs["labels"][..., 1:], (0, 1), value=IGNORE_INDEX)
        if inputs.get("position_ids") is None:
            inputs["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        _drop_flash_attention_fields(inputs)
        _pad_to_split(inputs, acc.sequence_sharding.fitting_length(ids.shape[1]))
        ids, length = inputs["input_ids"], inputs["input_ids"].shape[1]
        buffers = [value for key, value in inputs.items() if isinstance(value, torch.Tensor) and value.dim() >= 2
                   and value.shape[1] == length and value.shape[0] == ids.shape[0]]
        return functools.partial(_sequence_sharded, acc, model, buffers, inputs.get("shift_labels")), inputs
    return wrapper


@contextlib.contextmanager
def _sequence_sharded(acc: Any, model: nn.Module, buffers: list[torch.Tensor], labels: torch.Tensor | None) -> Any:
    """`Accelerator.maybe_context_parallel` over the batch's sequence tensors; and, for a forward of `model` given no
    ``num_items_in_batch`` (the Trainer counts no tokens: a model that takes none), its loss -- the mean over this
    rank's shard of the rows -- weighted by the shard's share of the rows' loss tokens, n_r * G / n over the G ranks of
    cp x sp, so that the ranks' average is the rows' mean (item 3). Device tensors: nothing is read on the host."""
    whole = (labels != IGNORE_INDEX).sum() if isinstance(labels, torch.Tensor) else None
    with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                    no_restore_buffers=set(buffers)):
        handle = None
        if whole is not None and acc.mesh.size("pp") == 1:  # pipeline stages weigh their loss inside the model
            ranks = acc.mesh.layout.seq_split  # cp x sp: the ranks that hold a share of these rows
            share = (labels != IGNORE_INDEX).sum().double() * ranks / whole.clamp(min=1).double()  # labels: the shard
            handle = model.register_forward_hook(functools.partial(_weigh_mean_loss, share), with_kwargs=True)
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()


def _weigh_mean_loss(share: torch.Tensor, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
    if kwargs.get("num_items_in_batch") is not None:  # a summed loss over the Trainer's count: exact as it is
        return None
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        output["loss"] = output["loss"] * share.to(output["loss"].dtype)
        return output
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor) and output[0].dim() == 0:
        return (output[0] * share.to(output[0].dtype), *output[1:])
    return None


_FLASH_FIELDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _drop_flash_attention_fields(inputs: dict[str, Any]) -> None:
    """TRL's padding-free collator adds flash-attention's document boundaries beside ``position_ids``; ndparallel reads
    the documents from ``position_ids``, so the fields are dropped -- after checking they say the same."""
    given = [name for name in _FLASH_FIELDS if name in inputs]
    if not given:
        return
    positions = inputs["position_ids"]
    starts = torch.nonzero(positions.reshape(-1) == 0).reshape(-1)
    expected = torch.cat([starts, starts.new_tensor([positions.numel()])]).to(torch.int64)
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        value = inputs.get(name)
        if value is not None and (positions.shape[0] != 1 or not torch.equal(value.to(torch.int64).cpu(),
                                                                              expected.cpu())):
            raise ValueError(f"{name} does not match the documents position_ids describes (it restarts at 0 at "
                             f"{starts.tolist()}): context/sequence parallelism reads the documents from position_ids")
    for name in given:
        del inputs[name]


def _pad_to_split(inputs: dict[str, Any], length: int) -> None:
    """Pad every sequence tensor of the batch at the end to `length`, which splits over cp x sp. The pad positions
    are a document of their own (``position_ids`` from 0; masked where the batch has an ``attention_mask``) with -100
    labels: no real token attends to them or is scored on them, so the loss and gradients stay exact."""
    ids = inputs["input_ids"]
    extra = length - ids.shape[1]
    if extra == 0:
        return
    rows, width = ids.shape[0], ids.shape[1]
    for key, value in list(inputs.items()):
        if not (isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == width
                and value.shape[0] in (rows, 1)):
            continue
        if key == "position_ids":
            tail = torch.arange(extra, device=value.device, dtype=value.dtype).expand(value.shape[0], -1)
            inputs[key] = torch.cat([value, tail], dim=1)
        else:
            fill = IGNORE_INDEX if key in ("labels", "shift_labels") else 0
            inputs[key] = F.pad(value, (0, 0) * (value.dim() - 2) + (0, extra), value=fill)


def prepare_input(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, data: Any) -> Any:
        # The Trainer moves each input with `.to(args.device)`; on the CPU that device is "cpu:0", which torch takes
        # for another device than a tensor's "cpu" and copies every input -- after context parallelism has sharded
        # them in place, so the model would get copies whose whole rows nobody knows. A tensor already there stays.
        if (isinstance(data, torch.Tensor) and taken_over(self) and data.device.type == self.args.device.type
                and data.device.index in (None, self.args.device.index)):
            return data
        return original(self, data)
    return wrapper


def set_initial_training_values(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, args: Any, dataloader: Any) -> tuple:
        if not taken_over(self) or self.get_sp_size() == 1:
            return original(self, args, dataloader)
        # The Trainer counts sp_size times the data loader's batches per epoch: Accelerate's sequence parallelism
        # (DeepSpeed's Ulysses) cuts each batch into sp_size batches of their own. ndparallel's shards each batch
        # inside the model, and its loader yields what its length says; counted sp_size times over, the epochs, a
        # max_steps run's number of epochs (it stopped early) and the LR schedule of an epoch-based one were wrong.
        # The data-parallel size (the global batch) stays world / (tp x cp x sp).
        total = self.get_total_train_batch_size(args)
        self.get_sp_size, self.get_total_train_batch_size = (lambda: 1), (lambda _args: total)
        try:
            return original(self, args, dataloader)
        finally:
            del self.get_sp_size, self.get_total_train_batch_size
    return wrapper
