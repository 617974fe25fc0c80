"""The environment variables and files settings come from: ndparallel's ``NDPARALLEL_<FIELD>``, Accelerate's
``PARALLELISM_CONFIG_<FIELD>``, and YAML config files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .dtypes import MIXED_PRECISION


ENV_PREFIX = "NDPARALLEL_"

# Settings `ndparallel launch` passes to the Accelerator of every rank (used when the script leaves them unset).
MIXED_PRECISION_ENV = ENV_PREFIX + "MIXED_PRECISION"

ACCUMULATION_ENV = ENV_PREFIX + "GRADIENT_ACCUMULATION_STEPS"


def size_env_var(field_name: str) -> str:
    """Environment variable through which the launcher passes one size, e.g. ``NDPARALLEL_TP_SIZE``."""
    return ENV_PREFIX + field_name.upper()


# Accelerate's environment variables (`accelerate launch` exports them), read for the fields a config leaves unset
# after ndparallel's own NDPARALLEL_<FIELD>.
ACCELERATE_ENV_PREFIX = "PARALLELISM_CONFIG_"


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Load a YAML mapping with an error that names the file when it is missing or malformed."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {str(p)!r} does not exist; write one with `ndparallel config`")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(p)!r} must hold a mapping at the top level, got {type(data).__name__}")
    return data
