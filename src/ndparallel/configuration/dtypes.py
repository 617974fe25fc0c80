"""Floating-point dtypes by the names settings use, and the dtype a mixed-precision setting computes in."""

from __future__ import annotations

from typing import Any

import torch


# Floating-point dtypes by the names settings use. Mixed precision is one of MIXED_PRECISION: "no" computes in the
# parameters' own dtype, the others in that dtype (`compute_dtype`).
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                                  "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}

MIXED_PRECISION = ("no", "bf16", "fp16", "fp8")


def compute_dtype(mixed_precision: str) -> torch.dtype | None:
    """The dtype a `mixed_precision` setting computes in; None for "no". fp8 computes its eligible linear layers'
    matmuls in fp8 (`ndparallel.parallel.fp8`) and the rest in bf16, as Accelerate does."""
    if mixed_precision == "fp8":
        return torch.bfloat16
    return None if mixed_precision == "no" else DTYPES[mixed_precision]


def parse_dtype(value: Any, what: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower() in DTYPES:
        return DTYPES[value.lower()]
    raise ValueError(f"{what}: unknown dtype {value!r}; use one of {sorted(DTYPES)} or a torch.dtype")
