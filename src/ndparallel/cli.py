"""``python -m ndparallel.cli``: the ``ndparallel`` command (home: `ndparallel.launch.cli`)."""

import sys

from .launch.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
