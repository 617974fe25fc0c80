"""Starting torch.distributed: backend, device and a one-process world when nothing launched us.

Environment variables read here (``ndparallel launch`` sets them):
- ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``: torchrun's;
- ``NDPARALLEL_CPU=1``: use the CPU and gloo even where CUDA is available.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

CPU_ENV = "NDPARALLEL_CPU"


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def init_runtime(cpu: bool = False) -> Runtime:
    """Initialise the default process group if needed and pick this rank's device.

    NCCL and ``cuda:LOCAL_RANK`` when CUDA is available and `cpu` is False; gloo and the CPU otherwise.
    A process not started by a launcher becomes a world of one.
    """
    cpu = cpu or env_flag(CPU_ENV) or not torch.cuda.is_available()
    if not dist.is_initialized():
        if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise RuntimeError(
                f"incomplete launch environment: {', '.join(missing)} not set; start the script with "
                "`ndparallel launch` (or torchrun), or set all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"
            )
        backend = "gloo" if cpu else "nccl"
        if not cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    backend = dist.get_backend()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if cpu or "nccl" not in str(backend):
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return Runtime(rank, world_size, local_rank, local_world_size, device, str(backend))
