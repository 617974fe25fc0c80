"""Launched by tests/launch/test_cli.py: print what this rank received from `ndparallel launch`, as one JSON line.

Does not import ndparallel's Accelerator. ``--fail-rank R --exit-code C`` makes rank R exit with code C.
"""

import argparse
import json
import os
import sys

from ndparallel.configuration.parallelism import ParallelismConfig

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, default=None)
parser.add_argument("--exit-code", type=int, default=1)
args = parser.parse_args()

rank = int(os.environ["RANK"])
record = {
    "rank": rank,
    "world_size": int(os.environ["WORLD_SIZE"]),
    "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NDPARALLEL_")},
    "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    "sizes": {k: v for k, v in ParallelismConfig.from_env().to_dict().items() if k.endswith("_size")},
}
# One write of the whole line: with several ranks on one pipe (and PYTHONUNBUFFERED), print's separate write of
# the newline lets two ranks' lines run together.
sys.stdout.write("RESULT " + json.dumps(record) + "\n")
sys.stdout.flush()
if args.fail_rank == rank:
    sys.exit(args.exit_code)
