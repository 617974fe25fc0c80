"""Step time, tokens/s and model FLOPs utilisation (MFU) that a training loop can log.

    timer = StepTimer(flops_per_token=flops_per_token(model.config, seq_len=512), peak_flops=989e12,
                      num_devices=accelerator.num_processes, device=accelerator.device)
    bar = accelerator.progress_bar(loader)     # drawn by the main process only
    for batch in bar:
        with timer.step(tokens=global_tokens_this_step):
            ...  # forward, backward, optimizer step
        bar.set_postfix(timer.postfix())       # or log timer.last: {"step_time_s", "tokens_per_s", "mfu"}
    timer.summary(skip=2)                      # medians after 2 warm-up steps

FLOPs per token: `ndparallel.training.flops` (6 x N_matmul + 6 x L x attention width x S, the whole S x S score matrix).

MFU = tokens/s * FLOPs per token / (peak FLOP/s of one device * number of devices). Peak figures come from the
caller, else from `PEAK_FLOPS` for known GPUs (dense, no sparsity), else -- on a CPU -- from a short measured
matmul, which is an *estimate* of the peak rather than a datasheet value; `peak_flops` says which.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from ..configuration.dtypes import compute_dtype
from ..models.families import config_names, expert_counts
from .flops import training_flops

# Dense peak FLOP/s of one device, by (name fragment, dtype); bf16/fp16 tensor cores, tf32 for fp32.
PEAK_FLOPS: dict[tuple[str, torch.dtype], float] = {
    ("H200", torch.bfloat16): 989e12, ("H100", torch.bfloat16): 989e12, ("A100", torch.bfloat16): 312e12,
    ("H200", torch.float32): 494e12, ("H100", torch.float32): 494e12, ("A100", torch.float32): 156e12,
    ("L40S", torch.bfloat16): 362e12, ("A10G", torch.bfloat16): 70e12,
}


def _attr(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    if default is None:
        raise ValueError(f"model config has none of {names}; pass flops_per_token yourself")
    return default


def matmul_params(config: Any) -> int:
    """Weights in matrix multiplies per token, from a Hugging Face decoder config (see the module docstring)."""
    hidden = _attr(config, *config_names("hidden"))
    layers = _attr(config, *config_names("layers"))
    heads = _attr(config, *config_names("heads"))
    kv_heads = _attr(config, "num_key_value_heads", default=heads)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = _attr(config, "intermediate_size", default=4 * hidden)
    vocab = _attr(config, "vocab_size")
    gated = getattr(config, "hidden_act", None) == "silu"  # Llama-style gate, up and down projections
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    mlp = (3 if gated else 2) * hidden * inter
    return layers * (attn + mlp) + hidden * vocab


def flops_per_token(config: Any, seq_len: int) -> float:
    """Training FLOPs per token of the model a Hugging Face decoder config describes, at `seq_len`
    (`ndparallel.training.flops.training_flops`).

    A mixture of experts (a config setting one of the family table's expert counts above 1,
    `ndparallel.models.families.expert_counts`) or a model with multi-head latent attention (``kv_lora_rank``) is
    counted by the planner's model of it (`ndparallel.planner.model.ModelSpec.flops_per_token`): only the top-k
    experts a token goes to, its shared experts and dense layers, its own attention widths -- the dense count would
    take the wrong MLP."""
    moe = any(count > 1 for count in expert_counts(config).values())
    if moe or getattr(config, "kv_lora_rank", None):
        from ..planner.model import spec_from_config

        data = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
        return spec_from_config(data, type(config).__name__).flops_per_token(seq_len)
    hidden = _attr(config, *config_names("hidden"))
    layers = _attr(config, *config_names("layers"))
    heads = _attr(config, *config_names("heads"))
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return training_flops(matmul_params(config), layers, 2 * heads * head_dim, seq_len)


def peak_flops(device: torch.device | str, dtype: torch.dtype = torch.float32) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from). CPU: measured, an estimate."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for (fragment, table_dtype), value in PEAK_FLOPS.items():
            if fragment in name and table_dtype == dtype:
                return value, f"table: {fragment} {dtype}"
        raise ValueError(f"no peak FLOP/s known for {name!r} in {dtype}; pass peak_flops yourself")
    n = 512
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    start, reps = time.perf_counter(), 8
    for _ in range(reps):
        a @ b
    rate = 2 * n**3 * reps / (time.perf_counter() - start)
    return rate, (f"estimate: measured {dtype} {n}x{n} matmul rate with {torch.get_num_threads()} "
                             "thread(s) on this CPU, not a datasheet peak")


class StepTimer:
    """Times training steps; reports step time, tokens/s and (given FLOPs per token and a peak) MFU.

    Args:
        flops_per_token: training FLOPs per token (`flops_per_token`); None: no MFU.
        peak_flops: peak FLOP/s of one device; None: no MFU.
        num_devices: devices the job runs on (MFU divides by all of them).
        device: CUDA devices are synchronised before each clock reading, so the time covers queued kernels.
    """

    def __init__(self, flops_per_token: float | None = None, peak_flops: float | None = None,
                 num_devices: int = 1, device: torch.device | str | None = None) -> None:
        if num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {num_devices}")
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.num_devices = num_devices
        self.device = torch.device(device) if device is not None else None
        self.times: list[float] = []
        self.tokens: list[int] = []

    def _sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def step(self, tokens: int) -> Iterator[None]:
        """Time the block as one step that processed `tokens` tokens (over the whole job)."""
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.record(time.perf_counter() - start, tokens)

    def record(self, seconds: float, tokens: int) -> None:
        if seconds <= 0:
            raise ValueError(f"a step must take a positive time, got {seconds}")
        self.times.append(seconds)
        self.tokens.append(tokens)

    def _metrics(self, seconds: float, tokens: float) -> dict[str, float | None]:
        rate = tokens / seconds
        mfu = None
        if self.flops_per_token is not None and self.peak_flops:
            mfu = rate * self.flops_per_token / (self.peak_flops * self.num_devices)
        return {"step_time_s": seconds, "tokens_per_s": rate, "mfu": mfu}

    @property
    def last(self) -> dict[str, float | None]:
        """Metrics of the latest step."""
        if not self.times:
            raise ValueError("no step timed yet")
        return self._metrics(self.times[-1], self.tokens[-1])

    def postfix(self) -> dict[str, str]:
        """The latest step's metrics, formatted for a progress bar: ``bar.set_postfix(timer.postfix())``."""
        last = self.last
        out = {"s/step": f"{last['step_time_s']:.3f}", "tok/s": f"{last['tokens_per_s']:.0f}"}
        if last["mfu"] is not None:
            out["mfu"] = f"{last['mfu']:.1%}"
        return out

    def summary(self, skip: int = 0) -> dict[str, float | None]:
        """Median step time over the steps after the first `skip` (warm-up), and the tokens/s and MFU at it."""
        times, tokens = self.times[skip:], self.tokens[skip:]
        if not times:
            raise ValueError(f"no steps after skipping {skip} of {len(self.times)}")
        out = self._metrics(statistics.median(times), statistics.median(tokens))
        out["steps"] = len(times)
        return out


def timer_for(accelerator: Any, model: Any = None, seq_len: int | None = None,
              peak: float | None = None) -> StepTimer:
    """A `StepTimer` for `accelerator`'s job (what ``Accelerator.step_timer`` returns): MFU over all its processes,
    FLOPs per token from ``model.config`` at `seq_len` when both are given, the peak from `peak` or `peak_flops`."""
    fpt = None
    config = getattr(accelerator.unwrap_model(model), "config", None) if model is not None else None
    if config is not None and seq_len is not None:
        fpt = flops_per_token(config, seq_len)
    if peak is None and fpt is not None:
        dtype = compute_dtype(accelerator.mixed_precision) or torch.float32
        peak = peak_flops(accelerator.device, dtype)[0]
    return StepTimer(fpt, peak, num_devices=accelerator.num_processes, device=accelerator.device)
