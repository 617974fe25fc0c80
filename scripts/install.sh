#!/usr/bin/env bash
# Install ndparallel (editable) with the Hugging Face extra (`hf`: transformers). Each option adds the extra of its
# name from pyproject.toml: --trainer (the Trainer, TRL and PEFT at the versions tested), --fp8 (torchao),
# --tracking (tensorboard), --bench (matplotlib for benchmark plots), --plot (matplotlib for `ndparallel plan --plot`),
# --ft (torchft for `ndparallel launch --fault-tolerant`),
# --docs (the documentation site: mkdocs), --test (the test dependencies, the docs site's and the plots' included:
# tests/project/test_docs_site.py builds the site); for example `bash scripts/install.sh --trainer --fp8`.
# A torch >= 2.11 (the oldest the suite passes on, pyproject.toml's floor) that is already installed is kept as it
# is (a GPU build stays a GPU build); otherwise the torch version we test on is installed. Pinning it matters: an
# unpinned `torch` may pull gigabytes of CUDA packages onto a machine that has no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
# The interpreter: $PYTHON if set, else `python`, else `python3` (Debian and Ubuntu have no `python` by default).
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if command -v python >/dev/null 2>&1; then PY=python
  elif command -v python3 >/dev/null 2>&1; then PY=python3
  else echo "install.sh: neither python nor python3 is on PATH: install Python >= 3.10, or set PYTHON=/path/to/python" >&2
       exit 127
  fi
fi
# A system Python that its distribution manages (PEP 668: Debian, Ubuntu, Fedora...) refuses pip installs outside a
# virtual environment: say so before pip does, with the two commands that make and enter one.
if "$PY" - <<'PYEOF'
import os, sys, sysconfig
managed = os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
sys.exit(0 if managed and sys.prefix == sys.base_prefix else 1)
PYEOF
then
  echo "install.sh: $PY is the system's Python, whose packages its distribution manages (PEP 668): pip refuses to" \
       "install into it. Make a virtual environment and run this again inside it:" \
       "$PY -m venv ~/.venvs/ndparallel && . ~/.venvs/ndparallel/bin/activate" >&2
  exit 1
fi
extras="hf"
for option in "$@"; do
  case "$option" in
    --trainer|--fp8|--tracking|--bench|--plot|--ft|--docs|--test) extras="$extras,${option#--}" ;;
    *) echo "install.sh: unknown option '$option'; the options are --trainer --fp8 --tracking --bench --plot --ft --docs --test" >&2
       exit 2 ;;
  esac
done
if ! "$PY" - <<'PYEOF' 2>/dev/null
import sys, torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PYEOF
then
  echo "install.sh: installing torch==2.13.0" >&2
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[$extras]"
