"""FP8 training through torchao (``mixed_precision="fp8"``, `AORecipeKwargs`): which layers convert, the loss curve
against bf16's under several layouts (TP through torchao's float8 parallel styles), and what is refused.

Tolerance: over 20 AdamW steps of the tiny Llama the fp8 losses stay within 2e-2 of the bf16 run's (measured here:
about 7e-3 under FSDP2 2); a run whose fp8 layers were wrong (say, weights not updated) leaves that band at once.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8", reason="mixed_precision='fp8' needs torchao (pip install torchao)")

from harness import assert_refused, outcomes, run_ranks  # noqa: E402
from test_parity import run_layout  # noqa: E402

TOLERANCE = 2e-2


def _converted() -> dict:
    from torchao.float8.float8_linear import Float8Linear

    from ndparallel import Accelerator
    from tiny_models import build_model

    acc = Accelerator(mixed_precision="fp8")
    model = build_model("llama")
    names = set(model.state_dict())
    model = acc.prepare(model)
    out = {"float8": sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear)),
           "plain": sorted(n for n, m in model.named_modules() if type(m) is nn.Linear),
           "same_names": set(acc.unwrap_model(model).state_dict()) == names}
    acc.end_training()
    return out


def test_eligible_layers_convert_and_the_first_and_last_stay():
    out = run_ranks(_converted, 1)[0]
    assert out["plain"] == ["lm_head", "model.layers.0.self_attn.q_proj"]  # the first and the last linear layers
    assert len(out["float8"]) == 2 * 7 - 1 and "model.layers.1.mlp.down_proj" in out["float8"]
    assert out["same_names"]


@pytest.mark.slow
@pytest.mark.parametrize("layout,world,flags", [
    ("one process", 1, []), ("fsdp2", 2, ["--dp-shard-size", "2"]),
    ("ddp2", 2, ["--dp-replicate-size", "2", "--no-fsdp-plugin"]), ("cp2", 2, ["--cp-size", "2"]),
    ("tp2", 2, ["--tp-size", "2"]), ("fsdp2_tp2", 4, ["--dp-shard-size", "2", "--tp-size", "2"])])
def test_fp8_follows_the_bf16_loss_curve(layout, world, flags):
    runs = {mp: run_layout("llama", world, flags, 1, "--mixed-precision", mp, "--steps", "20")[0]["losses"]
            for mp in ("bf16", "fp8")}
    gaps = [abs(a - b) for a, b in zip(runs["fp8"], runs["bf16"])]
    assert len(gaps) == 20 and 0 < max(gaps) < TOLERANCE, f"{layout}: fp8 vs bf16 {max(gaps):.2e}"


def _emulated() -> list[float]:
    from torchao.float8 import Float8LinearConfig

    from ndparallel import Accelerator
    from ndparallel.utils import AORecipeKwargs
    from tiny_models import build_model

    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(config=Float8LinearConfig(
        emulate=True))])
    torch.manual_seed(0)
    model = build_model("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    acc.end_training()
    return losses


def test_the_emulated_recipe_trains():
    """torchao's emulated float8 (what a CPU without float8 matmuls would use) through AORecipeKwargs."""
    losses = run_ranks(_emulated, 1)[0]
    assert losses[-1] < losses[0]  # the same batch three times: the loss must fall


def _refusals() -> dict:
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.utils import AORecipeKwargs, TERecipeKwargs
    from tiny_models import build_model

    def tp_sequence_parallel_on_gloo():
        from ndparallel import TorchTensorParallelConfig

        Accelerator(mixed_precision="fp8", parallelism_config=ParallelismConfig(
            tp_size=2, tp_handler=TorchTensorParallelConfig(sequence_parallel=True))).prepare(build_model("llama"))

    def no_eligible_layer():
        Accelerator(mixed_precision="fp8").prepare(nn.Sequential(nn.Linear(10, 12), nn.ReLU(), nn.Linear(12, 3)))

    return outcomes({
        "tp-sequence-parallel-gloo": tp_sequence_parallel_on_gloo, "no-eligible-layer": no_eligible_layer,
        "transformer-engine": lambda: Accelerator(mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs()]),
        "recipe-without-fp8": lambda: Accelerator(mixed_precision="bf16", kwargs_handlers=[AORecipeKwargs()]),
    })


def test_what_fp8_cannot_do_is_refused():
    results = run_ranks(_refusals, 2)
    assert_refused(results, ("ValueError", r"sequence_parallel all-gathers float8 activations, which gloo"),
                   "tp-sequence-parallel-gloo")
    assert_refused(results, ("ValueError", r"no linear layer of Sequential is eligible for float8"),
                   "no-eligible-layer")
    assert_refused(results, ("ValueError", r"TERecipeKwargs \(Transformer Engine\) is not supported.*AORecipeKwargs"),
                   "transformer-engine")
    assert_refused(results, ("ValueError", r"AORecipeKwargs configures FP8 training; it needs mixed_precision='fp8'"),
                   "recipe-without-fp8")


def test_fp8_on_a_gpu_without_compilation_is_warned_about():
    """Eager float8 ran at 0.44x bf16's speed on an H100 (docs/gpu.md): a CUDA run without a compiling
    TorchDynamoPlugin hears so once; CPU runs (tests, the example) and compiled runs do not."""
    import types
    import warnings

    from ndparallel import ParallelismConfig, TorchDynamoPlugin
    from ndparallel.parallel.fp8 import apply_fp8
    from ndparallel.parallel.options import PrepareOptions

    mesh = types.SimpleNamespace(config=ParallelismConfig(dp_replicate_size=1, dp_shard_size=1))

    def warned(device: str, dynamo: TorchDynamoPlugin | None = None) -> list[str]:
        model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))
        options = PrepareOptions(torch.device(device), mixed_precision="fp8", dynamo_plugin=dynamo)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            apply_fp8(model, mesh, options)
        return [str(w.message) for w in caught if "without torch.compile" in str(w.message)]

    assert len(warned("cuda")) == 1 and "use_regional_compilation=True" in warned("cuda")[0]
    assert warned("cpu") == []
    assert warned("cuda", TorchDynamoPlugin(backend="inductor", use_regional_compilation=True)) == []
