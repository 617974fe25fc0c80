"""What the ``ndparallel`` subcommands share: the program name, how an error is said, how a flag is spelled."""

from __future__ import annotations

import sys
from typing import Any

PROG = "ndparallel"


def error(command: str, message: Any) -> int:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    return 2


def spellings(*names: str) -> list[str]:
    """``--a-b`` and ``--a_b`` for each name: every flag is accepted both ways, as ``accelerate launch`` does."""
    return [f"--{spelling}" for name in names for spelling in dict.fromkeys((name.replace("_", "-"),
                                                                               name.replace("-", "_")))]
