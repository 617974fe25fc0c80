"""A collective call made on one rank only, while the other trains on: every rank's error says what the others were
doing (`ndparallel.distributed.failures`), within the timeout plus the grace period.

Rank `saver` calls ``save_state`` alone (under an ``if``, the classic mistake) before a forward or between a forward
and its backward; the other rank goes on training, and its next collective is FSDP2's all-gather in the forward
(dp_shard 2), or DDP's all-reduce in the backward. The saver fails in ``monitored_barrier('save_state')`` naming the step the
other rank was in; the other rank fails with the backend's own error (its type kept) whose message now says which
call it was in and that the saver was waiting in ``save_state``.
"""

from __future__ import annotations

import datetime
import re
import time

import pytest
import torch

from harness import run_ranks
from tiny_models import build_model

TIMEOUT = 2.0  # seconds: the process group's and the monitored barrier's
SAVER_GRACE = 30.0  # the saver's grace period: far longer than the test, so waiting it out would be unmistakable


def _one_rank_saves(directory: str, saver: int, layout: str, before: str) -> tuple[str, str, float]:
    import torch.distributed as dist

    from ndparallel import (Accelerator, DistributedDataParallelKwargs, FullyShardedDataParallelPlugin,
                            InitProcessGroupKwargs, ParallelismConfig)
    from ndparallel.distributed import agreement

    handlers = [InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=TIMEOUT))]
    if layout == "fsdp2":
        accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2), kwargs_handlers=handlers,
                                  fsdp_plugin=FullyShardedDataParallelPlugin())
    else:
        accelerator = Accelerator(kwargs_handlers=[*handlers, DistributedDataParallelKwargs(broadcast_buffers=False)])
    torch.manual_seed(0)
    model = build_model("llama")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = (torch.arange(32).reshape(2, 16) * 3) % 96
    if accelerator.process_index == saver:  # the saver's barrier waits for the trainer's report, not the grace period
        agreement.grace_period = lambda timeout: SAVER_GRACE
    store = dist.distributed_c10d._get_default_store()
    kind, message = "none", ""
    started = time.perf_counter()
    try:
        for step in range(3):
            if step == 1 and before == "forward" and accelerator.process_index == saver:
                started = time.perf_counter()
                accelerator.save_state(directory)
            if step == 1:
                started = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            if step == 1 and before == "backward" and accelerator.process_index == saver:
                started = time.perf_counter()
                accelerator.save_state(directory)
            if step == 1:
                started = time.perf_counter()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        kind, message = type(exc).__name__, str(exc)
    seconds = time.perf_counter() - started
    # Rank 0 hosts the store the other rank's report reads: it leaves only once that rank is done.
    if accelerator.process_index == 0:
        store.wait(["test/done"], datetime.timedelta(seconds=60))
    else:
        store.set("test/done", "1")
    return kind, message, seconds


@pytest.mark.slow
@pytest.mark.parametrize("layout,saver,step_call", [("fsdp2", 0, "forward"), ("fsdp2", 1, "forward"),
                                                    ("ddp", 0, "backward")])
def test_a_save_on_one_rank_fails_every_rank_naming_what_the_others_were_doing(tmp_path, layout, saver, step_call):
    results = run_ranks(_one_rank_saves, 2, str(tmp_path / "ckpt"), saver, layout, step_call, timeout=120)
    trainer = 1 - saver
    kind, message, seconds = results[saver]
    assert kind == "CollectiveTimeoutError", message
    assert message.startswith(f"monitored_barrier('save_state'): not every rank arrived within {TIMEOUT:g} s"), message
    assert f"rank {trainer} (" in message and f"): in '{step_call}' (its step call #" in message, message
    assert "whose collective failed after" in message, message
    # The saver waits for the other rank's report, not the rest of its grace period (30 s here, so the wrong way
    # takes 32 s): late is fine on a loaded machine.
    assert TIMEOUT <= seconds < TIMEOUT + SAVER_GRACE / 3, seconds

    kind, message, seconds = results[trainer]
    assert kind in ("RuntimeError", "DistBackendError"), message  # the backend's error, its type kept
    assert "Timed out" in message or "Connection closed by peer" in message, message
    assert f"\nndparallel: {step_call}: the collective over ranks 0-1 failed after " in message, message
    assert f"rank {trainer} in '{step_call}'; rank {saver} did not report." in message, message
    # The saver is named waiting in save_state; "gave up" too once it has given up, which it does at its own timeout,
    # a moment before or after this rank's report is written.
    assert re.search(rf"rank {saver} \([^)]*\): did not report being in a collective; (gave up )?waiting in "
                     r"monitored call 'save_state'", message), message
    # The timeout, then up to the grace period (max(1 s, timeout / 10)) for a report the saver never posts -- cut
    # short once the saver has given up in save_state (no report is coming, and it is about to exit, after which the
    # launcher would stop this rank before it printed); ending well before the longest grace period (30 s) ends it.
    # Late is fine on a loaded machine.
    assert TIMEOUT <= seconds < TIMEOUT + 1.0 + 10, seconds
