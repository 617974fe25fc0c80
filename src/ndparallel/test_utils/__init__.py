"""Helpers that the tests and the benchmarks both use (as Accelerate's ``accelerate.test_utils``): no part of the
training API, and nothing in the library imports them.

- `ranks`: `run_ranks` forks N ranks (torchrun's environment, gloo on CPU) from this warm process;
- `memory`: what autograd keeps for backward (`kept_bytes`) and the bytes alive at a peak (`LiveBytes`, the least of
  a few runs by `least_of`);
- `collectives`: the group size of a dispatched collective op, for counters of what a step sends.
"""

from ndparallel.test_utils.ranks import free_port, run_ranks

__all__ = ["free_port", "run_ranks"]
