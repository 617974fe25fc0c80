"""The same training step three ways, run on forked ranks: ndparallel, plain PyTorch written out, and Accelerate.

`measure(spec, args)` runs on every rank. It builds the library's model and the plain one (same seed, same data,
same layout) and alternates blocks of steps between them, so machine noise hits both alike; then it counts one
extra step of each with `CollectiveCounter` and measures model states, and compares the two runs' last losses
and parameters (they trained the same steps from the same weights, so they must agree to rounding).
`accelerate_row` tries Hugging Face Accelerate on the same layout and returns its figures or its error.

The plain version uses no ndparallel: `init_device_mesh`, `parallelize_module` with the same styles as the
library's Llama plan, context/sequence-parallel attention written out in `plain_sequence.py`, `fully_shard` per
decoder layer then the root (a 2-D mesh for HSDP, a flattened one over cp/sp), and the loop written out (forward,
loss, backward, optimizer step, zero_grad).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

import torch

from common import (SavedActivations, device_and_dtype, model_state_bytes, peak_rss_bytes, reset_peak_rss, shift_labels,
                    workload_model)
from plain_sequence import SequenceGroups, install, positions

from ndparallel.distributed.layout import Layout
from ndparallel.test_utils.collectives import CollectiveCounter


def dataset(args: Any, layout: Layout) -> torch.Tensor:
    """Token ids, one row per sample: enough for every step of every block, over every data-parallel rank."""
    g = torch.Generator().manual_seed(1)
    rows = args.batch * layout.batch * (args.warmup + args.steps * args.repeats + 2)
    return torch.randint(0, args.vocab, (rows, args.seq), generator=g)


# ---- the library ---------------------------------------------------------------------------------------------
class LibraryRun:
    def __init__(self, layout: Layout, args: Any, data: torch.Tensor) -> None:
        from torch.utils.data import DataLoader

        from ndparallel import (
            Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig, TorchContextParallelConfig)

        device, precision = device_and_dtype(args)
        pc = ParallelismConfig(dp_replicate_size=layout.dp_replicate, dp_shard_size=layout.dp_shard,
                               cp_size=layout.cp, sp_size=layout.sp, tp_size=layout.tp,
                               cp_handler=TorchContextParallelConfig(cp_comm_strategy="allgather"))
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2) if layout.fsdp > 1 else None
        self.accelerator = Accelerator(parallelism_config=pc, fsdp_plugin=plugin, mixed_precision=precision,
                                       cpu=device.type == "cpu")
        model = workload_model(args)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if layout.seq_split > 1:  # as a CP/SP script does: labels shifted and positions given before sharding
            samples = [{"input_ids": row, "labels": row, "shift_labels": shift_labels(row),
                        "position_ids": torch.arange(len(row))} for row in data]
        else:
            samples = [{"input_ids": row, "labels": row} for row in data]
        loader = DataLoader(samples, batch_size=args.batch)
        self.model, self.optimizer, self.loader = self.accelerator.prepare(model, optimizer, loader)
        self.batches = iter(self.loader)

    def step(self, saved: SavedActivations | None = None) -> torch.Tensor:
        """One optimizer step; returns the mean loss over this rank's tokens (detached)."""
        batch = next(self.batches)
        buffers = list(batch.values())  # each rank keeps its part of the sequence (nothing happens without CP/SP)
        with self.accelerator.accumulate(self.model), self.accelerator.maybe_context_parallel(
                buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)):
            with saved.context() if saved is not None else contextlib.nullcontext():
                loss = self.model(**batch).loss
            self.accelerator.backward(loss)
            self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.detach()


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
        dims = ("dp_replicate", "dp_shard", "cp", "sp", "tp")
        mesh = init_device_mesh(device.type, tuple(getattr(layout, d) for d in dims), mesh_dim_names=dims)
        model = workload_model(args).to(device)
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
        self.positions = None
        if layout.seq_split > 1:  # the hand-written CP/SP attention (benchmarks/plain_sequence.py)
            groups = SequenceGroups(mesh["cp"].get_group(), layout.cp, mesh["cp"].get_local_rank(),
                                    mesh["sp"].get_group(), layout.sp, args.seq)
            install(model, groups)
            self.positions = positions(args.seq, layout.cp, groups.cp_rank, layout.sp, mesh["sp"].get_local_rank())
        bf16 = precision == "bf16"
        self.autocast = bf16
        # Parameters are sharded over dp_shard x cp x sp (cp and sp ranks hold different tokens of the same
        # samples, so their gradients add up like those of data-parallel ranks) and replicated over dp_replicate.
        shard_dims = tuple(d for d in ("dp_shard", "cp", "sp") if getattr(layout, d) > 1)
        if layout.batch * layout.cp * layout.sp > 1:
            if len(shard_dims) > 1:
                if layout.dp_replicate > 1:
                    raise NotImplementedError("plain HSDP over a flattened shard dimension is not written out")
                dp_mesh = mesh[shard_dims]._flatten("fsdp")
            elif layout.dp_replicate > 1 and shard_dims:
                dp_mesh = mesh["dp_replicate", shard_dims[0]]  # HSDP: replicate outer, shard inner
            else:
                dp_mesh = mesh[shard_dims[0] if shard_dims else "dp_replicate"]
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
                else MixedPrecisionPolicy()
            reshard = bool(shard_dims)
            for layer in model.model.layers:
                fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
            # The root: torch's default (None: kept gathered from forward to backward, which starts with it).
            fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=None if reshard else False)
            self.autocast = False
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        # This rank's rows: its coordinate along dp_replicate x dp_shard picks every batch_ranks-th batch.
        data_rank = mesh["dp_replicate"].get_local_rank() * layout.dp_shard + mesh["dp_shard"].get_local_rank()
        self.data, self.batch, self.stride, self.offset = data, args.batch, layout.batch, data_rank
        # FSDP averages gradients over every rank that holds a share of the batch; the loss is scaled back up.
        self.grad_ranks = layout.batch * layout.cp * layout.sp
        self.index = 0

    def step(self, saved: SavedActivations | None = None) -> torch.Tensor:
        """One optimizer step; returns the mean loss over this rank's tokens (detached)."""
        first = self.index * self.stride * self.batch
        step_rows = self.data[first:first + self.stride * self.batch]  # every data-parallel rank's rows
        rows = step_rows[self.offset * self.batch:(self.offset + 1) * self.batch]  # this rank's
        self.index += 1
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast), \
                saved.context() if saved is not None else contextlib.nullcontext():
            if self.positions is None:
                ids = rows.to(self.device)
                loss = local_mean = self.model(input_ids=ids, labels=ids).loss
            else:
                loss, local_mean = self._sequence_loss(rows, step_rows)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return local_mean.detach()

    def _sequence_loss(self, rows: torch.Tensor, step_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the global step's mean loss: its tokens' summed cross-entropy over the tokens of
        the whole step (every data-parallel rank's rows), times the ranks FSDP averages the gradients over. And,
        to compare with the library, the mean over this rank's tokens."""
        tokens = int((shift_labels(step_rows) != -100).sum())
        pos = self.positions
        ids, targets = rows[:, pos].to(self.device), shift_labels(rows)[:, pos].to(self.device)
        logits = self.model(input_ids=ids, position_ids=pos.to(self.device).expand(len(rows), -1)).logits
        loss_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                                     ignore_index=-100, reduction="sum")
        return loss_sum * (self.grad_ranks / tokens), loss_sum / (targets != -100).sum()


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
        loss = run.step(saved)
    run.optimizer.zero_grad = zero_grad
    out = {"bytes": dict(counter.bytes), "calls": dict(counter.calls), "states": grads,
           "saved_bytes": saved.bytes, "peak_rss": peak_rss_bytes(),
           "loss": float(loss)}
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
    peak = None
    if dist.get_rank() == 0:  # while the other ranks wait in the barrier below
        from ndparallel.training.metrics import peak_flops

        peak = peak_flops(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    lib.accelerator.wait_for_everyone()
    return {"times": times, "cpu": cpu, "counted": counted, "device": str(device), "peak_flops": peak,
            "param_gap": param_gap(lib.model, plain.model),
            "loss_gap": abs(counted["library"]["loss"] - counted["plain"]["loss"]),
            "tokens_per_step": args.batch * args.seq * layout.batch}


def param_gap(a: torch.nn.Module, b: torch.nn.Module) -> float | None:
    """Largest |difference| between this rank's local parameters of two models trained alike: the two runs did
    the same steps on the same data, so this shows the hand-written version computes what the library does.
    None if they are not sharded alike (then local tensors cannot be compared)."""
    from torch.distributed.tensor import DTensor

    def local(p: torch.Tensor) -> torch.Tensor:
        return (p.to_local() if isinstance(p, DTensor) else p).detach()

    theirs = {name: local(p) for name, p in a.named_parameters()}
    gap = 0.0
    for name, p in b.named_parameters():
        mine = local(p)
        if name not in theirs or theirs[name].shape != mine.shape:
            return None
        gap = max(gap, float((theirs[name].float() - mine.float()).abs().max()))
    return gap


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
        sizes = {"cp_size": layout.cp} if layout.cp > 1 else {}
        if layout.sp > 1:
            sizes["sp_size"] = layout.sp  # Accelerate's sequence parallelism is DeepSpeed's (Ulysses)
        pc = ParallelismConfig(dp_replicate_size=layout.dp_replicate, dp_shard_size=layout.dp_shard,
                               tp_size=layout.tp, **sizes)
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2) if layout.fsdp > 1 else None
        acc = Accelerator(parallelism_config=pc, fsdp_plugin=plugin, cpu=device.type == "cpu",
                          mixed_precision=precision)
        model = workload_model(args)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = acc.prepare(model, optimizer)
        data = dataset(args, layout)
        times = []
        for i in range(args.warmup + args.steps):
            ids = data[i * args.batch:(i + 1) * args.batch].to(acc.device)
            start = time.perf_counter()
            if layout.cp > 1:  # Accelerate's context parallelism shards the buffers in place for the block
                batch = {"input_ids": ids.clone(), "labels": ids.clone(), "shift_labels": shift_labels(ids),
                         "position_ids": torch.arange(ids.shape[1], device=ids.device).expand_as(ids).clone()}
                buffers = list(batch.values())
                with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                                no_restore_buffers=set(buffers)):
                    acc.backward(model(**batch).loss)
            else:
                acc.backward(model(input_ids=ids, labels=ids).loss)
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
        return {"status": "ran", "version": accelerate.__version__,
                "median_step_s": statistics.median(times[args.warmup:])}
    except Exception as exc:  # noqa: BLE001 - the row reports whatever Accelerate raised
        first = (str(exc).strip().splitlines() or [""])[0]
        return {"status": "error", "version": accelerate.__version__, "error": f"{type(exc).__name__}: {first}"[:300]}
