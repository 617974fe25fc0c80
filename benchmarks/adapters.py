"""What a LoRA fine-tune reduces and keeps per step, against a full fine-tune of the same model, in one run.

    python benchmarks/adapters.py [--hidden 256] [--layers 4] [--rank 8] [--seq 64] [--batch 2]

For FSDP2 (dp_shard 2) and DDP (dp_replicate 2), on forked gloo ranks (`run_ranks`), a Llama with LoRA on
every projection and the same Llama trained in full: the bytes one rank sends in gradient reductions during a
training step (`CollectiveCounter`: FSDP2's reduce-scatters, DDP's all-reduces), next to the bytes the
trainable parameters' gradients alone would need (the counter's ring formulas: reduce-scatter (n-1)/n x bytes,
all-reduce 2(n-1)/n x bytes); and the rank's parameter, gradient and optimizer-state bytes. A frozen base that were
reduced or given optimizer state would show as reduced bytes above the adapters' and as optimizer bytes above
2 x the adapters'.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

torch.set_num_threads(1)

from common import config_sizes, llama, model_state_bytes  # noqa: E402
from ndparallel.distributed.layout import Layout  # noqa: E402
from ndparallel.test_utils import run_ranks  # noqa: E402
from ndparallel.test_utils.collectives import CollectiveCounter  # noqa: E402

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def step(options: dict, layout: Layout, lora: bool) -> dict:
    from peft import LoraConfig, get_peft_model

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

    fsdp = layout.fsdp > 1
    acc = Accelerator(parallelism_config=ParallelismConfig(**config_sizes(layout)),
                      fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2) if fsdp else None)
    hidden = options["hidden"]
    model = llama(vocab=1024, hidden=hidden, layers=options["layers"], intermediate=4 * hidden,
                  max_positions=options["seq"])
    if lora:
        model = get_peft_model(model, LoraConfig(r=options["rank"], lora_alpha=2 * options["rank"],
                                                 target_modules=PROJECTIONS, lora_dropout=0.0))
    trainable = [p for p in model.parameters() if p.requires_grad]
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    model, optimizer = acc.prepare(model, optimizer)
    ids = torch.randint(0, 1024, (options["batch"], options["seq"]), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # the second step is measured (the first creates the optimizer state)
        with CollectiveCounter() as counter:
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    memory = model_state_bytes(model, optimizer)
    reduced = counter.bytes.get("reduce_scatter", 0) + counter.bytes.get("all_reduce", 0)
    n = acc.num_processes
    needed = trainable_bytes * ((n - 1) / n if fsdp else 2 * (n - 1) / n)
    return {"reduced": reduced, "needed": needed, "trainable": trainable_bytes, **memory}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 256), ("layers", 4), ("rank", 8), ("seq", 64), ("batch", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    options = vars(p.parse_args(argv))
    print(f"Llama hidden {options['hidden']}, {options['layers']} layers; LoRA r {options['rank']} on every "
          "projection; bytes per rank for one training step (fp32)")
    print(f"{'layout':14s} {'run':5s} {'trainable':>11s} {'reduced':>11s} {'grads need':>11s} {'ratio':>6s} "
          f"{'params':>11s} {'grads':>11s} {'optimizer':>11s}")
    for label, layout in (("FSDP2 2", Layout(dp_shard=2)), ("DDP 2", Layout(dp_replicate=2))):
        for lora in (True, False):
            r = run_ranks(step, layout.world, options, layout, lora, timeout=900)[0]
            print(f"{label:14s} {'LoRA' if lora else 'full':5s} {r['trainable']:11,d} {r['reduced']:11,d} "
                  f"{int(r['needed']):11,d} {r['reduced'] / r['needed']:6.3f} {r['params']:11,d} {r['grads']:11,d} "
                  f"{r['optimizer']:11,d}")
    print("ratio: bytes reduced / bytes the trainable gradients need (1.000: nothing frozen is reduced; FSDP2 pads "
          "each shard to equal sizes, which shows as a little above 1)")


if __name__ == "__main__":
    main()
