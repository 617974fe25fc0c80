"""Multi-process test harness: `run_ranks` forks N gloo ranks from this (warm) process and collects their results
(it lives in ndparallel.test_utils.ranks, which the benchmarks use too); `outcomes` and `assert_refused` compare
what each rank raised with an expected table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ndparallel.test_utils.ranks import free_port, run_ranks

__all__ = ["assert_refused", "free_port", "outcomes", "run_ranks"]


def outcomes(cases: dict[str, Callable[[], Any]]) -> dict[str, tuple[str, str]]:
    """Run each trigger in order (inside a rank); record ``(exception type name, message)`` or ``("no error", "")``.

    The parent compares them with an expected table through `assert_refused`, on every rank.
    """
    out = {}
    for name, trigger in cases.items():
        try:
            trigger()
            out[name] = ("no error", "")
        except Exception as exc:  # noqa: BLE001 - the parent checks type and message
            out[name] = (type(exc).__name__, str(exc))
    return out


def assert_refused(per_rank: list[dict[str, tuple[str, str]]], expected: tuple[str, str], case: str) -> None:
    """Every rank's outcome of `case` has the expected exception type and a message matching the pattern."""
    import re

    error, pattern = expected
    for rank, out in enumerate(per_rank):
        assert out[case][0] == error and re.search(pattern, out[case][1]), (rank, out[case])
