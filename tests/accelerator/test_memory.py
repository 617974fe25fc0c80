"""find_executable_batch_size (Accelerate's semantics; ranks agree on every retry) and layerwise casting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness import run_ranks
from ndparallel import find_executable_batch_size
from ndparallel.training.batch_size import should_reduce_batch_size
from ndparallel.big_modeling import attach_layerwise_casting_hooks

SIZES_FROM_128 = [128, 115, 103, 92, 82, 73, 65, 58, 52, 46]  # int(0.9 * previous), by hand


def _real_cpu_oom() -> RuntimeError:
    try:
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as exc:
        return exc
    raise AssertionError("allocating 4 EiB did not fail")


@pytest.mark.parametrize("exception,expected", [
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if..."), True),
    (RuntimeError("shape mismatch"), False),
    (ValueError("CUDA out of memory."), False),  # not a RuntimeError: not an allocator's
], ids=["cuda", "OutOfMemoryError", "cudnn", "other-runtime-error", "value-error"])
def test_which_errors_reduce_the_batch_size(exception, expected):
    assert should_reduce_batch_size(exception) is expected


def test_a_real_cpu_allocator_failure_is_recognised():
    assert should_reduce_batch_size(_real_cpu_oom())


@pytest.mark.slow
def test_retries_at_nine_tenths_until_it_fits_and_keeps_the_size():
    tried = []

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size, scale):
        tried.append(batch_size)
        if batch_size > 50:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return batch_size * scale

    assert train(2) == 92 and tried == SIZES_FROM_128
    assert train(3) == 138 and tried[-1] == 46  # the next call starts where the last one fitted
    with pytest.raises(TypeError, match=r"Batch size was passed into `train` as the first argument"):
        train(64, 2)


def test_other_errors_pass_through_and_zero_is_an_error():
    @find_executable_batch_size(starting_batch_size=4)
    def broken(batch_size):
        raise KeyError("not memory")

    with pytest.raises(KeyError):
        broken()

    @find_executable_batch_size(starting_batch_size=3)
    def never_fits(batch_size):
        raise _real_cpu_oom()

    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero"):
        never_fits()
    with pytest.raises(ValueError, match="starting_batch_size must be a positive int"):
        find_executable_batch_size(lambda batch_size: None, starting_batch_size=0)


def _one_rank_runs_out() -> dict:
    """Rank 1 alone runs out of memory above 50 (its optimizer state is bigger, say), after the try's last
    collective; rank 0 fits every size. Both must try again, with the same sizes, and return together."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, tried = dist.get_rank(), []

    @find_executable_batch_size(starting_batch_size=128)
    def step(batch_size):
        tried.append(batch_size)
        total = torch.tensor([batch_size])
        dist.all_reduce(total)  # every rank is in this collective at every try: they try the same sizes
        if rank == 1 and batch_size > 50:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return int(total)

    result = step()
    dist.destroy_process_group()
    return {"tried": tried, "result": result}


@pytest.mark.slow
def test_one_ranks_out_of_memory_makes_every_rank_retry_with_the_same_size():
    results = run_ranks(_one_rank_runs_out, 2, timeout=120)
    assert [r["tried"] for r in results] == [SIZES_FROM_128, SIZES_FROM_128]
    assert [r["result"] for r in results] == [92, 92]  # both ran the fitting size, together


# ---- layerwise casting --------------------------------------------------------------------------------------------
class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(self.embed(ids).to(torch.bfloat16)).float()))


def test_layerwise_casting_stores_small_and_computes_in_the_compute_dtype():
    torch.manual_seed(0)
    model = _Tiny()
    reference = _Tiny()
    reference.load_state_dict(model.state_dict())
    attach_layerwise_casting_hooks(model, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16,
                                   skip_modules_pattern=["head"])
    assert model.proj.weight.dtype == torch.float8_e4m3fn and model.head.weight.dtype == torch.float32
    assert model.embed.weight.dtype == torch.float32 and model.norm.weight.dtype == torch.float32  # not castable
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        out = model(ids)
        # by hand: proj's weights rounded through fp8, computed in bf16
        reference.proj.to(torch.float8_e4m3fn).to(torch.bfloat16)
        expected = reference.head(reference.norm(reference.proj(reference.embed(ids).to(torch.bfloat16)).float()))
    assert torch.equal(out, expected)
    assert model.proj.weight.dtype == torch.float8_e4m3fn  # back to storage after the forward
    with pytest.raises(ValueError, match="must both be floating-point dtypes"):
        attach_layerwise_casting_hooks(_Tiny(), storage_dtype=torch.int8, compute_dtype=torch.bfloat16)
