#!/usr/bin/env bash
# Install ndparallel (editable) with the Hugging Face extra; `--test` adds the test dependencies and the docs site's
# (tests/project/test_docs_site.py builds it).
# A torch >= 2.6 that is already installed is kept as it is (a GPU build stays a GPU build); otherwise the
# torch version we test on is installed. Pinning it matters: an unpinned `torch` may pull gigabytes of CUDA
# packages onto a machine that has no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
extras="hf"
if [ "${1:-}" = "--test" ]; then extras="hf,test,docs"; fi
if ! "$PY" - <<'PYEOF' 2>/dev/null
import sys, torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 6) else 1)
PYEOF
then
  echo "install.sh: installing torch==2.13.0" >&2
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[$extras]"
