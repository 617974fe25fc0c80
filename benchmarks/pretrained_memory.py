"""Print the peak resident memory (RSS) of every rank when a pretrained model is loaded into FSDP2, with and
without ``cpu_ram_efficient_loading``.

    python benchmarks/pretrained_memory.py [--nproc 4] [--hidden-size 1024 --layers 12]

First saves a Llama built from a config (vocab 32000, fp32; ~200M parameters, ~800 MB by default) as a local
Hugging Face directory (safetensors), once. Then, for each way of loading, starts ``--nproc`` fresh processes with
``ndparallel launch`` (dp_shard = nproc) that load it and ``prepare`` it, and prints per rank: RSS before loading
(after imports), the peak RSS (VmHWM) and the RSS after ``prepare``:

- ``every rank from_pretrained``: no flag; every rank reads the whole model, then FSDP2 keeps its shard;
- ``rank 0 reads, broadcasts``: ``cpu_ram_efficient_loading=True``; rank 0 ``from_pretrained``, the others build
  the model under ``init_empty_weights()``; after sharding rank 0 broadcasts tensor by tensor;
- ``each rank reads its slices``: ``cpu_ram_efficient_loading=True``; every rank builds the model under
  ``init_empty_weights()`` and reads only its own slices of the safetensors files.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import llama, peak_rss_bytes, rss_bytes

MODES = {
    "every": "every rank from_pretrained",
    "broadcast": "rank 0 reads, broadcasts",
    "slices": "each rank reads its slices",
}


def worker(mode: str, path: str, out: str) -> None:
    """One rank of one way of loading (run under `ndparallel launch`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig, init_empty_weights

    plugin = FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=mode != "every")
    accelerator = Accelerator(parallelism_config=ParallelismConfig(), fsdp_plugin=plugin)
    before = rss_bytes() / 2**20
    if mode == "every" or (mode == "broadcast" and accelerator.is_main_process):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    model = accelerator.prepare(model)
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / 2**20
    peak = peak_rss_bytes() / 2**20
    with open(f"{out}.{accelerator.process_index}", "w") as f:
        json.dump({"rank": accelerator.process_index, "before": before, "peak": peak, "after": rss_bytes() / 2**20,
                   "shard": local}, f)
    accelerator.end_training()


def save_model(path: Path, hidden: int, layers: int) -> float:
    if not (path / "config.json").is_file():
        model = llama(vocab=32000, hidden=hidden, layers=layers, intermediate=hidden * 11 // 4, heads=16,
                      max_positions=2048)
        model.save_pretrained(path, max_shard_size="200MB")
    return sum(p.stat().st_size for p in path.glob("*.safetensors")) / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "ndparallel_bench_llama")
    p.add_argument("--worker", nargs=3, metavar=("MODE", "PATH", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    path = args.model_dir / f"h{args.hidden_size}_l{args.layers}"
    size = save_model(path, args.hidden_size, args.layers)
    print(f"model: {path} ({size:,.0f} MiB of safetensors); {args.nproc} ranks, dp_shard_size={args.nproc}")
    print(f"{'mode':28s} {'rank':>4s} {'RSS before':>10s} {'peak RSS':>9s} {'RSS after':>9s} {'shard':>7s}  (MiB)")
    with tempfile.TemporaryDirectory() as tmp:
        for mode, label in MODES.items():
            out = Path(tmp) / mode
            cmd = [sys.executable, "-m", "ndparallel.cli", "launch", "--nproc-per-node", str(args.nproc),
                   "--dp-shard-size", str(args.nproc), __file__, "--worker", mode, str(path), str(out)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            for rank in range(args.nproc):
                r = json.loads(Path(f"{out}.{rank}").read_text())
                print(f"{label:28s} {rank:4d} {r['before']:10.0f} {r['peak']:9.0f} {r['after']:9.0f} {r['shard']:7.0f}",
                      flush=True)


if __name__ == "__main__":
    main()
