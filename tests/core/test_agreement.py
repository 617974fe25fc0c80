"""Ranks that disagree, and collectives that must not wait forever (ndparallel.distributed.agreement,
ndparallel.distributed.runtime): on forked gloo ranks, each disagreement of issue 20 raises the same error naming the
field, the ranks and their values on every rank; a barrier that some rank reaches under another name fails at once, one
that some rank never reaches fails after its (short) timeout naming who is missing; the process-group timeout comes from
NDPARALLEL_TIMEOUT."""

from __future__ import annotations

import datetime
import re
import time

import pytest
import torch
from torch.utils.data import DataLoader
from transformers import LlamaForCausalLM  # noqa: F401 - imported once here, not again in every forked rank

from harness import outcomes, run_ranks
from ndparallel import FullyShardedDataParallelPlugin, ParallelismConfig
from ndparallel.distributed.agreement import (
    accelerator_fingerprint,
    check_agreement,
    dataloader_fingerprint,
    model_fingerprint,
    monitored_barrier,
    optimizer_fingerprint,
    prepare_fingerprint,
)
from ndparallel.distributed.runtime import DEFAULT_TIMEOUT, init_runtime, resolve_timeout
from tiny_models import build_model


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows) -> None:
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return self.rows[i]


def _disagreements() -> dict:
    rank = init_runtime(cpu=True).rank
    plugin = FullyShardedDataParallelPlugin()
    same_model = build_model("llama")

    def settings(**mine):
        base = dict(parallelism_config=ParallelismConfig(dp_shard_size=2), fsdp_plugin=plugin, mixed_precision="no",
                    gradient_accumulation_steps=2, device="cpu")
        return accelerator_fingerprint(**{**base, **mine})

    cases = {
        "same": lambda: check_agreement(settings(), "Accelerator()"),
        "parallelism": lambda: check_agreement(settings(parallelism_config=ParallelismConfig(
            tp_size=2) if rank == 0 else ParallelismConfig(dp_shard_size=2)), "Accelerator()"),
        "mixed_precision": lambda: check_agreement(settings(mixed_precision="bf16" if rank else "no"),
                                                   "Accelerator()"),
        "batch_size": lambda: check_agreement(prepare_fingerprint(
            [same_model, DataLoader(list(range(10)), batch_size=2 + rank)]), "prepare()"),
        "dataset_length": lambda: check_agreement(dataloader_fingerprint(DataLoader(list(range(10 + rank)))),
                                                  "prepare()"),
        # The same rows as another class (rank 0 tokenized them, rank 1 loaded them from its cache): one dataset.
        "same_rows_other_class": lambda: check_agreement(dataloader_fingerprint(DataLoader(
            list(range(10)) if rank == 0 else Rows(range(10)))), "prepare()"),
        "model_shapes": lambda: check_agreement(model_fingerprint(build_model("llama", hidden_size=32 * (1 + rank))),
                                                "prepare()"),
        "model_depth": lambda: check_agreement(model_fingerprint(build_model("llama", num_hidden_layers=2 + rank)),
                                               "prepare()"),
        "optimizer": lambda: check_agreement(optimizer_fingerprint(torch.optim.AdamW(
            same_model.parameters(), lr=1e-3 * (1 + rank))), "prepare()"),
        "same_prepare": lambda: check_agreement(prepare_fingerprint(
            [same_model, torch.optim.SGD(same_model.parameters(), lr=0.1), DataLoader(list(range(10)), batch_size=2)]),
            "prepare()"),
    }
    started = time.perf_counter()
    out = outcomes(cases)
    out["seconds"] = time.perf_counter() - started
    return out


@pytest.fixture(scope="module")
def disagreements():
    return run_ranks(_disagreements, 2, timeout=120)


