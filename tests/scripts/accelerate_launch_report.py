"""Launched by tests/launch/test_accelerate_launch.py: build the Accelerator from what the launcher exported (as an
Accelerate script does, with no arguments), prepare a small model, and print the settings it got as one JSON line."""

import json
import sys

import torch

from ndparallel import Accelerator

accelerator = Accelerator()
model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)))
plugin = accelerator.fsdp_plugin
record = {
    "rank": accelerator.process_index,
    "world_size": accelerator.num_processes,
    "sizes": {axis: size for axis, size in accelerator.parallelism_config.sizes().items() if size != 1},
    "fsdp2": accelerator.is_fsdp2,
    "mixed_precision": accelerator.mixed_precision,
    "wrap": None if plugin is None else plugin.auto_wrap_policy,
    "reshard": None if plugin is None else plugin.reshard_after_forward,
    "cp_strategy": accelerator.parallelism_config.cp_handler.cp_comm_strategy,
    "model": type(model).__name__,
}
# One write of the whole line: with several ranks on one pipe (and PYTHONUNBUFFERED), print's separate write of
# the newline lets two ranks' lines run together.
sys.stdout.write("RESULT " + json.dumps(record) + "\n")
sys.stdout.flush()
accelerator.end_training()
