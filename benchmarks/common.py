"""What every benchmark shares: memory readers and counters, model builders, the layouts, and the writers of result
files. What tests use too lives in `ndparallel.test_utils` (the forked-rank launcher `run_ranks`, `CollectiveCounter`,
`LiveBytes`); no benchmark imports anything from tests/ (tests/project/test_benchmark_structure.py).

**Memory.** `serve_large_blocks_from_mmap` makes glibc return freed blocks to the system at once, so the resident set
follows what tensors hold; `rss_bytes` / `peak_rss_bytes` read it (Linux: /proc/self/status VmRSS / VmHWM), and
`reset_peak_rss` sets the peak back to the current resident set (/proc/self/clear_refs). `model_state_bytes`
counts parameters, gradients and optimizer state; `SavedActivations` what autograd saves for backward.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ndparallel.distributed.layout import Layout


# ---- memory ------------------------------------------------------------------------------------------------
def local_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors: their local shards)."""
    from torch.distributed.tensor import DTensor

    storages: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]  # not the scalar step counters
    return {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params),
            "optimizer": local_bytes(state)}


class SavedActivations:
    """Bytes autograd saves for backward during a forward (distinct storages), as ``saved_tensors_hooks`` see them.

    Without `model`: activations, plus any weight tensors a layer saves (FSDP2's unsharded parameters are freed after
    forward all the same), so the figure moves with FSDP2's buffers. With `model`: activations only -- storages of
    its parameters (under FSDP2 the unsharded ones, under TP the local shards) are model state and left out."""

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self.model = model
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        def local(x: torch.Tensor) -> torch.Tensor:
            return x.to_local() if isinstance(x, DTensor) else x

        # Not the chunked loss's gradients, computed in its forward (the head's gradient, not an activation).
        if not isinstance(t, torch.nn.Parameter) and not getattr(t, "_ndparallel_loss_gradient", False):
            try:
                s = local(t).untyped_storage()
                key, size = s.data_ptr(), s.nbytes()
            except RuntimeError:  # a tensor without a plain storage (a wrapper subclass): its own bytes
                key, size = id(local(t)), local(t).numel() * local(t).element_size()
            if self.model is None or key not in {local(w).untyped_storage().data_ptr()
                                                 for w in self.model.parameters()}:
                self.storages[key] = size
        return t

    def context(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def serve_large_blocks_from_mmap() -> None:
    """glibc serves blocks of 64 KiB and more straight from mmap and returns them at free (M_MMAP_THRESHOLD), so the
    resident set follows what tensors hold. Call it first thing in each measuring process."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """This process's resident set now (VmRSS)."""
    value = _status_bytes("VmRSS")
    if value is None:
        raise RuntimeError("no /proc/self/status VmRSS (Linux only)")
    return value


def reset_peak_rss() -> None:
    """Set the peak resident set (VmHWM) back to the resident set now."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_bytes() -> int:
    """The most this process has held resident since it started or since `reset_peak_rss` (VmHWM; elsewhere than
    Linux, getrusage's lifetime maximum)."""
    value = _status_bytes("VmHWM")
    if value is not None:
        return value
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_above_now(fn: Callable[[], Any]) -> tuple[int, float]:
    """``(bytes, seconds)`` of one call of `fn`: its peak resident set above the resident set before it (so the
    transients count, and what was already held does not), and how long it took."""
    reset_peak_rss()
    before = rss_bytes()
    start = time.perf_counter()
    fn()
    return peak_rss_bytes() - before, time.perf_counter() - start


# ---- models ------------------------------------------------------------------------------------------------------
HEADS, KV_HEADS = 8, 4  # GQA: tp up to 4 splits both


def llama_config(*, vocab: int, hidden: int, layers: int, intermediate: int, heads: int = HEADS,
                 kv_heads: int = KV_HEADS, max_positions: int = 128, **extra: Any):
    """A Llama config built from sizes (no download): untied embeddings, SDPA attention; `extra`: more fields."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        tie_word_embeddings=False, attn_implementation="sdpa", **extra)


def llama(seed: int | None = 0, **sizes: Any) -> torch.nn.Module:
    """A freshly initialised Llama of `llama_config(**sizes)`, its weights drawn after ``torch.manual_seed(seed)``
    (None: from the generator as it stands)."""
    import transformers

    if seed is not None:
        torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(llama_config(**sizes))


def qwen3_moe_config(*, vocab: int, hidden: int, layers: int, intermediate: int, moe_intermediate: int, experts: int,
                     top_k: int, heads: int = HEADS, kv_heads: int = KV_HEADS, max_positions: int = 128, **extra: Any):
    """A Qwen3-MoE config built from sizes: `experts` routed experts of `top_k` per token, heads of hidden / heads,
    untied embeddings, SDPA attention; `extra`: more fields (``mlp_only_layers``, the router's loss, ...)."""
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, moe_intermediate_size=moe_intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        num_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=max_positions,
        tie_word_embeddings=False, attn_implementation="sdpa", **extra)


def _workload_sizes(args: Any) -> dict[str, int]:
    return dict(vocab=args.vocab, hidden=args.hidden, layers=args.layers, intermediate=args.hidden * 11 // 4,
                max_positions=max(args.seq, 128))


def workload_config(args: Any):
    """The Llama that benchmarks/run.py (and the planner checks) train, sized by their command line."""
    return llama_config(**_workload_sizes(args))


def workload_model(args: Any) -> torch.nn.Module:
    """`workload_config`'s model, seeded: every call gives the same weights."""
    return llama(**_workload_sizes(args))


def shift_labels(ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets, shifted before the sequence is sharded (-100: the last position predicts nothing)."""
    return torch.nn.functional.pad(ids[..., 1:], (0, 1), value=-100)


def device_and_dtype(args: Any) -> tuple[torch.device, str]:
    """This rank's GPU and bf16 where there is one and `--cpu` was not given; else the CPU in fp32."""
    import os

    if torch.cuda.is_available() and not args.cpu:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local), "bf16"
    return torch.device("cpu"), "no"


# ---- layouts: the library's Layout (ndparallel.distributed.layout), by the name the benchmarks print ---------------
LAYOUTS: dict[str, Layout] = {
    "fsdp2": Layout(dp_shard=2),
    "hsdp": Layout(dp_replicate=2, dp_shard=2),
    "tp": Layout(tp=2),
    "fsdp2_tp": Layout(dp_shard=2, tp=2),
    "cp": Layout(cp=2),
    "sp": Layout(sp=2),
    "cp_sp": Layout(cp=2, sp=2),
}


def config_sizes(layout: Layout) -> dict[str, int]:
    """`layout` as ``ParallelismConfig`` arguments: ``<axis>_size`` for each axis (and ep) above 1, nothing else."""
    return {f"{axis}_size": n for axis, n in layout.all_sizes().items() if n != 1}


def layout_record(name: str, layout: Layout) -> dict[str, Any]:
    """What a result file says of a layout: its name, the sizes of its data and model axes, its world size."""
    return {"name": name, "dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard, "cp": layout.cp,
            "sp": layout.sp, "tp": layout.tp, "world": layout.world}


# ---- results -------------------------------------------------------------------------------------------------------
def write_results(out: Path, stem: str, table: str, data: Any, indent: int = 2, show: bool = False) -> Any:
    """Write `out/stem.md` (the Markdown table, as printed) and `out/stem.json` (every figure); with `show`, print
    the table too. Returns `data`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(table)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=indent))
    if show:
        print("\n" + table)
    return data
