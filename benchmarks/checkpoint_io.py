"""Print checkpoint size and save / load time of `save_state` / `load_state` per layout.

    python benchmarks/checkpoint_io.py [--hidden-size 512 --layers 8] [--layouts single,fsdp4,...]

A Llama built from a config (vocab 32000, fp32) with AdamW takes one optimizer step (so the optimizer holds its
two moments), then every rank saves, and loads the checkpoint back. Times are wall clock on rank 0, barriers
included; on a shared CPU machine the ranks compete for the same cores, so compare layouts within one run. The last
rows load the dp_shard 4 checkpoint under other layouts (resharding).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch  # noqa: E402

torch.set_num_threads(1)  # forked ranks share the cores

import torch.distributed.checkpoint  # noqa: E402,F401 - imported before forking
import transformers  # noqa: E402,F401 - imported before forking

from common import config_sizes, llama  # noqa: E402

from ndparallel.distributed.layout import Layout  # noqa: E402
from ndparallel.test_utils import run_ranks  # noqa: E402

LAYOUTS = {  # name: (layout, state_dict_type)
    "single": (Layout(), "SHARDED_STATE_DICT"),
    "ddp2": (Layout(dp_replicate=2), None),
    "fsdp2": (Layout(dp_shard=2), "SHARDED_STATE_DICT"),
    "fsdp4": (Layout(dp_shard=4), "SHARDED_STATE_DICT"),
    "hsdp2x2": (Layout(dp_replicate=2, dp_shard=2), "SHARDED_STATE_DICT"),
    "fsdp2xtp2": (Layout(dp_shard=2, tp=2), "SHARDED_STATE_DICT"),
    "fsdp2xcp2": (Layout(dp_shard=2, cp=2), "SHARDED_STATE_DICT"),
    "fsdp4_full": (Layout(dp_shard=4), "FULL_STATE_DICT"),
}


def _run(sizes: dict, state_dict_type: str | None, hidden: int, layers: int, save_dir: str | None,
         load_dir: str | None) -> dict:
    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

    plugin = None if state_dict_type is None else FullyShardedDataParallelPlugin(state_dict_type=state_dict_type)
    accelerator = Accelerator(parallelism_config=ParallelismConfig(**sizes), fsdp_plugin=plugin)
    model = llama(vocab=32000, hidden=hidden, layers=layers, intermediate=3 * hidden, max_positions=2048)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, 32000, (1, 64))  # one training step, so AdamW holds its moments
    batch = {"input_ids": ids, "labels": ids.clone()}
    if accelerator.cp_size > 1:  # as a context-parallel script does (see tests/scripts/accelerate_style.py)
        batch["shift_labels"] = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
        batch["position_ids"] = torch.arange(64).unsqueeze(0)
    buffers = list(batch.values())
    with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                            no_restore_buffers=set(buffers)):
        accelerator.backward(model(**batch).loss)
    optimizer.step()
    optimizer.zero_grad()
    out = {"params": params}
    if save_dir:
        accelerator.wait_for_everyone()
        start = time.perf_counter()
        accelerator.save_state(save_dir)
        out["save_s"] = time.perf_counter() - start
    if load_dir:
        accelerator.wait_for_everyone()
        start = time.perf_counter()
        accelerator.load_state(load_dir)
        out["load_s"] = time.perf_counter() - start
    accelerator.end_training()
    return out


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ndparallel_ckpt_bench_"))
    try:
        print(f"{'layout':12s} {'world':>5s} {'params':>8s} {'size MiB':>9s} {'files':>5s} {'save s':>7s} {'load s':>7s}")
        for name in args.layouts.split(","):
            layout, sdt = LAYOUTS[name]
            world, sizes = layout.world, config_sizes(layout)
            path = root / name
            res = run_ranks(_run, world, sizes, sdt, args.hidden_size, args.layers, str(path), str(path),
                            timeout=1200)[0]
            files = sum(1 for q in path.rglob("*") if q.is_file())
            print(f"{name:12s} {world:5d} {res['params'] / 1e6:7.1f}M {size_of(path) / 2**20:9.1f} {files:5d} "
                  f"{res['save_s']:7.2f} {res['load_s']:7.2f}", flush=True)
        if "fsdp4" in args.layouts.split(","):
            print("\nresharding: the fsdp4 checkpoint loaded under")
            for name in ("fsdp2", "single", "fsdp2xtp2"):
                layout, sdt = LAYOUTS[name]
                world, sizes = layout.world, config_sizes(layout)
                res = run_ranks(_run, world, sizes, sdt, args.hidden_size, args.layers, None, str(root / "fsdp4"),
                                timeout=1200)[0]
                print(f"{name:12s} {world:5d} load {res['load_s']:.2f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
