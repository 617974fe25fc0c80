#!/usr/bin/env bash
# The Trainer integration against the oldest transformers it supports, with the TRL / PEFT / Accelerate that go with
# it (.ci/oldest.txt), and the Axolotl integration with Axolotl 0.19.0, whose pins those are (.ci/axolotl.txt). A venv
# that sees the main environment's packages (torch and the rest are not installed twice) gets exactly those wheels,
# without dependencies, which shadow the main environment's; the wheels are kept in $NDPARALLEL_OLDEST_WHEELS
# (downloaded once, about 420 MB and 15 s, Triton most of it; installed from there without the network after).
# It runs the tests that read what differs between transformers minors: the version policy, a Trainer and an
# SFTTrainer with LoRA under tensor parallelism (compute_loss's multiplier reads the tp size one way before 5.19,
# another after), a checkpoint resumed into another layout; and Axolotl's configs (tests/integrations/test_axolotl.py).
# The whole of tests/integrations passes there too: NDPARALLEL_OLDEST_ALL=1 runs it (about 8 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
VENV=${NDPARALLEL_OLDEST_VENV:-${TMPDIR:-/tmp}/ndparallel-oldest}
WHEELS=${NDPARALLEL_OLDEST_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/ndparallel/oldest-wheels}
pip=("$PY" -m pip --disable-pip-version-check --quiet)
source .ci/overlay_venv.sh && overlay_venv "$VENV" --without-pip
install=("${pip[@]}" --python "$VENV/bin/python" install --no-compile --no-deps --no-index --find-links "$WHEELS"
         -r .ci/oldest.txt -r .ci/axolotl.txt)
if ! "${install[@]}" 2>/dev/null; then
  # `pip wheel`, not `download`: Axolotl's contribs packages are published as sources only, built to wheels once here
  "${pip[@]}" wheel --no-deps --wheel-dir "$WHEELS" -r .ci/oldest.txt -r .ci/axolotl.txt
  rm -f "$WHEELS"/*.tar.gz
  "${install[@]}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
"$VENV/bin/python" - <<PYEOF
from importlib.metadata import version  # what the venv resolves first, without importing it
print("oldest supported:", *(f"{name} {version(name)}" for name in ("transformers", "trl", "peft", "accelerate", "torch")))
assert version("transformers") == "$(sed -n 's/^transformers==//p' .ci/oldest.txt)", version("transformers")
PYEOF
if [ -n "${NDPARALLEL_OLDEST_ALL:-}" ]; then
  exec "$VENV/bin/python" -m pytest tests/integrations -m "not slow" -p no:cacheprovider
fi
t=tests/integrations
"$VENV/bin/python" -m pytest -p no:cacheprovider -q \
  "$t/test_trainer_support.py::test_older_transformers_are_refused_newer_ones_warned_about" \
  "$t/test_trainer_support.py::test_a_trainer_subclass_that_bypasses_a_hook_is_refused_by_name" \
  "$t/test_trainer.py::test_the_trainer_trains_as_one_process[tp 2--]" \
  "$t/test_trainer.py::test_sft_trainer_trains_as_one_process[tp 2-padded; LoRA on every projection (\`peft_config\`)]" \
  "$t/test_trainer_checkpoints.py::test_checkpoints_resume_exactly_into_another_layout" \
  tests/integrations/test_axolotl.py
