import os
import sys
from pathlib import Path

import pytest
import torch

from ndparallel.launch.schedulers import is_scheduler_variable

# The tests launch as on a machine of their own: a SLURM job or a Kubernetes pod running the suite must not give
# `ndparallel launch` its nodes (ndparallel.launch.schedulers); tests of that set the variables themselves.
for _name in [name for name in os.environ if is_scheduler_variable(name)]:
    del os.environ[_name]

# One thread per process: forked ranks share 2 cores, and a parent without an OpenMP pool forks safely.
torch.set_num_threads(1)

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS / "scripts"))
# Tests live in a folder per area (mirroring src/ndparallel); they import each other's helpers by module name
# (`from test_parity import run_layout`), so every folder of tests is on the path too.
for _area in sorted({p.parent for p in TESTS.rglob("test_*.py")} - {TESTS}):
    sys.path.insert(0, str(_area))


@pytest.fixture(autouse=True)
def _pytest_process_stays_undistributed():
    """Ranks are forked from this process: a live process group here (an Accelerator built outside
    `run_ranks`) makes later forked ranks hang, so the test that creates one fails instead."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        pytest.fail("this test initialised torch.distributed in the pytest process; build Accelerators in "
                    "forked ranks (tests/harness.py run_ranks)")
