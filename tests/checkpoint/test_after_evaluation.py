"""Everything right after a forward that no backward follows: an evaluation (``torch.no_grad()``,
``torch.inference_mode()``) or a forward whose loss is never used.

FSDP2 keeps the root unit's parameters (embedding, head) gathered from a forward to its backward. Without a backward
they used to stay gathered: `model.parameters()` were no longer the optimizer's tensors (save_state refused: "optimizer
0 updates parameters of no single prepared model"), the gathered bytes stayed held, a gradient norm taken over
`model.parameters()` missed the root's gradients, and an optimizer step left the gathered copy stale for the next
forward. Each rank of each layout here:

1. trains one step in which a grad-enabled forward whose loss is never used comes between backward and the clip
   (not under pipeline stages, where a call in training mode runs its backward too): the norm over a
   `model.parameters()` taken after it equals the norm taken before it, and after the optimizer step nothing is left
   gathered;
2. trains a second step, then runs every kind of forward without backward, each followed by every entry point that
   reads the parameters (`unwrap_model`, `get_state_dict`, `save_model`, `clip_grad_norm_`, `save_state`): after an
   evaluation forward the bytes held gathered are what they were before it (none), and after each entry point the
   model's parameters are the optimizer's;
3. trains two more steps. A second run loads the checkpoint saved in 2 and trains the same two steps: its losses equal
   the uninterrupted run's bit for bit (same layout, same reductions).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint  # noqa: F401 - imported once here, not again in every forked rank
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import LlamaForCausalLM  # noqa: F401 - imported once here (transformers imports models lazily)

from harness import run_ranks
from tiny_models import VOCAB, build_model

SEQ = 16
ROWS = 4  # the global batch: every layout below splits it evenly (pipeline micro-batches included)


def gathered_bytes(model: torch.nn.Module) -> int:
    """Bytes of FSDP2's gathered (unsharded) parameter storage held now, over every unit of `model` (its stage
    modules too under pipeline stages)."""
    modules = list(model.modules()) + [m for stage in getattr(model, "stage_modules", []) for m in stage.modules()]
    total, seen = 0, set()
    for module in modules:
        if not isinstance(module, FSDPModule) or id(module) in seen:
            continue
        seen.add(id(module))
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None) or [g for g in [state._fsdp_param_group] if g]
        for group in groups:
            for param in group.fsdp_params:
                unsharded = getattr(param, "_unsharded_param", None)
                if isinstance(unsharded, DTensor):  # under tensor parallelism: the storage is its local tensor's
                    unsharded = unsharded._local_tensor
                if unsharded is not None:
                    total += unsharded.untyped_storage().nbytes()
    return total


def _owned(accelerator, model, optimizer) -> bool:
    """Whether the optimizer's parameters are the model's parameters (what save_state's owner check asks)."""
    from ndparallel.parallel import interface

    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return mine <= {id(p) for p in interface(model).state_module().parameters()} | {
        id(p) for s in getattr(model, "stage_modules", []) for p in s.parameters()}


def run(layout: dict, directory: str, resume: bool, model_name: str = "llama", lora: bool = False,
        plugin: dict | None = None) -> dict:
    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig, set_seed

    accelerator = Accelerator(parallelism_config=ParallelismConfig(**layout),
                              fsdp_plugin=FullyShardedDataParallelPlugin(**(plugin or {})))
    set_seed(0)
    if lora:
        from lora_run import lora_model

        model = lora_model(model_name)
    else:
        model = build_model(model_name)
    # SGD with momentum: an optimizer state to save, and updates linear in the gradients.
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    rows = ROWS // accelerator.data_parallel_size
    rank = accelerator.process_index

    def batch(step: int) -> dict:
        ids = (torch.arange(ROWS * SEQ).reshape(ROWS, SEQ) * (step + 3)) % VOCAB
        start = rows * (accelerator.mesh.rank("batch") if accelerator.data_parallel_size > 1 else 0)
        ids = ids[start:start + rows]
        return {"input_ids": ids, "labels": ids.clone(), "shift_labels": F.pad(ids[:, 1:], (0, 1), value=-100),
                "position_ids": torch.arange(SEQ).repeat(rows, 1)}

    def forward(step: int):
        b = batch(step)
        buffers = list(b.values())
        return accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                                  no_restore_buffers=set(buffers)), b

    def train_step(step: int, unused_forward: bool = False) -> tuple[float, dict]:
        context, b = forward(step)
        with context:
            loss = model(**b).loss
            accelerator.backward(loss)
        checks = {}
        if unused_forward:  # between backward and the clip: a forward whose loss is never used
            checks["norm_before"] = float(accelerator.clip_grad_norm_(model.parameters(), 1e9))
            context, b = forward(step)
            with context:
                model(**b)
            checks["norm_after"] = float(accelerator.clip_grad_norm_(model.parameters(), 1e9))
        optimizer.step()
        checks["gathered_after_step"] = gathered_bytes(model)
        optimizer.zero_grad()
        return float(accelerator.reduce_loss(loss)), checks

    losses, checks = {}, {}
    if resume:
        accelerator.load_state(f"{directory}/state")
        first = 3
    else:
        # Under pipeline stages a call in training mode with gradients runs the backward too: no unused forward there.
        losses[1], checks["step 1"] = train_step(1, unused_forward=layout.get("pp_size", 1) == 1)
        losses[2], _ = train_step(2)
        evaluation = batch(0)
        kinds = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "unused": torch.enable_grad}
        for kind, mode in kinds.items():
            before = gathered_bytes(model)
            model.eval()
            with mode():
                model(input_ids=evaluation["input_ids"], labels=evaluation["labels"])
            model.train()
            after = {"before": before, "after_forward": gathered_bytes(model)}
            for call, fn in [
                ("unwrap_model", lambda: accelerator.unwrap_model(model)),
                ("get_state_dict", lambda: accelerator.get_state_dict(model)),
                ("save_model", lambda: accelerator.save_model(model, f"{directory}/hf_{kind}")),
                ("clip_grad_norm_", lambda: accelerator.clip_grad_norm_(model.parameters(), 1.0)),
                ("save_state", lambda: accelerator.save_state(f"{directory}/state")),
            ]:
                fn()
                after[call] = (_owned(accelerator, model, optimizer), gathered_bytes(model))
                model.eval()  # the next entry point meets a forward without backward again
                with mode():
                    model(input_ids=evaluation["input_ids"], labels=evaluation["labels"])
                model.train()
            checks[kind] = after
        first = 3
    for step in (first, first + 1):
        losses[step], _ = train_step(step)
    accelerator.end_training()
    return {"losses": losses, "checks": checks, "rank": rank}


