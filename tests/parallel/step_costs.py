"""What a GPU pays for in a training step, counted on the CPU: host syncs, dispatched ops, matmul FLOPs, collectives,
and the bytes of tensors alive at a peak (issue 38).

`StepCosts` is a `TorchDispatchMode`: every op a step dispatches reaches it (ops on DTensors are handed to DTensor
first, which dispatches the plain ops of its local shards and the collectives of its redistributions, with the mode
still on; so nothing is counted twice and nothing is missed). Per op it counts:

- **host syncs**: the ops whose result depends on tensor *values* read on the host -- on a GPU each stalls the host
  until the device has drained its queue (`SYNC_OPS`: ``_local_scalar_dense`` behind ``.item()`` / ``int()`` /
  ``float()`` / ``bool()`` of a tensor, ``nonzero`` behind boolean-mask indexing and ``torch.where(mask)``,
  ``masked_select``, ``unique*``, ``repeat_interleave`` without an output size, ``is_nonzero``, ``equal``, ``bincount``
  and ``histc`` without bounds, ...), and ``tolist()`` / ``numpy()``, which read a tensor without dispatching (the
  mode wraps them while it is on). On the CPU every tensor is a "device" tensor, so the rule applies to every tensor alike and to
  plain PyTorch's loop as to the library's. Work on the host batch before it moves to the device (the data loader's,
  outside the counted step) is counted apart.
- **ops**: every other dispatched op (views included), collectives not among them;
- **collectives**: ``c10d.*`` and ``_c10d_functional.*`` ops by name (and point-to-point ``send`` / ``recv``), counted
  apart, with the size of their group;
- **matmul FLOPs**: ``mm``, ``addmm``, ``bmm``, ``baddbmm`` (2 x m x n x k each; torch's ``flop_counter`` formulas):
  the GEMMs of the linear layers. Attention kernels are counted as ops (their FLOPs depend on the kernel's masking,
  not on what the library adds).

`LiveBytes` (the bytes of tensors alive at a peak) lives in ndparallel.test_utils.memory: benchmarks use it too.
"""

from __future__ import annotations

import sys
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ndparallel.test_utils.collectives import group_size


aten = torch.ops.aten

# Ops that read tensor values on the host (see the module docstring). `repeat_interleave` only without an output size.
SYNC_OPS = frozenset({
    "_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "argwhere", "masked_select", "unique",
    "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive", "repeat_interleave",
    "bincount", "histc", "histogram", "_assert_scalar", "allclose", "_nested_tensor_from_mask",
})
MATMULS = {"mm": lambda a, b: a[0] * a[1] * b[1], "addmm": lambda a, b: a[0] * a[1] * b[1],
           "bmm": lambda a, b: a[0] * a[1] * a[2] * b[2], "baddbmm": lambda a, b: a[0] * a[1] * a[2] * b[2]}
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


def _is_sync(func: Any, op: str, args: tuple, kwargs: dict) -> bool:
    if op not in SYNC_OPS:
        return False
    if op == "repeat_interleave":  # with a tensor of repeats it reads their sum, unless told the output size
        return func._overloadname != "self_int" and kwargs.get("output_size") is None
    if op == "histc":  # reads the data's range only when not given one
        return len(args) < 4 or args[2] == args[3]
    return True


def _caller(skip: tuple[str, ...] = ("/torch/", "/contextlib.py", "step_costs.py", "/functools.py")) -> str:
    """``file:line`` of the innermost frame outside torch and this module: who made the op."""
    for frame in reversed(traceback.extract_stack()):
        if not any(part in frame.filename for part in skip):
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"


