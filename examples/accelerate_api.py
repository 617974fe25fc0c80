"""Fine-tune a pretrained causal LM the way Hugging Face Accelerate's ND-parallel example does, with ndparallel.

The same API surface, used the same way as Accelerate's ``examples/torch_native_parallelism/nd_parallel.py``: a
`ParallelismConfig` and an FSDP2 plugin, ``Accelerator(log_with=..., mixed_precision="bf16", ...)``, a model loaded
with ``from_pretrained(dtype=torch.bfloat16)``, ``maybe_context_parallel`` with ``shift_labels`` and ``position_ids``,
the loss averaged over ``torch_device_mesh["dp_cp"]``, ``save_state`` every few steps, ``log`` to trackers, and
``save_pretrained`` at the end. Nothing is downloaded: a small Llama is written to ``<save-dir>/pretrained`` first
(standing in for a hub model), and the bundled corpus is the data.

    torchrun --nproc-per-node 2 examples/accelerate_api.py --dp-shard-size 2
    ndparallel launch --nproc-per-node 4 --dp-shard-size 2 --tp-size 2 examples/accelerate_api.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the example's helpers, from anywhere
from nd_parallel import build_dataset, build_model  # noqa: E402

from ndparallel import Accelerator  # noqa: E402
from ndparallel.parallelism_config import ParallelismConfig  # noqa: E402
from ndparallel.utils import FullyShardedDataParallelPlugin, set_seed  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for axis in ("dp-replicate", "dp-shard", "tp", "cp"):
        p.add_argument(f"--{axis}-size", type=int, default=None, help="default: the launcher's, else 1")
    p.add_argument("--sequence-length", type=int, default=64)
    p.add_argument("--num-steps", type=int, default=8)
    p.add_argument("--save-dir", type=Path, default=Path("outputs"))
    p.add_argument("--checkpoint-frequency", type=int, default=4)
    p.add_argument("--log-with", default="jsonl", help="trackers (comma-separated), e.g. jsonl,tensorboard")
    return p.parse_args(argv)


def forward(model: torch.nn.Module, batch: dict, optimizer: Any, accelerator: Accelerator) -> torch.Tensor:
    """One step: the sequence tensors are sharded over cp for the block; the loss is averaged over the ranks that
    hold different samples or different parts of them (the ``dp_cp`` view), as Accelerate's example does."""
    buffers = [batch["input_ids"], batch["shift_labels"], batch["labels"], batch["position_ids"]]
    with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1, 1],
                                            no_restore_buffers=set(buffers)):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    if accelerator.parallelism_config.dp_cp_dim_names:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=accelerator.torch_device_mesh["dp_cp"].get_group())
    return loss


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    set_seed(42)
    parallelism_config = ParallelismConfig(dp_replicate_size=args.dp_replicate_size,
                                           dp_shard_size=args.dp_shard_size, tp_size=args.tp_size,
                                           cp_size=args.cp_size)
    fsdp2_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                  transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                                  state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(log_with=args.log_with.split(","), mixed_precision="bf16",
                              parallelism_config=parallelism_config, fsdp_plugin=fsdp2_plugin,
                              project_dir=args.save_dir)
    accelerator.init_trackers("nd_parallel_training", config={"sequence_length": args.sequence_length,
                                                               "num_steps": args.num_steps})

    # A "pretrained" model on disk, loaded in bf16 as from the hub (ndparallel keeps fp32 master weights).
    pretrained = args.save_dir / "pretrained"
    with accelerator.main_process_first():
        if accelerator.is_main_process and not (pretrained / "config.json").exists():
            build_model(seq_len=args.sequence_length).save_pretrained(pretrained)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.bfloat16, use_cache=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    dataloader = DataLoader(build_dataset(args.sequence_length), batch_size=1)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)

    losses = []
    accelerator.print("Starting training...")
    for step, batch in enumerate(dataloader):
        if step >= args.num_steps:
            break
        loss = forward(model, batch, optimizer, accelerator)
        losses.append(loss.item())
        accelerator.print(f"Step {step}/{args.num_steps}, Loss: {loss.item():.4f}")
        if step % args.checkpoint_frequency == 0 and step > 0:
            accelerator.save_state(args.save_dir / f"checkpoint-{step}")
        accelerator.log({"loss": loss.item()}, step=step)

    final = args.save_dir / "final"
    model.save_pretrained(final)  # every process: the full weights are gathered from the shards
    accelerator.print(f"Model saved to {final}")
    summary = {"losses": losses, "final": str(final), "world_size": accelerator.num_processes}
    if accelerator.is_main_process:
        (args.save_dir / "summary.json").write_text(json.dumps(summary))
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