LAYOUTS = {
    "fsdp2": (2, {"dp_shard_size": 2}, {}),
    "zero2": (2, {"dp_shard_size": 2}, {"plugin": {"reshard_after_forward": False}}),
    "hsdp2x2": (4, {"dp_replicate_size": 2, "dp_shard_size": 2}, {}),
    "fsdp2xtp2": (4, {"dp_shard_size": 2, "tp_size": 2}, {}),
    "cp2": (2, {"cp_size": 2}, {}),
    "sp2": (2, {"sp_size": 2}, {}),
    "pp2xfsdp2": (4, {"pp_size": 2, "dp_shard_size": 2}, {}),
    "ep2": (2, {"dp_shard_size": 2, "ep_size": 2}, {"model_name": "qwen3_moe"}),
    "lora_fsdp2": (2, {"dp_shard_size": 2}, {"lora": True}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_call_after_a_forward_without_backward(name, tmp_path):
    world, layout, options = LAYOUTS[name]
    full = run_ranks(run, world, layout, str(tmp_path), False, *_args(options))
    resumed = run_ranks(run, world, layout, str(tmp_path), True, *_args(options))
    for res in full:
        step1 = res["checks"]["step 1"]
        # The norm over parameters taken after the unused forward is the norm over the gradients (the root's too).
        if "pp" not in name:
            assert step1["norm_after"] == pytest.approx(step1["norm_before"], rel=1e-6), (res["rank"], step1)
        assert step1["gathered_after_step"] == 0, (res["rank"], step1)
        for kind in ("no_grad", "inference_mode", "unused"):
            after = res["checks"][kind]
            assert after["before"] == 0, (res["rank"], kind, after)
            if kind != "unused":  # an evaluation forward gives back what it gathered at once
                assert after["after_forward"] == 0, (res["rank"], kind, after)
            for call in ("unwrap_model", "get_state_dict", "save_model", "clip_grad_norm_", "save_state"):
                assert after[call] == (True, 0), (res["rank"], kind, call, after)
    # The checkpoint saved after evaluation forwards resumes the uninterrupted run exactly.
    for a, b in zip(full, resumed):
        assert b["losses"] == {k: v for k, v in a["losses"].items() if k > 2}, (name, a["losses"], b["losses"])


def _args(options: dict) -> tuple:
    return (options.get("model_name", "llama"), options.get("lora", False), options.get("plugin"))
