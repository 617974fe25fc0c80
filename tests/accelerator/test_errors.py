"""Bad inputs to the `Accelerator` and `prepare()`: each must fail at once with an error that says what was
wrong and how to fix it, on every rank (a rank that raises while another waits in a collective would hang).

`CASES` is the table: one row per bad input, its id naming that input. Anything that builds an Accelerator runs
in forked gloo ranks (tests/harness.py), never in the pytest process, which must keep torch.distributed
uninitialised for later forks. The rows of one group run one after another in a single forked run (a
module-scoped fixture): in the rank, each row's trigger runs inside its own ``pytest.raises(error, match=...)``
and the rank returns, per row, whether that held and the error's message; the parent then asserts on that
message again, for every rank.

Rows marked xfail(strict) are inputs the library does not yet reject clearly today; the reason says what
happens and what it should say instead. When the library is fixed they XPASS and fail, so the mark comes off
(none is marked now). Inputs that were once refused or mishandled and are now supported (a scheduler built on a
prepared optimizer, an optimizer prepared before its model, ``maybe_context_parallel`` under tp) have positive
tests at the end; random samplers other than ``shuffle=True`` are checked in tests/core/test_data.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from harness import run_ranks
from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig, TorchTensorParallelConfig
from tiny_models import build_model

# Forked runs, by group: the world size, and whether the rows need a process with no process group yet.
GROUPS = {"1 rank": 1, "2 ranks": 2, "no process group": 1}
ALREADY_PREPARED = r"is already prepared; pass each plain object to prepare\(\) once"
IGNORED_MODULES_USAGE = r"ignored_modules must be a regex over module names \(a str\) or an iterable of " \
                        r"nn\.Module objects"
INCOMPLETE_LAUNCH = r"not set; start the script with `ndparallel launch` \(or torchrun\), or set all of RANK, " \
                    r"WORLD_SIZE, MASTER_ADDR, MASTER_PORT"


@dataclass(frozen=True)
class Case:
    id: str                                   # the bad input
    trigger: Callable[[], Any]                # runs in the rank(s); must raise
    error: type[Exception] | tuple[type[Exception], ...]
    match: str                                # re.search'ed in the message: what was wrong / how to fix it
    group: str = "1 rank"
    xfail: str | None = None                  # what the library does today instead, and what it should say


# ---- triggers (they run in the forked ranks) ----------------------------------------------------------------
class _Numbers(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(8))


@contextlib.contextmanager
def _env(**changes: str | None) -> Iterator[None]:
    """Set (or, for None, delete) environment variables for the duration, then restore them."""
    def apply(values: dict[str, str | None]) -> None:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    saved = {k: os.environ.get(k) for k in changes}
    try:
        apply(changes)
        yield
    finally:
        apply(saved)


def _sizes(**sizes: int) -> Accelerator:
    return Accelerator(parallelism_config=ParallelismConfig(**sizes))


def _tp(plan: dict | None = None) -> Accelerator:
    return Accelerator(parallelism_config=ParallelismConfig(tp_size=2, tp_handler=TorchTensorParallelConfig(plan=plan)))


def _model_already_sharded() -> None:
    from torch.distributed.tensor import DTensor, Shard

    acc = _tp()
    model = build_model("llama")
    local = model.lm_head.weight.detach().chunk(2)[acc.tp_rank]
    model.lm_head.weight = nn.Parameter(DTensor.from_local(local, acc.mesh["tp"], [Shard(0)]))
    acc.prepare(model)


def _fsdp(**plugin: Any) -> Accelerator:
    return Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(**plugin))


def _launched_with(**env: str | None) -> Accelerator:
    with _env(**env):
        return Accelerator()


def _launched_without(*names: str) -> Accelerator:
    assert not dist.is_initialized(), "precondition: no process group before this Accelerator"
    return _launched_with(**dict.fromkeys(names))


def _same_object_prepared_twice(make: Callable[[], Any]) -> None:
    """prepare() a plain object, then prepare() that same plain object again (not what prepare() returned)."""
    acc, obj = Accelerator(), make()
    acc.prepare(obj)  # e.g. a model on one rank without a plugin: nothing wraps it, prepare() returns it itself
    acc.prepare(obj)


def _sgd() -> torch.optim.SGD:
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)


def _optimizer_twice_in_one_call() -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    Accelerator().prepare(model, optimizer, optimizer)


def _dataloader_twice_in_one_call() -> None:
    loader = DataLoader(list(range(8)), batch_size=2)
    Accelerator().prepare(loader, loader)


def _stepped_optimizer(acc: Accelerator) -> None:
    model = build_model("llama")
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.arange(8).unsqueeze(0)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # now it has exp_avg/exp_avg_sq state for parameters FSDP2 is about to replace
    acc.prepare(model, optimizer)


def _optimizer_stepped_before_its_model_is_prepared() -> None:
    """The optimizer is prepared first (allowed: prepare(model) remaps it), but it steps before the model is."""
    acc, model = _fsdp(cpu_offload=True), build_model("llama")  # (one rank: FSDP2 wraps for CPU offload)
    optimizer = acc.prepare(torch.optim.AdamW(model.parameters()))
    ids = torch.arange(8).unsqueeze(0)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # state for the parameters FSDP2 is about to replace
    acc.prepare(model)


def _scheduler_without_prepared_optimizer() -> None:
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    Accelerator().prepare(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))


def _loader(**kwargs: Any) -> Callable[[], None]:
    dataset = list(range(8))
    sampler = kwargs.pop("sampler", None)
    return lambda: Accelerator().prepare(DataLoader(dataset, sampler=sampler and sampler(dataset), **kwargs))


CASES: list[Case] = [
    # -- Accelerator(...) arguments and the environment variables standing in for them --
    Case("mixed_precision=fp4", lambda: Accelerator(mixed_precision="fp4"),
         ValueError, r"^mixed_precision must be one of \['no', 'bf16', 'fp16', 'fp8'\], got 'fp4'$"),
    Case("gradient_accumulation_steps=0", lambda: Accelerator(gradient_accumulation_steps=0),
         ValueError, r"^gradient_accumulation_steps must be an int >= 1, got 0$"),
    Case("gradient_accumulation_steps=1.5", lambda: Accelerator(gradient_accumulation_steps=1.5),
         TypeError, r"^gradient_accumulation_steps must be an int >= 1, got 1\.5$"),
    Case("gradient_accumulation_steps=True", lambda: Accelerator(gradient_accumulation_steps=True),
         TypeError, r"^gradient_accumulation_steps must be an int >= 1, got True$"),
    Case("parallelism_config=dict", lambda: Accelerator(parallelism_config={"dp_shard_size": 2}),
         TypeError, r"parallelism_config must be a ParallelismConfig, got dict"),
    Case("fsdp_plugin=str", lambda: Accelerator(fsdp_plugin="yes"),
         TypeError, r"fsdp_plugin must be a FullyShardedDataParallelPlugin, got str"),
    Case("env-NDPARALLEL_GRADIENT_ACCUMULATION_STEPS=two",
         lambda: _launched_with(NDPARALLEL_GRADIENT_ACCUMULATION_STEPS="two"),
         ValueError, r"^\$NDPARALLEL_GRADIENT_ACCUMULATION_STEPS must be an int >= 1, got 'two'$"),
    Case("env-NDPARALLEL_GRADIENT_ACCUMULATION_STEPS=0",
         lambda: _launched_with(NDPARALLEL_GRADIENT_ACCUMULATION_STEPS="0"),
         ValueError, r"^\$NDPARALLEL_GRADIENT_ACCUMULATION_STEPS must be an int >= 1, got 0$"),
    Case("env-NDPARALLEL_MIXED_PRECISION=fp4", lambda: _launched_with(NDPARALLEL_MIXED_PRECISION="fp4"),
         ValueError, r"^\$NDPARALLEL_MIXED_PRECISION must be one of \['no', 'bf16', 'fp16', 'fp8'\], got 'fp4'$"),
    # -- prepare(): the same object twice --
    Case("same-model-prepared-twice", lambda: _same_object_prepared_twice(lambda: nn.Linear(4, 4)),
         ValueError, rf"^prepare\(\): argument 0 \(a Linear\) {ALREADY_PREPARED}$"),
    Case("same-model-twice-in-one-call", lambda: Accelerator().prepare(*[nn.Linear(2, 2)] * 2),
         ValueError, rf"^prepare\(\): argument 1 \(a Linear\) {ALREADY_PREPARED}$"),
    Case("same-optimizer-prepared-twice", lambda: _same_object_prepared_twice(_sgd),
         ValueError, rf"^prepare\(\): argument 0 \(a SGD\) {ALREADY_PREPARED}$"),
    Case("same-optimizer-twice-in-one-call", _optimizer_twice_in_one_call,
         ValueError, rf"^prepare\(\): argument 2 \(a SGD\) {ALREADY_PREPARED}$"),
    Case("same-DataLoader-prepared-twice",
         lambda: _same_object_prepared_twice(lambda: DataLoader(list(range(8)), batch_size=2)),
         ValueError, rf"^prepare\(\): argument 0 \(a DataLoader\) {ALREADY_PREPARED}$"),
    Case("same-DataLoader-twice-in-one-call", _dataloader_twice_in_one_call,
         ValueError, rf"^prepare\(\): argument 1 \(a DataLoader\) {ALREADY_PREPARED}$"),
    # -- prepare(): data loaders it cannot shard --
    Case("DataLoader-with-DistributedSampler", _loader(batch_size=2, sampler=lambda d: DistributedSampler(d, 1, 0)),
         ValueError, r"already uses a DistributedSampler; pass a plain DataLoader -- prepare\(\) shards it"),
    Case("IterableDataset-DataLoader-batch_size=None",
         lambda: Accelerator().prepare(DataLoader(_Numbers(), batch_size=None)),
         ValueError, r"an iterable dataset's DataLoader needs a batch_size"),
    Case("IterableDataset-DataLoader-num_workers=2",
         lambda: Accelerator().prepare(DataLoader(_Numbers(), batch_size=2, num_workers=2)),
         ValueError, r"num_workers=2 with an iterable dataset: each worker would read the whole dataset .* use "
                     r"num_workers=0 or 1"),
    # -- prepare(): optimizers and schedulers --
    Case("scheduler-whose-optimizer-was-never-prepared", _scheduler_without_prepared_optimizer,
         ValueError, r"the LR scheduler's optimizer has not been prepared; pass the optimizer to prepare\(\) in the "
                     r"same call or before the scheduler"),
    # (one rank: FSDP2 wraps only for what it does there too, here CPU offload; tests/accelerator/test_accelerator_api.py)
    Case("optimizer-stepped-before-prepare-FSDP-offload-1-rank", lambda: _stepped_optimizer(_fsdp(cpu_offload=True)),
         ValueError, r"the optimizer already has state \(it stepped before prepare\).*build the optimizer, prepare it, "
                     r"then train"),
    Case("optimizer-prepared-and-stepped-before-its-model-FSDP", _optimizer_stepped_before_its_model_is_prepared,
         ValueError, r"^prepare\(\): the optimizer already has state \(it stepped before prepare\).*build the "
                     r"optimizer, prepare it, then train$"),
    # -- prepare(): FSDP plugin settings that do not fit the model --
    Case("transformer_cls_names_to_wrap=NoSuchBlock",
         lambda: _fsdp(transformer_cls_names_to_wrap=["NoSuchBlock"]).prepare(build_model("llama")),
         ValueError, r"transformer_cls_names_to_wrap: \['NoSuchBlock'\] not found in LlamaForCausalLM; its module "
                     r"classes are: \[.*'LlamaDecoderLayer'"),
    Case("ignored_modules-regex-matching-nothing",
         lambda: _fsdp(ignored_modules="no_such_module_regex_xyz").prepare(build_model("llama")),
         ValueError, r"ignored_modules regex 'no_such_module_regex_xyz' matches no module name of LlamaForCausalLM"),
    Case("ignored_modules-module-not-in-model",
         lambda: _fsdp(ignored_modules=[nn.Linear(2, 2)]).prepare(build_model("llama")),
         ValueError, r"ignored_modules: \['Linear'\] are not submodules of the model being prepared"),
    # (these two are refused when the plugin is built, before any Accelerator or prepare())
    Case("ignored_modules=42", lambda: FullyShardedDataParallelPlugin(ignored_modules=42),
         TypeError, rf"^{IGNORED_MODULES_USAGE}, got int 42$"),
    Case("ignored_modules=list-of-names",
         lambda: FullyShardedDataParallelPlugin(ignored_modules=[nn.Linear(2, 2), "lm_head", 3]),
         TypeError, rf"^{IGNORED_MODULES_USAGE}; these are not modules: \['lm_head', 3\] \(to select by name, pass "
                    r"one regex string\)$"),
    Case("activation_checkpointing-Sequential-without-block-classes",
         lambda: _fsdp(activation_checkpointing=True).prepare(nn.Sequential(nn.Linear(2, 2), nn.ReLU())),
         ValueError, r"activation_checkpointing needs block classes to checkpoint, and Sequential names none: set "
                     r"FullyShardedDataParallelPlugin\(transformer_cls_names_to_wrap=\[\.\.\.\]\)"),
    # -- collectives and the mesh --
    Case("reduce-avg", lambda: Accelerator().reduce(torch.ones(2), "avg"),
         ValueError, r"^reduction must be one of \['sum', 'mean', 'none', 'max'\], got 'avg'$"),
    Case("mesh[nope]", lambda: Accelerator().mesh["nope"],
         KeyError, r"no mesh view named 'nope'; valid names: pp, dp_replicate, dp_shard, cp, sp, tp, batch, fsdp, "
                   "loss"),
    Case("maybe_context_parallel-2-buffers-1-seq-dim",
         lambda: Accelerator().maybe_context_parallel(buffers=[torch.ones(1, 4), torch.ones(1, 4)],
                                                      buffer_seq_dims=[1]).__enter__(),
         ValueError, r"maybe_context_parallel: 2 buffers but 1 buffer_seq_dims"),
    Case("gather(set)", lambda: Accelerator().gather({1, 2}),
         TypeError, r"can only gather/reduce tensors and dicts/lists/tuples of tensors, got set"),
    Case("gather(str)", lambda: Accelerator().gather("abc"),
         TypeError, r"can only gather/reduce tensors and dicts/lists/tuples of tensors, got str"),
    Case("gather(list-of-ints)", lambda: Accelerator().gather([1, 2]),
         TypeError, r"can only gather/reduce tensors and dicts/lists/tuples of tensors, got int"),
    # -- two ranks: sizes that cannot be met, parallelisms not implemented yet, data that would be mis-sharded --
    Case("dp_shard_size=-1-tp_size=3-at-world-2", lambda: _sizes(dp_shard_size=-1, tp_size=3),
         ValueError, r"cannot fill dp_shard_size=-1: world size 2 is not divisible by tp\(3\) = 3", group="2 ranks"),
    # -- Ulysses sequence parallelism: heads and lengths it cannot split, refused before any collective --
    Case("sp_size=2-num_attention_heads=3", lambda: _sizes(sp_size=2).prepare(
        build_model("qwen2", hidden_size=24, num_attention_heads=3, num_key_value_heads=3)),
         ValueError, r"Qwen2ForCausalLM: sp_size=2 does not divide num_attention_heads=3: Ulysses gives each "
                     r"sequence-parallel rank whole attention heads .* sp sizes that work: \[1, 3\]", group="2 ranks"),
    Case("sp_size=2-seq-len-7", lambda: _sizes(sp_size=2).maybe_context_parallel(
        buffers=[torch.ones(1, 7)], buffer_seq_dims=[1]).__enter__(),
         ValueError, r"sequence length 7 does not split over cp_size=1 x sp_size=2: .* Pad or cut sequences to a "
                     r"multiple of 2", group="2 ranks"),
    Case("sp_size=2-no-buffers", lambda: _sizes(sp_size=2).maybe_context_parallel().__enter__(),
         ValueError, r"maybe_context_parallel\(\) with sp_size=2 needs the batch's sequence tensors", group="2 ranks"),
    # -- tensor parallelism: every check runs before the first collective of prepare() --
    Case("tp_size=2-num_key_value_heads=1", lambda: _sizes(tp_size=2).prepare(
        build_model("llama", num_attention_heads=4, num_key_value_heads=1)),
         ValueError, r"tp_size=2 does not divide num_key_value_heads=1 of LlamaForCausalLM: each tensor-parallel "
                     r"rank must hold whole heads; tp sizes that work: \[1\]", group="2 ranks"),
    Case("tp_size=2-num_attention_heads=3", lambda: _sizes(tp_size=2).prepare(
        build_model("qwen2", hidden_size=24, num_attention_heads=3, num_key_value_heads=3)),
         ValueError, r"tp_size=2 does not divide num_attention_heads=3 .* tp sizes that work: \[1, 3\]", group="2 ranks"),
    Case("tp_size=4-at-world-2", lambda: _sizes(tp_size=4),
         ValueError, r"tp\(4\) = 4 != world size 2", group="2 ranks"),
    Case("tp-plan-unknown-style", lambda: _tp(plan={"lm_head": "diagonal"}).prepare(build_model("llama")),
         ValueError, r"unknown tensor-parallel style 'diagonal' for 'lm_head'; known styles: \['colwise', ",
         group="2 ranks"),
    Case("tp-plan-pattern-matching-nothing", lambda: _tp().prepare(
        build_model("llama"), tp_plan={"layers.*.mlp.up": "colwise"}),
         ValueError, r"prepare\(tp_plan=...\): pattern 'layers.\*.mlp.up' matches no module of LlamaForCausalLM; "
                     r"nearest module names: \[.*'model.layers.\*.mlp.up_proj'", group="2 ranks"),
    Case("tp-plan-colwise-on-a-norm", lambda: _tp(plan={"model.norm": "colwise"}).prepare(build_model("llama")),
         ValueError, r"style 'colwise' applies to nn.Linear, transformers' Conv1D or nn.Embedding, but 'model.norm' "
                     r"is a LlamaRMSNorm",
         group="2 ranks"),
    Case("tp-plan-features-not-divisible", lambda: _tp(plan={"0": "colwise"}).prepare(nn.Sequential(nn.Linear(4, 3))),
         ValueError, r"splits 0.out_features=3 over tp_size=2, which does not divide it; tp sizes that work: \[1, 3\]",
         group="2 ranks"),
    Case("tp-plan-not-a-dict", lambda: _tp().prepare(build_model("llama"), tp_plan=["lm_head"]),
         TypeError, r"prepare\(tp_plan=...\): a tensor-parallel plan is a dict of pattern -> style, got list",
         group="2 ranks"),
    Case("tp-model-without-a-plan", lambda: _tp().prepare(nn.Sequential(nn.Linear(4, 4))),
         ValueError, r"Sequential has no tensor-parallel plan: .* pass one, e.g. ParallelismConfig\(tp_size=2, "
                     r"tp_handler=TorchTensorParallelConfig\(plan=", group="2 ranks"),
    Case("tp-model-already-sharded", _model_already_sharded,
         ValueError, r"parameter 'lm_head.weight' is already a DTensor on .*ndparallel applies tensor parallelism "
                     r"itself", group="2 ranks"),
    Case("optimizer-stepped-before-prepare-dp_shard_size=2", lambda: _stepped_optimizer(_sizes(dp_shard_size=2)),
         ValueError, r"the optimizer already has state \(it stepped before prepare\)", group="2 ranks"),
    Case("DataLoader-with-DistributedSampler-2-ranks", _loader(batch_size=2, sampler=DistributedSampler),
         ValueError, r"already uses a DistributedSampler; pass a plain DataLoader", group="2 ranks"),
    # -- the launch environment, before any process group exists --
    *[Case(f"RANK-set-{'-and-'.join(names)}-unset", lambda names=names: _launched_without(*names),
           RuntimeError, rf"incomplete launch environment: {', '.join(names)} {INCOMPLETE_LAUNCH}",
           group="no process group")
      for names in [("MASTER_ADDR", "MASTER_PORT"), ("MASTER_ADDR",), ("MASTER_PORT",)]],
    Case("WORLD_SIZE-set-RANK-unset", lambda: _launched_without("RANK"),
         RuntimeError, rf"incomplete launch environment: RANK {INCOMPLETE_LAUNCH}", group="no process group"),
]


def _run_cases(ids: list[str]) -> dict[str, tuple[bool, str]]:
    """In a rank: each row under its own pytest.raises -> (held, the message or the traceback of what went wrong)."""
    by_id = {case.id: case for case in CASES}
    out: dict[str, tuple[bool, str]] = {}
    for case_id in ids:
        case = by_id[case_id]
        try:
            with pytest.raises(case.error, match=case.match) as info:
                case.trigger()
            out[case_id] = (True, str(info.value))
        except BaseException:  # noqa: BLE001 - DID NOT RAISE, no match, or another error: report it, keep going
            out[case_id] = (False, traceback.format_exc())
    return out


# ---- tests (the pytest process: no Accelerator here) -------------------------------------------------------
@pytest.fixture(autouse=True)
def _parent_stays_uninitialised() -> Iterator[None]:
    yield
    assert not dist.is_initialized(), "a test initialised torch.distributed in the pytest process"


@pytest.fixture(scope="module")
def outcomes() -> Callable[[str], list[dict[str, tuple[bool, str]]]]:
    """Each group's rows run once, in one forked run; per rank, row id -> (held, message)."""
    cache: dict[str, list[dict[str, tuple[bool, str]]]] = {}

    def get(group: str) -> list[dict[str, tuple[bool, str]]]:
        if group not in cache:
            ids = [case.id for case in CASES if case.group == group]
            cache[group] = run_ranks(_run_cases, GROUPS[group], ids, timeout=120)
        return cache[group]

    return get