class StepCosts(TorchDispatchMode):
    """``with StepCosts() as c:`` then ``c.syncs``, ``c.ops``, ``c.flops``, ``c.collectives`` (a Counter of
    ``"name/group size"``), ``c.by_op`` (a Counter of op names), ``c.sync_sites`` (who synced, by ``op file:line``);
    with ``sites=True`` also ``c.op_sites`` (who dispatched; slow: a stack walk per op)."""

    def __init__(self, sites: bool = False) -> None:
        super().__init__()
        self.syncs = self.ops = self.flops = 0
        self.collectives: Counter[str] = Counter()
        self.by_op: Counter[str] = Counter()
        self.sync_sites: Counter[str] = Counter()
        self.op_sites: Counter[str] = Counter()
        self.sites = sites

    def __enter__(self) -> StepCosts:
        # tolist() and numpy() read a tensor on the host without dispatching an op: counted here as syncs.
        self._saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
        for name, original in self._saved.items():
            def counted(tensor, *args, _name=name, _original=original, **kwargs):
                self.syncs += 1
                self.sync_sites[f"{_name} {_caller()}"] += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor dispatches its local ops and collectives with this mode still on
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ns, op = func.namespace, func._schema.name.split("::")[-1]
        if ns in COLLECTIVE_NAMESPACES or op in ("send", "recv", "recv_any_source"):
            if op not in ("wait_tensor", "wait", "_wrap_tensor_autograd"):  # parts of a functional collective
                self.collectives[f"{op}/{group_size(args, kwargs)}"] += 1
            return out
        if _is_sync(func, op, args, kwargs):
            self.syncs += 1
            self.sync_sites[f"{op} {_caller()}"] += 1  # always: syncs are few
            return out
        self.ops += 1
        self.by_op[op] += 1
        if self.sites:
            self.op_sites[_caller()] += 1
        if op in MATMULS:
            a, b = (args[0], args[1]) if op in ("mm", "bmm") else (args[1], args[2])
            self.flops += 2 * MATMULS[op](a.shape, b.shape)
        return out

    def summary(self) -> dict[str, Any]:
        return {"syncs": self.syncs, "ops": self.ops, "flops": self.flops, "collectives": dict(self.collectives),
                "sync_sites": dict(self.sync_sites)}


# ---- the default step of a layout, and plain PyTorch's on the same micro-batch ------------------------------------
# name -> (world size, ParallelismConfig sizes, FSDP plugin?, tiny model). The smallest world that has the layout.
LAYOUTS: dict[str, tuple[int, dict[str, int], bool, str]] = {
    "one": (1, {}, False, "llama"),
    "ddp": (2, {"dp_replicate_size": 2}, False, "llama"),
    "fsdp2": (2, {"dp_shard_size": 2}, True, "llama"),
    "hsdp": (4, {"dp_replicate_size": 2, "dp_shard_size": 2}, True, "llama"),
    "tp": (2, {"tp_size": 2}, False, "llama"),
    "cp": (2, {"cp_size": 2}, True, "llama"),
    "sp": (2, {"sp_size": 2}, True, "llama"),
    "pp": (2, {"pp_size": 2}, False, "llama"),
    "ep": (2, {"dp_shard_size": 2, "ep_size": 2}, True, "qwen3_moe"),
}
SEQ, MICRO = 32, 2


def _samples(n: int, seq: int):
    from tiny_models import VOCAB, TokenDataset

    return TokenDataset(n, seq, VOCAB)


