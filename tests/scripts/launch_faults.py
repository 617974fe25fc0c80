"""Launched by tests/launch/test_launch_faults.py under `ndparallel launch`: ranks that run on, or stall.

``loop --pid-dir D``: each rank writes its pid to ``D/rank_<RANK>.pid``, then prints a step every 0.1 s, forever.
``stall``: the ranks start a gloo process group and make library calls (heartbeats) for a moment; then rank 1
sleeps without a call (a rank stuck in user code) while rank 0 waits for it in a barrier.
"""

import argparse
import os
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=("loop", "stall"))
parser.add_argument("--pid-dir", type=Path, default=None)
args = parser.parse_args()
rank = int(os.environ["RANK"])

if args.mode == "loop":
    (args.pid_dir / f"rank_{rank}.pid").write_text(str(os.getpid()))
    step = 0
    while True:
        step += 1
        print(f"rank {rank} step {step}", flush=True)
        time.sleep(0.1)
else:
    import torch.distributed as dist

    from ndparallel.runtime import heartbeat, init_runtime

    init_runtime(cpu=True)
    for _ in range(5):
        heartbeat("training step")
        time.sleep(0.1)
    if rank == 1:
        time.sleep(600)  # stuck: no library call any more
    heartbeat("barrier")
    dist.barrier()  # rank 0 waits here for rank 1
