#!/usr/bin/env bash
# The Trainer integration's tests (tests/integrations, those not marked slow) once more, against the oldest
# transformers the integration supports with the TRL / PEFT / Accelerate that go with it (.ci/oldest.txt), in a
# plain venv of their own (it must not see the main environment's transformers) with the main environment's torch
# build (this machine's local wheel of it). About 2 minutes to install and 6 to test on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
VENV=${NDPARALLEL_OLDEST_VENV:-${TMPDIR:-/tmp}/ndparallel-oldest}
torch_build=$("$PY" -c "import torch; print(torch.__version__)")
"$PY" -m venv --clear "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "torch==$torch_build" -r .ci/oldest.txt
"${pip[@]}" --no-deps -e .
"$VENV/bin/python" -c "import transformers, trl, peft, accelerate, torch; print('oldest supported:', *(f'{m.__name__} {m.__version__}' for m in (transformers, trl, peft, accelerate, torch)))"
"$VENV/bin/python" -m pytest tests/integrations -m "not slow" -p no:cacheprovider