EXPECTED = {  # case -> lines the message must hold (each rank raises exactly the same message)
    "parallelism": ["Accelerator(): the ranks disagree on 2 setting(s) that must be the same on every rank:",
                    "parallelism.dp_shard_size: rank 0: 1; rank 1: 2", "parallelism.tp_size: rank 0: 2; rank 1: 1"],
    "mixed_precision": ['mixed_precision: rank 0: "no"; rank 1: "bf16"'],
    "batch_size": ["prepare(): the ranks disagree on 1 setting(s)",
                   "argument 1 (data loader).batch_size: rank 0: 2; rank 1: 3"],
    "dataset_length": ["dataset_length: rank 0: 10; rank 1: 11"],
    "model_shapes": ['parameters: 21 vs 21 entries, first difference at entry 0: rank 0 ["model.embed_tokens.weight", '
                     '[96, 32], "torch.float32"] vs rank 1 ["model.embed_tokens.weight", [96, 64], "torch.float32"]'],
    "model_depth": ['parameters: 21 vs 30 entries, first difference at entry 19: rank 0 ["model.norm.weight", [32], '
                    '"torch.float32"] vs rank 1 ["model.layers.2.self_attn.q_proj.weight", [32, 32], "torch.float32"]'],
    "optimizer": ["param_groups.0.lr: rank 0: 0.001; rank 1: 0.002"],
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_a_disagreement_raises_the_same_error_naming_it_on_every_rank(disagreements, case):
    first, second = disagreements
    assert first[case] == second[case], "the ranks raised different errors"
    kind, message = first[case]
    assert kind == "ValueError", (kind, message)
    for line in EXPECTED[case]:
        assert line in message, f"{line!r} not in:\n{message}"
    assert "an environment variable (NDPARALLEL_*) set on some nodes only" in message


def test_ranks_that_agree_pass_and_the_checks_are_quick(disagreements):
    for out in disagreements:
        assert out["same"] == out["same_prepare"] == out["same_rows_other_class"] == ("no error", "")
        # Timed inside the ranks around the ten checks only (about 0.2 s here): none waits for the timeout (10
        # minutes), with a wide margin for a loaded machine.
        assert out["seconds"] < 10


def _barriers() -> dict:
    import torch.distributed as dist

    rank = init_runtime(cpu=True).rank
    store = dist.distributed_c10d._get_default_store()
    out = {}
    started = time.perf_counter()
    out["different_calls"] = outcomes({"x": lambda: monitored_barrier("save_state" if rank == 0 else
                                                                     "wait_for_everyone", timeout=30)})["x"]
    out["different_seconds"] = time.perf_counter() - started
    out["same_call"] = outcomes({"x": lambda: monitored_barrier("prepare", timeout=30)})["x"]
    started = time.perf_counter()
    if rank == 0:  # rank 1 comes too late (it is busy): rank 0 gives up, then rank 1 fails at once on arrival
        out["missing"] = outcomes({"x": lambda: monitored_barrier("save_state", timeout=1.5)})["x"]
        out["missing_seconds"] = time.perf_counter() - started
        store.set("test/gave_up", "1")
        store.wait(["test/late"], datetime.timedelta(seconds=30))  # this rank hosts the store: stay until rank 1 is done
    else:
        # Busy outside the library until rank 0 has given up: the order is the store's, not a sleep's (a fixed sleep
        # raced rank 0's timeout plus grace period on a loaded machine).
        store.wait(["test/gave_up"], datetime.timedelta(seconds=50))
        started = time.perf_counter()
        out["late"] = outcomes({"x": lambda: monitored_barrier("save_state", timeout=30)})["x"]
        out["late_seconds"] = time.perf_counter() - started
        store.set("test/late", "done")
    return out


@pytest.mark.slow
def test_monitored_barrier_names_different_calls_at_once_and_missing_ranks_after_the_timeout():
    results = run_ranks(_barriers, 2, timeout=60)
    for out in results:
        kind, message = out["different_calls"]
        assert kind == "CollectiveTimeoutError", message
        assert message.startswith("monitored_barrier: the ranks reached different collective calls as their call #0 "
                                  "('save_state' / 'wait_for_everyone'). A collective call made on some ranks only -- "
                                  "e.g. save_state or wait_for_everyone under `if accelerator.is_main_process:`"), \
            message
        assert "rank 0 (" in message and "): 'save_state'\n  rank 1 (" in message and message.endswith(
            "): 'wait_for_everyone'"), message
        # At once: the message above is the mismatch's, on both ranks (a rank that waited out its timeout would raise
        # "not every rank arrived within 30 s"), and well within that 30 s timeout (a loaded machine may be slow).
        assert out["different_seconds"] < 15, "a mismatch must not wait for the timeout"
        assert out["same_call"] == ("no error", "")
    kind, message = results[0]["missing"]
    assert kind == "CollectiveTimeoutError"
    assert message.startswith("monitored_barrier('save_state'): not every rank arrived within 1.5 s "), message
    assert "rank 0 arrived; rank 1 did not:\n  rank 0 (" in message and "): waiting in 'save_state' (its call #2)\n" \
        "  rank 1 (" in message and "): last passed 'prepare' (its call #1, " in message, message
    # It waited the timeout and gave up (rank 1 arrives only once it has: the store orders them), well before
    # the harness's limit; how late it is on a loaded machine is not the behaviour.
    assert 1.5 <= results[0]["missing_seconds"] < 15
    # Rank 1, arriving after rank 0 gave up, fails with rank 0's message instead of waiting out its own 30 s timeout.
    assert results[1]["late"] == ("CollectiveTimeoutError", message) and results[1]["late_seconds"] < 15


def _collective_times_out() -> tuple[float, str]:
    import torch.distributed as dist

    rank = init_runtime(cpu=True).rank
    store = dist.distributed_c10d._get_default_store()
    started = time.perf_counter()
    if rank == 0:
        try:
            dist.barrier()
            return time.perf_counter() - started, "no error"
        except RuntimeError as exc:
            return time.perf_counter() - started, str(exc)
        finally:
            store.set("test/failed", "1")
    # Rank 1 stays out of the barrier, alive, until rank 0's barrier has failed: the failure is the timeout's, not a
    # closed connection's (the store orders them; a fixed sleep raced the timeout on a loaded machine).
    store.wait(["test/failed"], datetime.timedelta(seconds=50))
    return 0.0, ""


@pytest.mark.slow
def test_the_process_group_timeout_comes_from_NDPARALLEL_TIMEOUT():
    seconds, message = run_ranks(_collective_times_out, 2, env={"NDPARALLEL_TIMEOUT": "1.5"}, timeout=60)[0]
    # gloo names the timeout it was given (the default would be 600000ms); the clock only says it was waited for.
    assert "Timed out waiting 1500ms" in message, message
    assert 1.4 <= seconds < 30, (seconds, message)


def test_resolve_timeout(monkeypatch):
    monkeypatch.delenv("NDPARALLEL_TIMEOUT", raising=False)
    assert resolve_timeout() == DEFAULT_TIMEOUT == datetime.timedelta(minutes=10)
    assert resolve_timeout(30) == datetime.timedelta(seconds=30)
    monkeypatch.setenv("NDPARALLEL_TIMEOUT", "90")
    assert resolve_timeout() == datetime.timedelta(seconds=90)
    assert resolve_timeout(datetime.timedelta(seconds=5)) == datetime.timedelta(seconds=5)  # explicit wins
    monkeypatch.setenv("NDPARALLEL_TIMEOUT", "ten")
    with pytest.raises(ValueError, match=r"\$NDPARALLEL_TIMEOUT must be a number of seconds > 0, got 'ten'"):
        resolve_timeout()
    with pytest.raises(ValueError, match=r"timeout must be > 0 seconds, got -1"):
        resolve_timeout(-1)
    with pytest.raises(TypeError, match="timeout must be a datetime.timedelta or a number of seconds"):
        resolve_timeout("5")


def _through_the_accelerator(tmp: str) -> dict:
    """The checks as a user meets them: wired into Accelerator(), prepare(), save_state and wait_for_everyone."""
    from ndparallel import Accelerator, PartialState

    rank = PartialState(cpu=True).process_index
    cases = {
        "config": lambda: Accelerator(cpu=True, parallelism_config=ParallelismConfig(
            dp_shard_size=2) if rank == 0 else ParallelismConfig(dp_replicate_size=2)),
    }
    out = outcomes(cases)
    accelerator = Accelerator(cpu=True)  # plain DDP over both ranks: the ranks agree
    model = build_model("llama", hidden_size=32 * (1 + rank))
    out.update(outcomes({
        "model": lambda: accelerator.prepare(model),
        "main_only_save": lambda: accelerator.save_state(f"{tmp}/ckpt") if accelerator.is_main_process else
        accelerator.wait_for_everyone(),
    }))
    return out


def test_the_accelerator_runs_the_checks(tmp_path):
    for out in run_ranks(_through_the_accelerator, 2, str(tmp_path), timeout=120):
        kind, message = out["config"]
        assert kind == "ValueError" and message.startswith("Accelerator(...): the ranks disagree on 2 setting(s)"), \
            message
        assert "parallelism.dp_replicate_size: rank 0: 1; rank 1: 2" in message, message
        kind, message = out["model"]
        assert kind == "ValueError" and message.startswith("prepare(): the ranks disagree"), message
        assert '[96, 32], "torch.float32"] vs rank 1 ["model.embed_tokens.weight", [96, 64]' in message, message
        kind, message = out["main_only_save"]
        assert kind == "CollectiveTimeoutError" and "('save_state' / 'wait_for_everyone')" in message, message
    assert not (tmp_path / "ckpt").exists()


def _kwargs_timeout() -> tuple[float, str, float]:
    import torch.distributed as dist

    from ndparallel import Accelerator, InitProcessGroupKwargs

    accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(
        seconds=1.5))])
    configured = accelerator.state.runtime.timeout.total_seconds()
    store = dist.distributed_c10d._get_default_store()
    started = time.perf_counter()
    if accelerator.process_index == 0:
        try:
            dist.barrier()
            return time.perf_counter() - started, "no error", configured
        except RuntimeError as exc:
            return time.perf_counter() - started, str(exc), configured
        finally:
            store.set("test/failed", "1")
    store.wait(["test/failed"], datetime.timedelta(seconds=50))  # out of the barrier until rank 0's has failed
    return 0.0, "", configured