def library_loop(layout: str, accum: int = 1, log: bool = False) -> Any:
    """The README's loop under `layout` (forked ranks), bf16 autocast, AdamW, clipping: a function that runs one
    optimizer step with its compute counted by a given `StepCosts` (each micro-batch is drawn outside it: the host's
    data work, where the loss tokens are counted on the batch before it moves to the device). `log`: each
    micro-step's loss logged as the README logs it (``accelerator.reduce_loss(loss).item()``)."""
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
    from tiny_models import build_model

    world, sizes, fsdp, model_name = LAYOUTS[layout]
    accelerator = Accelerator(parallelism_config=ParallelismConfig(**sizes) if sizes else None,
                              fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2) if fsdp else None,
                              mixed_precision="bf16", gradient_accumulation_steps=accum, cpu=True)
    torch.manual_seed(0)
    model = build_model(model_name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(_samples(MICRO * accelerator.data_parallel_size * accum * 8, SEQ), batch_size=MICRO)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = iter(loader)
    sharded = accelerator.cp_size * accelerator.sp_size > 1

    def step(costs: StepCosts, fetch: StepCosts) -> None:
        for _ in range(accum):
            with fetch:
                batch = next(batches)
            if sharded:  # the README's loop: labels shifted before sharding (positions: the model's input check)
                batch["shift_labels"] = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
            buffers = list(batch.values())
            with costs, accelerator.accumulate(model), accelerator.maybe_context_parallel(
                    buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
                if log:
                    accelerator.reduce_loss(loss).item()

    return step


def plain_loop(layout: str, accum: int = 1, log: bool = False) -> Any:
    """Plain PyTorch's loop in this one process on a micro-batch of the same shape: the model, bf16 autocast, the loss
    divided over the accumulation steps, ``clip_grad_norm_`` and AdamW's step on the window's last micro-step;
    `log`: each micro-step's ``loss.item()``."""
    from torch.utils.data import DataLoader

    from tiny_models import build_model

    torch.manual_seed(0)
    model = build_model(LAYOUTS[layout][3])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = iter(DataLoader(_samples(MICRO * accum * 8, SEQ), batch_size=MICRO))

    def step(costs: StepCosts, fetch: StepCosts) -> None:
        for i in range(accum):
            with fetch:
                batch = next(batches)
            with costs:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(**batch).loss
                (loss / accum if accum > 1 else loss).backward()
                if i == accum - 1:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    optimizer.zero_grad()
                if log:
                    loss.item()

    return step


def count_step(layout: str, accum: int = 1, log: bool = False, sites: bool = False) -> dict[str, dict[str, Any]]:
    """On each rank: the costs of one optimizer step of the library's loop and of plain PyTorch's (after two
    warm-up steps each: optimizer state, caches)."""
    out = {}
    for name, make in (("library", library_loop), ("plain", plain_loop)):
        step = make(layout, accum, log)
        for _ in range(2):
            step(StepCosts(), StepCosts())
        costs, fetch = StepCosts(sites=sites), StepCosts(sites=sites)
        step(costs, fetch)
        out[name] = {**costs.summary(), "by_op": dict(costs.by_op), "op_sites": dict(costs.op_sites),
                     "fetch": fetch.summary()}
    return out


def count_trainer_step(accum: int = 1, steps: int = 3, plain: bool = False) -> dict[str, Any]:
    """On this rank: the costs of the last of `steps` optimizer steps of a Hugging Face Trainer (bf16, AdamW,
    clipping), counted from ``on_step_begin`` to ``on_step_end`` (its batches are drawn before: the host's data
    work; its logging after). Under ndparallel as this rank's NDPARALLEL_* sizes say; `plain`: the stock Trainer in
    one process (the launcher's variables removed, so Accelerate wraps nothing)."""
    import os

    if plain:
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(name, None)
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ndparallel.launch.worker import attach_integrations
    from tiny_models import build_model

    attach_integrations()  # what ndparallel's launcher does in each rank before the script
    costs = StepCosts()

    class Count(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == steps - 1:
                costs.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == steps:
                costs.__exit__(None, None, None)

    import tempfile

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=MICRO,
                                 gradient_accumulation_steps=accum, learning_rate=1e-3, max_grad_norm=1.0,
                                 logging_steps=1, report_to=[], use_cpu=True, bf16=True, seed=0, disable_tqdm=True,
                                 save_strategy="no", dataloader_drop_last=True)
        torch.manual_seed(0)
        trainer = Trainer(model=build_model("llama"), args=args, train_dataset=_samples(MICRO * 4 * accum * steps, SEQ),
                          callbacks=[Count()])
        trainer.train()
        ours = type(trainer.accelerator).__module__.startswith("ndparallel")
    return {**costs.summary(), "by_op": dict(costs.by_op), "ndparallel": ours}


def main(argv: list[str]) -> None:
    """``python tests/parallel/step_costs.py [layout ...]``: the figures the tests check, per rank, library / plain
    (every layout and FSDP2 with 2 micro-steps by default)."""
    sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "scripts")]
    import ndparallel.launch.worker  # noqa: F401  (imported once, before the ranks fork)
    from harness import run_ranks

    cases = [(layout, 1) for layout in argv] if argv else [*((layout, 1) for layout in LAYOUTS), ("fsdp2", 2)]
    for layout, accum in cases:
        ranks = run_ranks(count_step, LAYOUTS[layout][0], layout, accum, timeout=900)
        lib, plain = [r["library"] for r in ranks], ranks[0]["plain"]
        print(f"{layout}, {accum} micro-step(s): syncs {[m['syncs'] for m in lib]} / {plain['syncs']}; ops "
              f"{[m['ops'] for m in lib]} / {plain['ops']}; matmul MFLOP {[m['flops'] / 1e6 for m in lib]} / "
              f"{plain['flops'] / 1e6}; collectives {lib[0]['collectives']}; data loader's syncs "
              f"{lib[0]['fetch']['syncs']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
