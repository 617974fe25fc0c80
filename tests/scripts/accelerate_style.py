"""A training script in Hugging Face Accelerate's ND-parallel style; only the imports name ndparallel.

With Accelerate the imports would read:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig, set_seed
(pipeline stages, --pp-size, and expert parallelism, --ep-size, are ndparallel's own: Accelerate has neither.)

Run it under `ndparallel launch` or the test harness; `main(argv)` returns the per-step losses (and, with
--return-params, the trained parameters gathered in full) so tests can compare them with `reference.py`.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from ndparallel import (Accelerator, FullyShardedDataParallelPlugin, MemoryKwargs, ParallelismConfig,
                        PipelineParallelConfig, TorchContextParallelConfig, TorchDynamoPlugin, TorchTensorParallelConfig,
                        set_seed)
from ndparallel.parallel.activation_checkpointing import OFFLOAD_ATTR
from ndparallel.parallel.memory import chunked_loss_of, chunked_loss_status
from ndparallel.parallel.memory.rms_norm import fused_rms_norms
from ndparallel.parallel.memory.tiled_mlp import tiled_mlps
from ndparallel.parallel.sequence.block import chunked_calls
from tiny_models import PLAIN_PLAN, VOCAB, TokenDataset, build_model, make_optimizer


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama")
    for axis in ("pp", "dp_replicate", "dp_shard", "tp", "cp", "sp", "ep"):
        p.add_argument(f"--{axis.replace('_', '-')}-size", type=int, default=None)
    p.add_argument("--pp-schedule", default="1f1b")
    p.add_argument("--pp-microbatches", type=int, default=None)
    p.add_argument("--pp-stages-per-rank", type=int, default=None)
    p.add_argument("--layers", type=int, default=None, help="decoder layers of the tiny model (default: its own)")
    p.add_argument("--sequence-parallel", action="store_true", help="Megatron-style SP with tensor parallelism")
    p.add_argument("--loss-parallel", action="store_true", help="cross-entropy on vocabulary-split logits")
    p.add_argument("--cp-strategy", choices=("allgather", "ring"), default="allgather")
    p.add_argument("--cp-no-load-balance", action="store_true")
    p.add_argument("--attn-implementation", default=None, help="the model's (default: sdpa)")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--optimizer", choices=("adamw", "adamw_foreach", "adamw_fused", "sgd"), default="adamw")
    p.add_argument("--uneven-labels", action="store_true")
    p.add_argument("--eval-inside-step", action="store_true",
                   help="iterate a prepared evaluation loader (other loss-token counts) inside every training step")
    p.add_argument("--mixed-precision", default="no")
    p.add_argument("--float64", action="store_true", help="the model and its loss in float64 (exactness checks)")
    p.add_argument("--bf16-model", action="store_true", help="load the model in bf16 (as torch_dtype=torch.bfloat16)")
    p.add_argument("--no-fsdp-plugin", action="store_true")
    p.add_argument("--activation-checkpointing", nargs="?", const="true", default=None,
                   help="alone: every block; or 'selective', k (every k-th block), as the plugin takes them")
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--offload-activations", action="store_true",
                   help="with --activation-checkpointing: the checkpointed blocks' inputs go to host memory")
    p.add_argument("--chunked-loss", default="auto", help="MemoryKwargs.chunked_loss: auto, true or false")
    p.add_argument("--loss-chunk-size", type=int, default=None)
    p.add_argument("--tiled-mlp", action="store_true")
    p.add_argument("--fused-rms-norm", action="store_true")
    p.add_argument("--mlp-tile-size", type=int, default=None)
    p.add_argument("--dynamo-backend", default=None, help="compile: a torch.compile backend (e.g. aot_eager)")
    p.add_argument("--regional-compilation", action="store_true", help="with --dynamo-backend: each block")
    p.add_argument("--return-params", action="store_true")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def _compiled_graphs() -> int:
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    pp = {} if args.pp_size is None else dict(pp_size=args.pp_size, pp_handler=PipelineParallelConfig(
        schedule=args.pp_schedule, microbatches=args.pp_microbatches, stages_per_rank=args.pp_stages_per_rank))
    pc = ParallelismConfig(dp_replicate_size=args.dp_replicate_size, dp_shard_size=args.dp_shard_size,
                           tp_size=args.tp_size, cp_size=args.cp_size, sp_size=args.sp_size, ep_size=args.ep_size,
                           **pp,
                           tp_handler=TorchTensorParallelConfig(
                               plan=PLAIN_PLAN if args.model == "plain" else None,
                               sequence_parallel=args.sequence_parallel, loss_parallel=args.loss_parallel),
                           cp_handler=TorchContextParallelConfig(cp_comm_strategy=args.cp_strategy,
                                                                 load_balance=not args.cp_no_load_balance))
    checkpointing = args.activation_checkpointing
    if args.offload_activations:
        checkpointing = {"every": int(checkpointing) if (checkpointing or "").isdigit() else 1, "offload": True}
    plugin = None if args.no_fsdp_plugin else FullyShardedDataParallelPlugin(
        fsdp_version=2, activation_checkpointing=checkpointing, cpu_offload=args.cpu_offload)
    memory = MemoryKwargs(chunked_loss=args.chunked_loss, loss_chunk_size=args.loss_chunk_size,
                          tiled_mlp=args.tiled_mlp, mlp_tile_size=args.mlp_tile_size,
                          fused_rms_norm=args.fused_rms_norm)
    dynamo = TorchDynamoPlugin(backend=args.dynamo_backend, use_regional_compilation=args.regional_compilation) \
        if args.dynamo_backend else None
    # The reference's schedule counts optimizer steps: stepped by hand on each (Accelerate's own scheduler steps once
    # per data-parallel rank and optimizer step).
    accelerator = Accelerator(parallelism_config=pc, fsdp_plugin=plugin, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.accum, dynamo_plugin=dynamo,
                              step_scheduler_with_optimizer=False, kwargs_handlers=[memory])

    set_seed(0)
    overrides = {"attn_implementation": args.attn_implementation} if args.attn_implementation else {}
    if args.layers is not None:
        overrides["num_hidden_layers"] = args.layers
    model = build_model(args.model, args.float64, **overrides)
    if args.bf16_model:
        model = model.to(torch.bfloat16)
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    global_batch = args.micro_batch * accelerator.data_parallel_size * args.accum
    dataset = TokenDataset(args.steps * global_batch, args.seq_len, VOCAB, args.uneven_labels)
    dataloader = DataLoader(dataset, batch_size=args.micro_batch, shuffle=False)
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    eval_loader = None
    if args.eval_inside_step:  # two loss tokens per sample: counts unlike any training batch's
        eval_set = TokenDataset(2 * accelerator.data_parallel_size, args.seq_len, VOCAB)
        eval_set.labels[:, : args.seq_len - 2] = -100
        eval_loader = accelerator.prepare(DataLoader(eval_set, batch_size=1))

    losses: list[float] = []
    eval_losses: list[float] = []
    graphs: list[int] = []  # graphs compiled so far, after each step (with --dynamo-backend)
    model.train()
    for batch in dataloader:
        with accelerator.accumulate(model):
            if eval_loader is not None:  # an evaluation pass in the middle of the step must not touch its loss
                model.eval()
                with torch.no_grad():
                    for eval_batch in eval_loader:
                        eval_losses.append(float(accelerator.reduce_loss(model(**eval_batch).loss)))
                model.train()
            buffers = [batch["input_ids"], batch["labels"]]
            if accelerator.cp_size * accelerator.sp_size > 1:  # what a context/sequence-parallel script adds: labels
                # shifted before sharding, and global positions for the rotary embeddings, sharded with the inputs
                batch["shift_labels"] = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
                batch["position_ids"] = torch.arange(args.seq_len, device=accelerator.device).repeat(len(buffers[0]), 1)
                buffers += [batch["shift_labels"], batch["position_ids"]]
            with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                                    no_restore_buffers=set(buffers)):
                loss = model(**batch).loss
                accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if accelerator.sync_gradients:  # once per optimizer step
                scheduler.step()
            optimizer.zero_grad()
        logged = accelerator.reduce_loss(loss)  # the global token mean of the step so far, on every rank
        if accelerator.sync_gradients:
            losses.append(float(logged))
            graphs.append(_compiled_graphs())

    chunked = chunked_loss_of(accelerator.unwrap_model(model))
    result: dict = {"losses": losses, "lr": scheduler.get_last_lr()[0], "eval_losses": eval_losses,
                    "graphs": graphs, "chunked_loss": chunked_loss_status(model),
                    "chunked_calls": chunked.calls if chunked is not None else 0,
                    "tiled_calls": sum(t.calls for t in tiled_mlps(accelerator.unwrap_model(model))),
                    "fused_norm_calls": sum(n.calls for n in fused_rms_norms(accelerator.unwrap_model(model))),
                    "chunked_block_calls": chunked_calls(accelerator.unwrap_model(model)),
                    "offloaded": getattr(getattr(accelerator.unwrap_model(model), OFFLOAD_ATTR, None), "stats", None)}
    if args.return_params:
        result["params"] = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
                            for name, p in accelerator.unwrap_model(model).named_parameters()}
    if args.json_out and accelerator.is_main_process:
        with open(args.json_out, "w") as f:
            json.dump({"losses": losses, "world_size": accelerator.num_processes}, f)
    accelerator.print(json.dumps({"losses": losses}))
    accelerator.end_training()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