@pytest.mark.slow
def test_init_process_group_kwargs_sets_the_collective_timeout():
    results = run_ranks(_kwargs_timeout, 2, timeout=60)
    seconds, message, configured = results[0]
    assert configured == results[1][2] == 1.5
    assert "Timed out waiting 1500ms" in message, message  # the timeout gloo was given
    assert 1.4 <= seconds < 30, (seconds, message)


GRACE = 30.0  # a grace period far longer than the test takes: waiting it out, or not, is unmistakable


def _mismatched_collectives(rank_1: str) -> tuple[tuple[str, str] | None, float]:
    """Rank 0 calls accelerator.reduce; rank 1 calls accelerator.gather (`rank_1` "gather") or is busy elsewhere
    ("busy") -- the gather/reduce under `if accelerator.is_main_process:` case."""
    import torch.distributed as dist

    from ndparallel import Accelerator, InitProcessGroupKwargs
    from ndparallel.distributed import failures

    accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(
        seconds=1.5))])
    store = dist.distributed_c10d._get_default_store()
    if rank_1 == "gather":  # both ranks report: neither waits the grace period, however long it is
        failures.grace_period = lambda timeout: GRACE
    accelerator.wait_for_everyone()
    started = time.perf_counter()
    if accelerator.process_index == 0:
        out = outcomes({"x": lambda: accelerator.reduce(torch.ones(2))})["x"]
        seconds = time.perf_counter() - started
        store.set("test/reported", "1")
        store.wait(["test/done"], datetime.timedelta(seconds=50))  # this rank hosts the store: wait for rank 1
        return out, seconds
    if rank_1 == "gather":
        time.sleep(0.5)  # rank 0's timer fires first: its message's time is its own timeout, not rank 1's
        out = outcomes({"x": lambda: accelerator.gather(torch.ones(1))})["x"]
    else:
        # Busy outside the library until rank 0 has reported (the store orders them; a fixed sleep raced rank 0's
        # timeout plus grace period on a loaded machine).
        store.wait(["test/reported"], datetime.timedelta(seconds=50))
        out = None
    seconds = time.perf_counter() - started
    store.set("test/done", "1")
    return out, seconds


