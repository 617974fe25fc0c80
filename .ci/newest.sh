#!/usr/bin/env bash
# The Trainer integration against the newest releases of transformers, TRL, PEFT and Accelerate on the registry at
# the moment CI runs, so a release that breaks it shows here before users meet it (ndparallel.integrations.trainer's
# version policy lets a newer transformers than tested run, with a warning). A venv that sees the main environment's
# packages (torch and the rest are not installed twice) gets the four upgraded, with what they need and nothing else;
# then the integration's fast tests run there. Its last line names each package whose version differs from the
# pinned one (pyproject.toml's `trainer` extra), and whether the tests passed with them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
VENV=${NDPARALLEL_NEWEST_VENV:-${TMPDIR:-/tmp}/ndparallel-newest}
PACKAGES=(transformers trl peft accelerate)
source .ci/overlay_venv.sh && overlay_venv "$VENV"
# only-if-needed: the four move to their newest release; what they depend on moves only where they require it (torch
# among them: a release that needs a newer torch than this machine installs fails here, and says so).
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade --upgrade-strategy only-if-needed \
  "${PACKAGES[@]}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
describe() {  # the packages as installed, each beside its pin where they differ
  "$VENV/bin/python" - "${PACKAGES[@]}" <<'PYEOF'
import re, sys
from importlib.metadata import version
pins = dict(re.findall(r'"([a-z]+)==([^"]+)"', re.search(r"^trainer = \[(.*)\]$", open("pyproject.toml").read(), re.M)[1]))
print(", ".join([f"{name} {version(name)}" + ("" if pins[name] == version(name) else f" (pinned {pins[name]})")
                 for name in sys.argv[1:]] + [f"torch {version('torch')}"]))
PYEOF
}
echo "newest releases: $(describe)"
if "$VENV/bin/python" -m pytest -p no:cacheprovider -q -m "not slow" tests/integrations; then
  echo "newest releases: the integration tests passed with $(describe)"
else
  echo "newest releases: the integration tests FAILED with $(describe): the packages marked (pinned ...) are the new" \
       "releases to read first" >&2
  exit 1
fi
