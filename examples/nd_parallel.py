"""Train a small Llama (or Qwen2) on a bundled text corpus with any mix of the supported parallelisms.

Written in Hugging Face Accelerate's ND-parallel style: only the imports differ. Nothing is downloaded: the model
is built from a config and the tokenizer works on raw bytes.

    python examples/nd_parallel.py --steps 20                                  # one process
    ndparallel launch --nproc-per-node 4 --dp-replicate-size 2 --dp-shard-size 2 examples/nd_parallel.py  # HSDP
    torchrun --nproc-per-node 2 examples/nd_parallel.py --dp-shard-size 2                                  # FSDP

Sizes left out on the command line come from the launcher (NDPARALLEL_* environment variables), else 1.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # so `import byte_tokenizer` works from anywhere
from byte_tokenizer import ByteTokenizer  # noqa: E402

from ndparallel import (  # noqa: E402
    Accelerator,
    FullyShardedDataParallelPlugin,
    ParallelismConfig,
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
    set_seed,
)
from ndparallel.training.run_metrics import peak_memory  # noqa: E402

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
MODEL_DEFAULTS = {"model": "llama", "hidden_size": 64, "layers": 2, "heads": 4, "kv_heads": 2, "seq_len": 128}


# ---- data: the corpus, tokenized once and cut into fixed-length blocks ------------------------------------------
class BlockDataset(Dataset):
    """Rows of a [num_blocks, seq_len] tensor as ``{"input_ids", "labels", "shift_labels", "position_ids"}``.

    Context parallelism shards each sequence, so the labels are shifted here, before sharding (the model uses
    ``shift_labels`` when given and ``labels`` only switches its loss on), and ``position_ids`` carry every token's
    global position to the rotary embeddings. Without CP the model computes exactly the same from them.
    """

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        block = self.blocks[index]
        return {"input_ids": block.clone(), "labels": block.clone(),
                "shift_labels": torch.nn.functional.pad(block[1:], (0, 1), value=-100),
                "position_ids": torch.arange(len(block))}


def build_dataset(seq_len: int = 128, path: str | Path = CORPUS) -> BlockDataset:
    """Tokenize the corpus (each paragraph wrapped in <bos>/<eos>) and cut it into blocks of `seq_len` tokens."""
    tokenizer = ByteTokenizer()
    text = Path(path).read_text(encoding="utf-8")
    ids = [i for para in text.split("\n\n") if para.strip() for i in tokenizer.encode(para.strip())]
    num_blocks = len(ids) // seq_len  # the tail that does not fill a block is dropped
    if num_blocks == 0:
        raise ValueError(f"{path} holds {len(ids)} tokens, fewer than one block of {seq_len}")
    return BlockDataset(torch.tensor(ids[: num_blocks * seq_len], dtype=torch.long).view(num_blocks, seq_len))


# ---- model: a small decoder built from a config, no download ------------------------------------------------------
def build_model(args: argparse.Namespace | Mapping[str, Any] | None = None, **overrides: Any) -> torch.nn.Module:
    """A randomly initialised LlamaForCausalLM / Qwen2ForCausalLM sized by `args` (Namespace or dict) and kwargs."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    opts = {**MODEL_DEFAULTS, **{k: v for k, v in given.items() if k in MODEL_DEFAULTS}, **overrides}
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[
        opts["model"]]
    config = config_cls(
        # Padded to a multiple of 64 (ids past the tokenizer's are never used) so tp sizes up to 64 split it.
        vocab_size=-(-ByteTokenizer.vocab_size // 64) * 64,
        hidden_size=opts["hidden_size"],
        intermediate_size=4 * opts["hidden_size"],
        num_hidden_layers=opts["layers"],
        num_attention_heads=opts["heads"],
        num_key_value_heads=opts["kv_heads"],
        max_position_embeddings=max(opts["seq_len"], 128),
        pad_token_id=ByteTokenizer.pad_token_id,
        bos_token_id=ByteTokenizer.bos_token_id,
        eos_token_id=ByteTokenizer.eos_token_id,
        tie_word_embeddings=False,  # tied weights complicate sharding the embedding and the head differently
        use_cache=False,
        attn_implementation="sdpa",  # context and sequence parallelism work on scaled_dot_product_attention
    )
    return model_cls(config)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for axis in ("pp", "dp-replicate", "dp-shard", "tp", "cp", "sp"):
        p.add_argument(f"--{axis}-size", type=int, default=None,
                       help="default: the launcher's, else 1; -1: the ranks that are left")
    p.add_argument("--model", choices=["llama", "qwen2"], default="llama")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample; a multiple of 8 (for CP/SP layouts)")
    p.add_argument("--batch-size", type=int, default=4, help="samples per data-parallel rank and micro-step")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--grad-accum", type=int, default=None,
                   help="micro-batches per optimizer step (default: the launcher's, else 1)")
    p.add_argument("--mixed-precision", choices=["no", "bf16", "fp16", "fp8"], default=None,
                   help="default: the launcher's, else no (fp8: torchao float8 layers, bf16 elsewhere)")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--cp-strategy", choices=["allgather", "ring"], default="allgather",
                   help="with --cp-size > 1: all-gather K/V, or pass K/V blocks around a ring (less memory)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp-size > 1: Megatron-style sequence parallelism of norms between TP regions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--json-out", type=Path, default=None, help="write a JSON summary here (main process)")
    args = p.parse_args(argv)
    if args.seq_len <= 0 or args.seq_len % 8:
        p.error(f"--seq-len must be a positive multiple of 8, got {args.seq_len}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)

    # 1. The layout and the Accelerator. Sizes left as None come from `ndparallel launch` (or are 1).
    parallelism_config = ParallelismConfig(
        pp_size=args.pp_size,
        dp_replicate_size=args.dp_replicate_size,
        dp_shard_size=args.dp_shard_size,
        tp_size=args.tp_size,
        cp_size=args.cp_size,
        sp_size=args.sp_size,
        tp_handler=TorchTensorParallelConfig(sequence_parallel=args.sequence_parallel),
        cp_handler=TorchContextParallelConfig(cp_comm_strategy=args.cp_strategy),
    )
    accelerator = Accelerator(
        parallelism_config=parallelism_config,
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
                                                   activation_checkpointing=args.activation_checkpointing),
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.grad_accum,
        # The schedule below counts optimizer steps, stepped by hand (Accelerate's default steps a prepared scheduler
        # once per data-parallel rank, counting the loader's batches).
        step_scheduler_with_optimizer=False,
    )
    summary = train(accelerator, args)  # steps 2 to 4, below
    if args.json_out is not None and accelerator.is_main_process:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(summary, indent=2))
    # 5. Every rank releases its process groups.
    accelerator.end_training()
    return summary