def _failed_after(call: str, message: str, seconds: float) -> float:
    """The time the message says the collective failed after: at least the 1.5 s timeout (late is fine on a loaded
    machine) and no more than the rank measured around the call (it is a measurement, not the setting)."""
    found = re.match(rf"{call}: the collective over ranks 0-1 failed after (\d+\.\d) s \(RuntimeError: ", message)
    assert found, message
    assert 1.5 <= float(found[1]) <= seconds + 0.05, (float(found[1]), seconds, message)
    return float(found[1])


@pytest.mark.slow
def test_a_gather_and_a_reduce_that_do_not_meet_name_each_rank_and_its_call():
    (kind, message), seconds = (first := run_ranks(_mismatched_collectives, 2, "gather", timeout=60))[0]
    assert kind == "CollectiveTimeoutError", message
    _failed_after("reduce", message, seconds)
    # gloo's own words depend on which rank's timer fires first: its timeout, or the peer closing the pair.
    assert "Timed out" in message or "Connection closed by peer" in message, message
    assert "): rank 0 in 'reduce'; rank 1 in 'gather'.\n  rank 0 (" in message, message
    assert "): in 'reduce' (its collective call #1, for " in message and "): in 'gather' (its collective call #1, " \
        in message, message
    assert "\nThe ranks called different collectives: call gather / reduce in the same order on every rank" in message
    # Both ranks report, so neither waits out the grace period (30 s here): the wrong way would take 31.5 s.
    assert 1.5 <= seconds < 1.5 + GRACE / 3, "both ranks report at once: no grace period to wait for"
    (kind, message), _ = first[1]
    assert kind == "CollectiveTimeoutError" and message.startswith("gather: the collective over ranks 0-1 failed")
    assert "rank 0 in 'reduce'; rank 1 in 'gather'." in message, message


@pytest.mark.slow
def test_a_reduce_that_another_rank_skips_names_the_rank_that_did_not_report():
    (kind, message), seconds = run_ranks(_mismatched_collectives, 2, "busy", timeout=60)[0]
    assert kind == "CollectiveTimeoutError", message
    _failed_after("reduce", message, seconds)
    assert "): rank 0 in 'reduce'; rank 1 did not report.\n  rank 0 (" in message, message
    assert "): did not report being in a collective; last passed monitored call 'wait_for_everyone' (" in message
    assert "\nA rank that did not report is busy outside the library's collectives (raise the timeout" in message
    assert ("skipped this call (a collective call -- save_state, wait_for_everyone, gather / reduce -- under `if "
            "accelerator.is_main_process:`") in message
    # The timeout, then a grace period of max(1 s, timeout / 10) for rank 1's report: waited in full (it never comes),
    # and not the longest grace (30 s); late is fine.
    assert 1.5 + 1.0 <= seconds < 1.5 + 1.0 + 10, "the timeout, then a grace period of max(1 s, timeout / 10)"
