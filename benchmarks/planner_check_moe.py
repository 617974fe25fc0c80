"""The planner's mixture-of-experts predictions next to what the library measures, layout by layout (docs/planner.md).

    python benchmarks/planner_check_moe.py [--hidden 64 --layers 3 --experts 4 --top-k 2 --seq 32 --batch 2]

A Qwen3-MoE with one dense layer (``mlp_only_layers=[0]``) and sparse ones, built from a config, runs each case of
`CASES` on forked gloo ranks (ndparallel.test_utils.run_ranks) through `planner_check.measure`: the library with an FSDP2 plugin and
``ep_size``, one warm-up optimizer step, then one counted step -- the bytes and calls of every collective, the model
states per rank just before zero_grad, the bytes saved for backward in the first micro-step. The planner predicts
the same from the model's config (`ndparallel.planner.footprint.estimate`, `ndparallel.planner.comm.transfers`, with
ep); the table shows both. The all-to-alls' bytes and the saved activations depend on the routing (a rank receives
what the others' tokens choose), so the measured figure is the mean over the ranks -- which for the all-to-alls'
payload is the planner's figure exactly (every rank sends its own tokens' pairs, and returns what it received).
tests/planner/test_planner_moe.py asserts them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402, F401  (imported before forking)

from common import qwen3_moe_config  # noqa: E402
from ndparallel.planner import Layout, Recipe, spec_from_config  # noqa: E402
from ndparallel.planner.comm import transfers  # noqa: E402
from ndparallel.planner.footprint import estimate  # noqa: E402
from ndparallel.test_utils import run_ranks  # noqa: E402
from planner_check import TABLE_HEADER, measure, table_row  # noqa: E402

# (name, layout, ep, mixed precision, accumulation steps, activation checkpointing): the experts inside the
# layers' FSDP2 units (no ep); ep over every fsdp rank (expert_shard 1: nothing gathered); ep 2 with the experts
# sharded over 2 more ranks (their own FSDP2 unit); HSDP with ep in bf16 over 2 micro-steps; ep with tp (experts whole
# on each tp rank, attention split); ep with cp (ep taken from the cp ranks); ep with activation checkpointing (the
# all-to-alls run again in backward).
CASES = [
    ("fsdp2", Layout(dp_shard=2), 1, "no", 1, False),
    ("ep2", Layout(dp_shard=2), 2, "no", 1, False),
    ("ep2_shard2", Layout(dp_shard=4), 2, "no", 1, False),
    ("hsdp_ep2", Layout(dp_replicate=2, dp_shard=2), 2, "bf16", 2, False),
    ("tp2_ep2", Layout(dp_shard=2, tp=2), 2, "no", 1, False),
    ("cp2_ep2", Layout(cp=2), 2, "no", 1, False),
    ("ep2_ac", Layout(dp_shard=2), 2, "no", 1, True),
]
CASE_NAMES = [case[0] for case in CASES]


def moe_config(args: SimpleNamespace):
    return qwen3_moe_config(vocab=args.vocab, hidden=args.hidden, layers=args.layers, intermediate=args.hidden * 3 // 2,
                            moe_intermediate=args.hidden // 2, experts=args.experts, top_k=args.top_k,
                            max_positions=max(args.seq, 128), mlp_only_layers=[0])


def build_moe(args: SimpleNamespace):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(moe_config(args))


def predict(args: SimpleNamespace, case: tuple):
    """(memory terms, transfers) the planner predicts for one case on one rank."""
    _, w, ep, precision, accumulation, checkpointing = case
    spec = spec_from_config(moe_config(args).to_dict(), "tiny-moe")
    layout = Layout(dp_replicate=w.dp_replicate, dp_shard=w.dp_shard, cp=w.cp, sp=w.sp, tp=w.tp, ep=ep)
    recipe = Recipe(args.seq, args.batch, accumulation, "bf16" if precision == "bf16" else "fp32", checkpointing)
    return estimate(spec, layout, recipe), transfers(spec, layout, recipe, gpus_per_node=8)


def run_case(args: SimpleNamespace, case: tuple) -> list[dict]:
    _, w, ep, precision, accumulation, checkpointing = case
    return run_ranks(measure, w.world, w, args, precision, accumulation, checkpointing, (True, False, False), ep,
                     build_moe)


DEFAULTS = {"hidden": 64, "layers": 3, "vocab": 258, "seq": 32, "batch": 2, "experts": 4, "top_k": 2}


def options(**given) -> SimpleNamespace:
    """The sizes (DEFAULTS, overridden by `given`) and the fields `workloads` reads."""
    return SimpleNamespace(**{**DEFAULTS, **given}, warmup=1, steps=1, repeats=1, cpu=True, tile=None)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in DEFAULTS.items():
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=default)
    args = options(**vars(p.parse_args(argv)))
    print(f"Qwen3-MoE: hidden {args.hidden}, {args.layers} layers (one dense), {args.experts} experts, top-"
          f"{args.top_k}; {args.batch} x {args.seq} tokens per data-parallel rank\n")
    print(TABLE_HEADER)
    for case in CASES:
        name = f"{case[0]} {'bf16' if case[3] == 'bf16' else 'fp32'} x{case[4]}{' AC' if case[5] else ''}"
        print(table_row(name, run_case(args, case), *predict(args, case), checkpointed=case[5]), flush=True)


if __name__ == "__main__":
    main()
