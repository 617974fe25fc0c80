"""Accelerate 1.16's accelerator-backend helpers (``accelerate.utils``): which accelerator this build of torch
drives and through which module, its collective backend, device names and free memory.

ndparallel itself trains on CUDA (NCCL) or the CPU (gloo) and chooses them in `runtime`; these functions answer
Accelerate's questions with Accelerate's meaning, for scripts that ask them, on any accelerator torch knows.
"""

from __future__ import annotations

import types
from typing import Any

import torch

# Device types that answer through their own torch module (``torch.cuda``, ``torch.xpu``, ...); any other accelerator
# torch registers (a TPU, a PrivateUse1 backend) answers through the generic ``torch.accelerator`` API.
NATIVE_MODULES = frozenset({"cuda", "mps", "mlu", "sdaa", "musa", "npu", "hpu", "xpu", "neuron"})
# Plug-ins that can be installed without torch seeing them as its accelerator: asked for by name last.
_LATE_PLUGINS = ("hpu", "neuron")
# Each device type's collective backend, as Accelerate's ``TORCH_DISTRIBUTED_BACKENDS`` (none for the CPU or MPS).
DISTRIBUTED_BACKENDS = {"cuda": "nccl", "mlu": "cncl", "sdaa": "tccl", "musa": "mccl", "npu": "hccl",
                        "hpu": "hccl", "xpu": "xccl", "neuron": "neuron"}


def _available(device_type: str) -> bool:
    module = getattr(torch, device_type, None)
    check = getattr(module, "is_available", None)
    if callable(check):
        return bool(check())
    return torch.accelerator.is_available()


def get_torch_accelerator_backend(check_available: bool = True) -> tuple[str | None, types.ModuleType | None]:
    """The accelerator of this torch (its device type) and the module to ask about it: ``("cuda", torch.cuda)``,
    ``("tpu", torch.accelerator)`` for a backend without a module of its own, ``(None, None)`` with none (a
    CPU-only run). `check_available=False` names the accelerator torch was built for without asking whether a device
    is there (nothing is initialised: safe before forking)."""
    device = torch.accelerator.current_accelerator()
    if device is not None and (not check_available or _available(device.type)):
        if device.type in NATIVE_MODULES:
            return device.type, torch.get_device_module(device.type)
        return device.type, torch.accelerator
    for name in _LATE_PLUGINS:
        module = getattr(torch, name, None)
        if module is not None and callable(getattr(module, "is_available", None)) and module.is_available():
            return name, module
    return None, None


def get_distributed_backend(device_type: str | None) -> str | None:
    """The default collective backend of `device_type` ("cuda" -> "nccl", "xpu" -> "xccl" where torch has it), or
    None where Accelerate names none (the CPU, MPS, None; ndparallel's CPU runs use gloo)."""
    if device_type == "xpu" and not (torch.distributed.is_available()
                                     and torch.distributed.distributed_c10d.is_xccl_available()):
        return None
    return DISTRIBUTED_BACKENDS.get(device_type) if device_type is not None else None


def normalize_device(device: Any) -> Any:
    """A device as torch takes it on this machine's accelerator: an integer index becomes ``"<type>:<index>"`` on
    accelerators other than CUDA (CUDA takes the integer; HPU only ``"hpu"``), ``"npu"`` becomes ``"npu:0"`` (NPU
    needs an index the first time); anything else is returned unchanged. Asks for no device (see
    `get_torch_accelerator_backend`)."""
    if device == "npu":
        return "npu:0"
    if isinstance(device, int) and not isinstance(device, bool):
        device_type, _ = get_torch_accelerator_backend(check_available=False)
        if device_type == "hpu":
            return "hpu"
        if device_type is not None and device_type != "cuda":
            return f"{device_type}:{device}"
    return device


def get_accelerator_free_memory(device_module: Any, device_index: int) -> int:
    """Free memory of device `device_index`, in bytes, asked through `device_module` (the module
    `get_torch_accelerator_backend` returned): its ``mem_get_info``, or ``torch.accelerator.get_memory_info``
    for the generic API (on a torch without it: the device's own module's ``mem_get_info``)."""
    if device_module is torch.accelerator:
        if hasattr(torch.accelerator, "get_memory_info"):
            return int(torch.accelerator.get_memory_info(device_index)[0])
        device = torch.accelerator.current_accelerator()
        if device is None:
            raise RuntimeError("get_accelerator_free_memory: torch has no accelerator on this machine")
        device_module = torch.get_device_module(device.type)
    return int(device_module.mem_get_info(device_index)[0])
