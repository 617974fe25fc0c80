"""One `parallelize` resolves its model once (issue 53, item 2): the PEFT wrapper is peeled once (`adapted.adapter_free`
runs once) and, under tensor parallelism, the plan is resolved once (`tensor.plans.plan_styles` and `resolve_plan` run
once), and the transformer block classes are found once (`blocks.block_classes`) for FSDP2's wrap, activation
checkpointing and the tiled MLP, the checks and the applies reading the same `ndparallel.parallel.target.Target`.

Counted in forked ranks (2, gloo) by wrapping each function where every module of the package bound it, around one
`parallelize` call, on a PEFT LoRA model and a plain one, under TP 2, FSDP2 2, CP 2 and pipeline stages 2.
"""

from __future__ import annotations

import sys

import pytest

import lora_run
from harness import run_ranks

COUNTED = ("adapter_free", "plan_styles", "resolve_plan", "block_classes", "under_layers")


def count_calls(sizes: dict[str, int], peft: bool, model_name: str = "llama") -> dict[str, int]:
    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, MemoryKwargs, ParallelismConfig
    import ndparallel.parallel as parallel
    from tiny_models import build_model

    counts = dict.fromkeys(COUNTED, 0)

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    originals = {}
    for module in [m for n, m in list(sys.modules.items()) if n.startswith("ndparallel") and m is not None]:
        for name in COUNTED:
            fn = getattr(module, name, None)
            if callable(fn) and getattr(fn, "__module__", "").startswith("ndparallel"):
                originals.setdefault(name, fn)
                setattr(module, name, counting(name, originals[name]))
    during = dict.fromkeys(COUNTED, 0)
    parallelize = parallel.parallelize

    def counted_parallelize(*args, **kwargs):
        before = dict(counts)
        try:
            return parallelize(*args, **kwargs)
        finally:
            for name in COUNTED:
                during[name] += counts[name] - before[name]

    parallel.parallelize = counted_parallelize
    acc = Accelerator(parallelism_config=ParallelismConfig(**{f"{k}_size": v for k, v in sizes.items()}),
                      fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing=True),
                      kwargs_handlers=[MemoryKwargs(tiled_mlp=model_name == "llama")])  # MoE MLPs stay untiled
    model = lora_run.lora_model(model_name) if peft else build_model(model_name)
    acc.prepare(model)
    return during


@pytest.mark.parametrize("peft", [True, False], ids=["peft_lora", "plain"])
@pytest.mark.parametrize("sizes", [{"tp": 2}, {"dp_shard": 2}, {"cp": 2}, {"pp": 2}],
                         ids=["tp2", "fsdp2", "cp2", "pp2"])
def test_one_parallelize_peels_the_adapter_and_resolves_the_plan_once(sizes, peft):
    for counts in run_ranks(count_calls, 2, sizes, peft, timeout=300):
        assert counts["adapter_free"] == counts["block_classes"] == 1, counts
        tp = sizes.get("tp", 1) > 1
        assert counts["plan_styles"] == counts["resolve_plan"] == (1 if tp else 0), counts


def test_one_parallelize_finds_the_experts_and_routers_once():
    """A mixture of experts under expert parallelism: its experts modules and routers are found once (one search by
    each name of the family table), for the check and the split alike."""
    for counts in run_ranks(count_calls, 2, {"dp_shard": 2, "ep": 2}, False, "qwen3_moe", timeout=300):
        assert counts["under_layers"] == 2 and counts["adapter_free"] == 1, counts
