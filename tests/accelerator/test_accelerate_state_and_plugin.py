"""Issue 40: the state and plugin behaviours Accelerate's test_accelerator.py and FSDP plugin tests expect.

- ``AcceleratorState._reset_state()`` forgets the state of every Accelerator made so far: using one raises
  Accelerate's AttributeError naming the reset (``prepare`` before any collective), ``wait_for_everyone`` still
  works (it needs only the process state, as Accelerate's), and the next Accelerator works.
- ``$ACCELERATE_TORCH_DEVICE`` / ``$NDPARALLEL_TORCH_DEVICE`` chooses this process's device, of the backend's type.
- A bitsandbytes-quantized model loaded offloaded, or on another device, is refused at ``prepare``.
- The FSDP plugin: the policy derived from ``mixed_precision`` is on ``state.fsdp_plugin`` (compute in bf16, reduce
  in fp32) while the script's plugin object stays as it was; ``state.fsdp_plugin`` is assignable under FSDP2 and
  refused without it; the dropped ``backward_prefetch`` is also logged where Accelerate logs it when something
  listens there.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from harness import run_ranks

RESET = "This happens if `AcceleratorState._reset_state()` was called"


def _after_reset() -> dict:
    from ndparallel import Accelerator
    from ndparallel.state import AcceleratorState

    first = Accelerator()
    out: dict = {}
    AcceleratorState._reset_state()
    uses = {"num_processes": lambda: first.num_processes, "mixed_precision": lambda: first.state.mixed_precision,
            "prepare": lambda: first.prepare(torch.nn.Linear(2, 2))}
    for name, use in uses.items():
        try:
            use()
            out[name] = "worked"
        except AttributeError as exc:
            out[name] = str(exc)
    first.wait_for_everyone()
    first.state.mine = "kept"  # a script's own attribute on the reset state; the reset message stays
    try:
        first.num_processes
    except AttributeError as exc:
        out["after_setting_one"] = str(exc)
    second = Accelerator()
    out["second"] = (second.num_processes, AcceleratorState() is second.state, first.state.mine)
    return out


def test_reset_state_forgets_every_accelerator_state_as_accelerate_does():
    out = run_ranks(_after_reset, 2)
    assert out[0] == out[1]
    for name, attribute in (("num_processes", "num_processes"), ("mixed_precision", "mixed_precision"),
                            ("after_setting_one", "num_processes")):
        assert out[0][name].startswith(f"`AcceleratorState` object has no attribute `{attribute}`. {RESET}"), name
    assert out[0]["prepare"].startswith("`AcceleratorState` object has no attribute") and RESET in out[0]["prepare"]
    assert out[0]["second"] == (2, True, "kept")


def _device() -> str:
    from ndparallel import Accelerator

    try:
        return str(Accelerator().device)
    except ValueError as exc:
        return f"ValueError: {exc}"


@pytest.mark.parametrize("variable", ["ACCELERATE_TORCH_DEVICE", "NDPARALLEL_TORCH_DEVICE"])
def test_the_torch_device_variable_chooses_this_process_device(variable):
    assert run_ranks(_device, 1, env={variable: "cpu:0"}) == ["cpu:0"]
    refused = run_ranks(_device, 1, env={variable: "cuda:3"})[0]
    assert refused.startswith(f"ValueError: ${variable}='cuda:3': this process runs on cpu (process group backend "
                              "gloo), so its device must be a cpu device"), refused


def _quantized(placement: dict) -> str:
    from ndparallel import Accelerator

    acc = Accelerator()
    model = torch.nn.Linear(2, 2)
    model.is_loaded_in_8bit = True
    model.hf_device_map = placement
    try:
        acc.prepare_model(model)
    except ValueError as exc:
        return str(exc)
    return "prepared"


def test_a_quantized_model_loaded_offloaded_or_elsewhere_is_refused():
    offload = run_ranks(_quantized, 1, {"": "cpu", "lm_head": "disk"})[0]
    assert offload.startswith("prepare(): you can't train a model loaded in 8-bit or 4-bit precision with CPU or "
                              "disk offload: its hf_device_map puts modules on ['cpu', 'disk']"), offload
    elsewhere = run_ranks(_quantized, 1, {"": 0})[0]  # bitsandbytes absent: "cpu" alone is refused as offload too
    assert elsewhere.startswith("prepare(): this model was loaded in 8-bit or 4-bit precision on ['0'], and this "
                                "process trains on cpu"), elsewhere


def _plugin_policy() -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

    mine = FullyShardedDataParallelPlugin()
    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2), fsdp_plugin=mine,
                      mixed_precision="bf16")
    out = {"derived": acc.state.fsdp_plugin.mixed_precision_policy == MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32), "script_plugin": mine.mixed_precision_policy}
    given = FullyShardedDataParallelPlugin(mixed_precision_policy="fp16", reshard_after_forward=False)
    acc.state.fsdp_plugin = given
    out["assigned"] = (acc.fsdp_plugin is given, given.mixed_precision_policy == MixedPrecisionPolicy(
        param_dtype=torch.float16, reduce_dtype=torch.float16))
    plain = Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=2))
    try:
        plain.state.fsdp_plugin = FullyShardedDataParallelPlugin()
        out["refused"] = "assigned"
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


def test_the_derived_policy_is_on_the_state_plugin_and_the_plugin_is_assignable_under_fsdp2():
    for rank in run_ranks(_plugin_policy, 2):
        assert rank["derived"] is True and rank["script_plugin"] is None
        assert rank["assigned"] == (True, True)  # a policy the plugin was given is kept
        assert rank["refused"].startswith("state.fsdp_plugin = ...: this Accelerator does not wrap its models with "
                                          "FSDP2"), rank["refused"]


def test_backward_prefetch_is_logged_where_accelerate_logs_it_when_something_listens_there():
    from ndparallel import FullyShardedDataParallelPlugin

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    root, handler = logging.getLogger(), Keep()
    root.addHandler(handler)  # a handler on the root only: nobody listens to Accelerate's logger
    try:
        with pytest.warns(UserWarning, match=r"backward_prefetch mean\(s\) nothing for FSDP2"):
            FullyShardedDataParallelPlugin(backward_prefetch="BACKWARD_PRE")
        assert records == []  # warned once, not logged twice
        accelerate = logging.getLogger("accelerate")
        accelerate.addHandler(handler)
        try:
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                FullyShardedDataParallelPlugin(backward_prefetch="BACKWARD_PRE")
        finally:
            accelerate.removeHandler(handler)
    finally:
        root.removeHandler(handler)
    assert [(r.name, r.levelname, r.getMessage()) for r in records][:1] == [
        ("accelerate.utils.dataclasses", "WARNING",
         "backward_prefetch is not supported in FSDP2. Setting backward prefetch to None.")]
