"""``python -m ndparallel ...``: the ``ndparallel`` command (`ndparallel.launch.cli`), for an environment where the
console script is not on PATH (a venv not activated, a checkout on PYTHONPATH)."""

import sys

from .launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
