"""The same training step three ways, run on forked ranks: ndparallel, plain PyTorch written out, and Accelerate.

`measure(spec, args)` runs on every rank. It builds the library's model and the plain one (same seed, same data,
same layout) and alternates blocks of steps between them, so machine noise hits both alike; then it counts one
extra step of each with `CollectiveCounter` and measures model states. `accelerate_row` tries Hugging Face
Accelerate on the same layout and returns its figures or its error.

The plain version uses no ndparallel: `init_device_mesh`, `parallelize_module` with the same styles as the
library's Llama plan, `fully_shard` per decoder layer then the root (a 2-D mesh for HSDP), and the loop written
out (forward with labels, backward, optimizer step, zero_grad).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from comm_count import CollectiveCounter, SavedActivations, model_state_bytes, peak_rss_bytes, reset_peak_rss


@dataclass(frozen=True)
class Layout:
    name: str
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def batch_ranks(self) -> int:
        return self.dp_replicate * self.dp_shard


LAYOUTS = {
    "fsdp2": Layout("fsdp2", dp_shard=2),
    "hsdp": Layout("hsdp", dp_replicate=2, dp_shard=2),
    "tp": Layout("tp", tp=2),
    "fsdp2_tp": Layout("fsdp2_tp", dp_shard=2, tp=2),
}


def llama_config(args: Any):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
        max_position_embeddings=max(args.seq, 128), attn_implementation="sdpa")


def build_model(args: Any):
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config(args))


def dataset(args: Any, layout: Layout) -> torch.Tensor:
    """Token ids, one row per sample: enough for every step of every block, over every data-parallel rank."""
    g = torch.Generator().manual_seed(1)
    rows = args.batch * layout.batch_ranks * (args.warmup + args.steps * args.repeats + 2)
    return torch.randint(0, args.vocab, (rows, args.seq), generator=g)


def device_and_dtype(args: Any) -> tuple[torch.device, str]:
    import os

    if torch.cuda.is_available() and not args.cpu:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local), "bf16"
    return torch.device("cpu"), "no"


# ---- the library ---------------------------------------------------------------------------------------------
class LibraryRun:
    def __init__(self, layout: Layout, args: Any, data: torch.Tensor) -> None:
        from torch.utils.data import DataLoader

        from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

        device, precision = device_and_dtype(args)
        pc = ParallelismConfig(dp_replicate_size=layout.dp_replicate, dp_shard_size=layout.dp_shard,
                               tp_size=layout.tp)
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2) if layout.dp_shard > 1 else None
        self.accelerator = Accelerator(parallelism_config=pc, fsdp_plugin=plugin, mixed_precision=precision,
                                       cpu=device.type == "cpu")
        model = build_model(args)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        samples = [{"input_ids": row, "labels": row} for row in data]
        loader = DataLoader(samples, batch_size=args.batch)
        self.model, self.optimizer, self.loader = self.accelerator.prepare(model, optimizer, loader)
        self.batches = iter(self.loader)

    def step(self, saved: SavedActivations | None = None) -> None:
        batch = next(self.batches)
        with self.accelerator.accumulate(self.model):
            if saved is not None:
                with saved.context():
                    loss = self.model(**batch).loss
            else:
                loss = self.model(**batch).loss
            self.accelerator.backward(loss)
            self.optimizer.step()
        self.optimizer.zero_grad()


# ---- plain PyTorch -------------------------------------------------------------------------------------------
# The plan the library picks for a transformers Llama: the model's own (config.base_model_tp_plan + _tp_plan), which
# leaves the embedding replicated.
TP_STYLES = {
    "model.layers.*.self_attn.q_proj": ("colwise",), "model.layers.*.self_attn.k_proj": ("colwise",),
    "model.layers.*.self_attn.v_proj": ("colwise",), "model.layers.*.self_attn.o_proj": ("rowwise",),
    "model.layers.*.mlp.gate_proj": ("colwise",), "model.layers.*.mlp.up_proj": ("colwise",),
    "model.layers.*.mlp.down_proj": ("rowwise",), "lm_head": ("colwise_replicate",),
}


class PlainRun:
    def __init__(self, layout: Layout, args: Any, data: torch.Tensor) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module)

        device, precision = device_and_dtype(args)
        self.device = device
        mesh = init_device_mesh(device.type, (layout.dp_replicate, layout.dp_shard, layout.tp),
                                mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        model = build_model(args).to(device)
        if layout.tp > 1:
            styles = {
                "colwise": ColwiseParallel(), "rowwise": RowwiseParallel(),
                "colwise_replicate": ColwiseParallel(output_layouts=Replicate()),
            }
            plan = {k: styles[v[0]] for k, v in TP_STYLES.items()}
            # Attention and MLP hand q, k, v (gate, up) one replicated DTensor input, so backward all-reduces
            # their summed input gradient once per block rather than once per layer (as the library does).
            share = dict(desired_input_kwarg_layouts={"hidden_states": Replicate()}, use_local_output=False,
                         input_kwarg_layouts={"hidden_states": Replicate()})
            plan["model.layers.*.self_attn"] = PrepareModuleInput(**share)
            plan["model.layers.*.mlp"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                                            desired_input_layouts=(Replicate(),),
                                                            use_local_output=False)
            parallelize_module(model, mesh["tp"], plan)
        bf16 = precision == "bf16"
        self.autocast = bf16
        if layout.batch_ranks > 1:
            if layout.dp_replicate > 1 and layout.dp_shard > 1:
                dp_mesh = mesh["dp_replicate", "dp_shard"]  # HSDP: replicate outer, shard inner
            elif layout.dp_shard > 1:
                dp_mesh = mesh["dp_shard"]
            else:
                dp_mesh = mesh["dp_replicate"]
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
                else MixedPrecisionPolicy()
            reshard = layout.dp_shard > 1
            for layer in model.model.layers:
                fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
            fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
            self.autocast = False
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        # This rank's rows: its coordinate along dp_replicate x dp_shard picks every batch_ranks-th batch.
        data_rank = mesh["dp_replicate"].get_local_rank() * layout.dp_shard + mesh["dp_shard"].get_local_rank()
        self.data, self.batch, self.stride, self.offset = data, args.batch, layout.batch_ranks, data_rank
        self.index = 0

    def step(self, saved: SavedActivations | None = None) -> None:
        start = (self.index * self.stride + self.offset) * self.batch
        ids = self.data[start:start + self.batch].to(self.device)
        self.index += 1
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            if saved is not None:
                with saved.context():
                    loss = self.model(input_ids=ids, labels=ids).loss
            else:
                loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


# ---- one layout on one rank ----------------------------------------------------------------------------------
def _timed(run, device: torch.device) -> tuple[float, float]:
    """(wall-clock seconds, this process's CPU seconds) of one step. CPU time counts only the work this rank does,
    so load from other processes on a shared machine disturbs it far less than the wall clock."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start, cpu = time.perf_counter(), time.process_time()
    run.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - cpu


def _counted(run, device: torch.device) -> dict[str, Any]:
    """One more step, counted: collectives, saved activations, model states (grads read before zero_grad)."""
    saved = SavedActivations()
    grads: dict[str, int] = {}
    zero_grad = run.optimizer.zero_grad

    def keep_states(*a, **k):
        grads.update(model_state_bytes(run.model, run.optimizer))
        return zero_grad(*a, **k)

    run.optimizer.zero_grad = keep_states
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    reset_peak_rss()
    with CollectiveCounter() as counter:
        run.step(saved)
    run.optimizer.zero_grad = zero_grad
    out = {"bytes": dict(counter.bytes), "calls": dict(counter.calls), "states": grads,
           "saved_bytes": saved.bytes, "peak_rss": peak_rss_bytes()}
    if device.type == "cuda":
        out["peak_allocated"] = torch.cuda.max_memory_allocated()
    return out


def measure(layout: Layout, args: Any) -> dict[str, Any]:
    """Runs on every rank: interleaved timing of the library and plain PyTorch, then one counted step of each."""
    import torch.distributed as dist

    data = dataset(args, layout)
    lib = LibraryRun(layout, args, data)  # initialises the process group
    plain = PlainRun(layout, args, data)
    device = lib.accelerator.device
    times: dict[str, list[list[float]]] = {"library": [], "plain": []}
    cpu: dict[str, list[list[float]]] = {"library": [], "plain": []}
    for run in (lib, plain):
        for _ in range(args.warmup):
            run.step()
    for repeat in range(args.repeats):
        order = (("library", lib), ("plain", plain)) if repeat % 2 == 0 else (("plain", plain), ("library", lib))
        for name, run in order:
            dist.barrier()
            block = [_timed(run, device) for _ in range(args.steps)]
            times[name].append([wall for wall, _ in block])
            cpu[name].append([c for _, c in block])
    counted = {"library": _counted(lib, device), "plain": _counted(plain, device)}
    lib.accelerator.wait_for_everyone()
    return {"times": times, "cpu": cpu, "counted": counted, "device": str(device),
            "tokens_per_step": args.batch * args.seq * layout.batch_ranks}


# ---- Hugging Face Accelerate ---------------------------------------------------------------------------------
def accelerate_row(layout: Layout, args: Any) -> dict[str, Any]:
    """Accelerate on the same layout: median step time, or the error it raised (type and first line)."""
    try:
        import accelerate
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig
    except ImportError as exc:
        return {"status": "not installed", "error": str(exc)}
    try:
        device, precision = device_and_dtype(args)
        pc = ParallelismConfig(dp_replicate_size=layout.dp_replicate, dp_shard_size=layout.dp_shard,
                               tp_size=layout.tp)
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2) if layout.dp_shard > 1 else None
        acc = Accelerator(parallelism_config=pc, fsdp_plugin=plugin, cpu=device.type == "cpu",
                          mixed_precision=precision)
        model = build_model(args)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = acc.prepare(model, optimizer)
        data = dataset(args, layout)
        times = []
        for i in range(args.warmup + args.steps):
            ids = data[i * args.batch:(i + 1) * args.batch].to(acc.device)
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
        return {"status": "ran", "version": accelerate.__version__,
                "median_step_s": statistics.median(times[args.warmup:])}
    except Exception as exc:  # noqa: BLE001 - the row reports whatever Accelerate raised
        first = (str(exc).strip().splitlines() or [""])[0]
        return {"status": "error", "version": accelerate.__version__, "error": f"{type(exc).__name__}: {first}"[:300]}