def train(accelerator: Accelerator, args: argparse.Namespace) -> dict[str, Any]:
    """Build the model and data, train for `args.steps` optimizer steps, and return a summary."""
    pc = accelerator.parallelism_config  # resolved against the world size
    layout = {axis: getattr(pc, f"{axis}_size") for axis in ("pp", "dp_replicate", "dp_shard", "tp", "cp", "sp")}
    accelerator.print(
        f"layout: {' x '.join(f'{k}={v}' for k, v in layout.items())} = {accelerator.num_processes} process(es) "
        f"on {accelerator.device.type}, mixed_precision={accelerator.mixed_precision}, "
        f"gradient_accumulation_steps={accelerator.gradient_accumulation_steps}"
    )

    # 2. Model, optimizer, schedule and data, built as for one process; prepare() distributes them.
    set_seed(args.seed)  # the same initial weights on every rank
    model = build_model(args)
    num_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 10)

    def lr_lambda(step: int) -> float:  # linear warmup, then linear decay to 10% of --lr
        if step < warmup:
            return (step + 1) / warmup
        return max(0.1, 1.0 - 0.9 * (step - warmup) / max(1, args.steps - warmup))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    dataset = build_dataset(args.seq_len)
    dataloader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    if len(dataloader) == 0:
        raise SystemExit(f"{len(dataset)} blocks are too few for batch size {args.batch_size} on "
                         f"{pc.dp_replicate_size * pc.dp_shard_size} data-parallel ranks")
    accelerator.print(f"model: {args.model}, {num_params / 1e6:.2f}M parameters; data: {len(dataset)} blocks of "
                      f"{args.seq_len} tokens, {len(dataloader)} batches per rank per epoch")

    def batches():  # the data loader, epoch after epoch
        for epoch in itertools.count():
            dataloader.set_epoch(epoch)
            yield from dataloader

    # Global tokens in one micro-step: every data-parallel rank reads its own batch of full sequences.
    tokens_per_micro_step = args.batch_size * args.seq_len * pc.dp_replicate_size * pc.dp_shard_size
    batch_iter = batches()
    # Step time, tokens/s and MFU (FLOPs per token from the model config; on a CPU the peak is an estimate).
    timer = accelerator.step_timer(model, seq_len=args.seq_len)
    history: list[dict[str, float]] = []
    throughput: list[float] = []
    total_tokens = interval_tokens = 0
    t_start = t_interval = time.perf_counter()

    # 3. The training loop: one iteration per optimizer step, made of gradient_accumulation_steps micro-steps.
    model.train()
    progress = accelerator.progress_bar(range(1, args.steps + 1), desc="training")
    for step in progress:
        lr = scheduler.get_last_lr()[0]  # the learning rate this step uses
        with timer.step(tokens=tokens_per_micro_step * accelerator.gradient_accumulation_steps):
            while True:
                batch = next(batch_iter)
                with accelerator.accumulate(model):
                    buffers = list(batch.values())  # under --cp-size/--sp-size, each rank keeps its part
                    with accelerator.maybe_context_parallel(
                        buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)
                    ):
                        loss = model(**batch).loss
                        accelerator.backward(loss)  # scaled so gradients match one process on the global batch
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()  # these do nothing until the accumulation window ends
                    if accelerator.sync_gradients:
                        scheduler.step()  # once per optimizer step
                    optimizer.zero_grad()
                step_loss = accelerator.reduce_loss(loss)  # global token mean of the step so far (collective)
                interval_tokens += tokens_per_micro_step
                total_tokens += tokens_per_micro_step
                if accelerator.sync_gradients:  # the optimizer stepped: this step is done
                    break

        history.append({"step": step, "loss": step_loss.item(), "lr": lr})
        progress.set_postfix(loss=f"{history[-1]['loss']:.3f}")
        if step % args.log_every == 0 or step == args.steps:
            now = time.perf_counter()
            tokens_per_s = interval_tokens / max(now - t_interval, 1e-9)
            throughput.append(tokens_per_s)
            interval_tokens, t_interval = 0, now
            if accelerator.is_main_process:
                mfu = timer.last["mfu"]
                progress.write(f"step {step:4d}/{args.steps} | loss {history[-1]['loss']:.4f} | lr {lr:.2e} | "
                               f"{tokens_per_s:,.0f} tokens/s" + (f" | MFU {mfu:.1%}" if mfu is not None else ""))
    elapsed = time.perf_counter() - t_start

    # 4. Peak memory of every rank, gathered to all of them and printed by the main process.
    peak, kind = peak_memory(accelerator.device)
    mine = {"rank": accelerator.process_index, "device": str(accelerator.device), "bytes": peak, "kind": kind}
    per_rank = [mine]
    if dist.is_available() and dist.is_initialized() and accelerator.num_processes > 1:
        per_rank = [None] * accelerator.num_processes
        dist.all_gather_object(per_rank, mine)
    for entry in per_rank:
        accelerator.print(f"rank {entry['rank']} ({entry['device']}): peak memory "
                          f"{entry['bytes'] / 2**20:,.1f} MiB ({entry['kind']})")
    accelerator.print(f"done: {args.steps} steps in {elapsed:.1f}s, final loss {history[-1]['loss']:.4f}, "
                      f"{total_tokens / elapsed:,.0f} tokens/s overall")

    summary = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "layout": layout,
        "world_size": accelerator.num_processes,
        "device": accelerator.device.type,
        "mixed_precision": accelerator.mixed_precision,
        "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
        "num_params": num_params,
        "num_blocks": len(dataset),
        "history": history,
        "losses": [h["loss"] for h in history],
        "tokens_per_s": throughput,
        "tokens_per_s_overall": total_tokens / elapsed,
        "elapsed_s": elapsed,
        "step_metrics": timer.summary(skip=min(2, len(timer.times) - 1)),  # medians after warm-up
        "peak_memory": per_rank,
    }
    return summary


if __name__ == "__main__":
    main()
