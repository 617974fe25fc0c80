#!/usr/bin/env bash
# The GPU check: the GPU test tier (tests/gpu/test_gpu.py), then benchmarks/gpu.py's table and
# benchmarks/long_context_gpu.py's (long sequences; the planner's memory against the allocator's; then with --issue50
# issue 50's features and the allocator's reserve under expandable segments). Run it on any
# machine with a CUDA GPU, from the repository root or anywhere:
#
#     bash scripts/gpu_check.sh [OUT_DIR]        # default: gpu_check_out
#
# It installs nothing: it uses the machine's own torch (a CUDA build), transformers and pytest, and this checkout's
# source (through PYTHONPATH), and says what is missing. The tests' log, the table (gpu_check.md) and the raw
# figures (gpu_check.json) go to OUT_DIR; copy the table into docs/gpu.md with the date.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_check_out}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

python - <<'PY' || exit 2
import importlib.util, sys
missing = [m for m in ("torch", "transformers", "pytest") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing Python packages: {', '.join(missing)} (this script installs nothing)")
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA GPU")
print(f"gpu_check: {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()}), "
      f"torch {torch.__version__}, CUDA {torch.version.cuda}")
PY

python -m pytest -m gpu tests/gpu/test_gpu.py -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.txt"
tests_rc=${PIPESTATUS[0]}
python benchmarks/gpu.py --out "$out" 2>&1 | tee "$out/gpu_benchmark.txt"
bench_rc=${PIPESTATUS[0]}
python benchmarks/long_context_gpu.py --out "$out" 2>&1 | tee "$out/long_context_gpu.txt"
long_rc=${PIPESTATUS[0]}
# issue 50's rows last (8 one-step runs): its features and the allocator's reserve under expandable segments
python benchmarks/long_context_gpu.py --issue50 --out "$out" 2>&1 | tee "$out/long_context_gpu_issue50.txt"
issue50_rc=${PIPESTATUS[0]}
echo "gpu_check: tests exit code $tests_rc, benchmark exit codes $bench_rc (gpu.py), $long_rc (long_context_gpu.py)," \
     "$issue50_rc (long_context_gpu.py --issue50); results in $out/"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$long_rc" -eq 0 ] && [ "$issue50_rc" -eq 0 ]