def _param(case: Case):
    marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
    return pytest.param(case, id=case.id, marks=marks)


def test_case_ids_are_unique():
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("case", [_param(case) for case in CASES])
def test_bad_input_raises_clear_error(case: Case, outcomes) -> None:
    per_rank = outcomes(case.group)
    assert len(per_rank) == GROUPS[case.group]
    for rank, results in enumerate(per_rank):
        held, message = results[case.id]
        assert held, f"rank {rank}: {message}"
        assert re.search(case.match, message), f"rank {rank}: {message!r}"


def _mismatched_world() -> list[str]:
    messages = []
    for sizes, formula in [({"dp_shard_size": 4}, r"dp_shard\(4\) = 4"),
                           ({"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2},
                            r"dp_replicate\(2\) \* dp_shard\(2\) \* tp\(2\) = 8")]:
        with pytest.raises(ValueError, match=rf"^{formula} != world size 2\.") as info:
            _sizes(**sizes)
        messages.append(str(info.value))
    return messages


def test_world_size_mismatch_raises_on_every_rank() -> None:
    """ParallelismConfig(dp_shard_size=4) at world size 2: both ranks raise (none waits in a collective)."""
    per_rank = run_ranks(_mismatched_world, 2, timeout=60)
    assert len(per_rank) == 2
    for messages in per_rank:
        assert re.search(r"^dp_shard\(4\) = 4 != world size 2\. Set one size to -1 to give it the ranks that are "
                         r"left, or launch with 4 processes in all\.$", messages[0])
        assert re.search(r"^dp_replicate\(2\) \* dp_shard\(2\) \* tp\(2\) = 8 != world size 2\..*launch with 8 "
                         r"processes", messages[1])


# ---- inputs that were once refused or mishandled, and are accepted now ----------------------------------------
def _scheduler_on_prepared_optimizer() -> dict[str, Any]:
    import warnings

    acc = Accelerator()
    model = acc.prepare(nn.Linear(2, 2))
    optimizer = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    # built on what prepare() returned (the AcceleratedOptimizer), as Accelerate scripts often do
    scheduler = acc.prepare(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step))
    lrs = [scheduler.get_last_lr()[0]]
    before = model.weight.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            lrs.append(scheduler.get_last_lr()[0])
    return {"type": type(scheduler).__name__, "lrs": lrs, "group_lr": optimizer.param_groups[0]["lr"],
            "model_changed": not torch.equal(before, model.weight.detach()),
            "warnings": [str(w.message) for w in caught]}


