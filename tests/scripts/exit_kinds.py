"""Launched by tests/launch/test_launch_exit.py under `ndparallel launch`: scripts of every kind that finish (or raise) without
releasing their process group themselves, as most scripts do.

``MODE --out DIR``: each rank trains two steps the way MODE does, then ends:
- ``accelerator``: ndparallel's Accelerator (FSDP2 over the ranks), no ``end_training()``;
- ``raises``: the same, then a ValueError on every rank;
- ``accelerate``: stock Accelerate's Accelerator (plain DDP), no ``end_training()``;
- ``trainer``: the Hugging Face Trainer (stock Accelerate inside) on a tiny Llama;
- ``torch``: plain ``torch.distributed`` (init, all-reduce), no ``destroy_process_group()``.

Before anything else each rank registers an exit handler; handlers run last-registered-first, so this one runs after
every handler the libraries register, and writes ``DIR/rank_<RANK>.txt``: ``released`` if no process group is left
for interpreter shutdown to tear down, else ``left <backend>``.
"""

import atexit
import os
import sys
from pathlib import Path

MODES = ("accelerator", "raises", "accelerate", "trainer", "torch")
mode, out = sys.argv[1], Path(sys.argv[sys.argv.index("--out") + 1])
assert mode in MODES, mode
rank = int(os.environ["RANK"])


def report() -> None:
    import torch.distributed as dist

    left = dist.is_initialized()
    (out / f"rank_{rank}.txt").write_text(f"left {dist.get_backend()}" if left else "released")


atexit.register(report)

import torch  # noqa: E402


def batches(n: int = 2) -> list[torch.Tensor]:
    torch.manual_seed(rank)
    return [torch.randn(4, 8) for _ in range(n)]


if mode in ("accelerator", "raises"):
    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=int(os.environ["WORLD_SIZE"])),
                      fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = acc.prepare(model, optimizer)
    for x in batches():
        acc.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    if mode == "raises":
        raise ValueError("a clear error on every rank")
elif mode == "accelerate":
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    for x in batches():
        acc.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
elif mode == "trainer":
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (8, 16))]
    args = TrainingArguments(output_dir=str(out / "trainer"), max_steps=2, per_device_train_batch_size=2,
                             report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=rows).train()
else:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == dist.get_world_size()
print(f"rank {rank}: {mode} finished", flush=True)