def test_scheduler_built_on_prepared_optimizer_is_accepted() -> None:
    """Not a bad input: the error for an unprepared optimizer must not fire for a prepared one, and the scheduler
    built on the prepared optimizer drives its learning rate."""
    (out,) = run_ranks(_scheduler_on_prepared_optimizer, 1)
    assert out["type"] == "AcceleratedScheduler"
    assert out["lrs"] == pytest.approx([0.1, 0.05, 0.025])
    assert out["group_lr"] == pytest.approx(0.025)
    assert out["model_changed"]
    assert not [w for w in out["warnings"] if "lr_scheduler" in w], out["warnings"]


def _optimizer_prepared_before_its_model() -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    acc, model = _fsdp(cpu_offload=True), build_model("llama")  # (one rank: FSDP2 wraps for CPU offload)
    original = {id(p) for p in model.parameters()}
    optimizer = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    model = acc.prepare(model)  # FSDP2 replaces every parameter: the optimizer prepared above must follow
    params = [p for group in optimizer.param_groups for p in group["params"]]
    current = {id(p) for p in model.parameters()}
    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    ids = torch.arange(8).unsqueeze(0)
    acc.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    after = [p.detach().full_tensor() for p in model.parameters()]
    return {
        "model": len(current), "optimizer": len(params), "distinct": len({id(p) for p in params}),
        "in_model": sum(id(p) in current for p in params), "stale": sum(id(p) in original for p in params),
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "changed": sum(not torch.equal(a, b) for a, b in zip(before, after)),
    }


def test_optimizer_prepared_before_its_model_follows_the_sharded_parameters() -> None:
    """`opt = prepare(opt); model = prepare(model)` under FSDP2: prepare(model) remaps the earlier optimizer."""
    (out,) = run_ranks(_optimizer_prepared_before_its_model, 1)
    assert out["sharded"] and out["model"] > 0  # FSDP2 did replace the parameters, so the remap mattered
    assert out["optimizer"] == out["distinct"] == out["in_model"] == out["model"], out
    assert out["stale"] == 0, out
    assert out["changed"] == out["model"], out  # one step moves every parameter of the model


def _maybe_context_parallel_under_tp() -> list[list[float]]:
    acc = _sizes(tp_size=2)
    buffer = torch.arange(4.0).reshape(1, 4)
    with acc.maybe_context_parallel(buffers=[buffer], buffer_seq_dims=[1]):
        return buffer.tolist()


def test_maybe_context_parallel_is_a_no_op_under_tp() -> None:
    """Tensor parallelism shards no sequence: under tp_size=2 maybe_context_parallel() leaves the buffers whole."""
    assert run_ranks(_maybe_context_parallel_under_tp, 2, timeout=60) == [[[0.0, 1.0, 2.0, 3.0]]] * 2
