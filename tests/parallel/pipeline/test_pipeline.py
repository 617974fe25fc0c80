"""Pipeline parallelism (pp_size): stage plans, refusals, and every layout against the single-process oracle
(checkpoints and saved weights: test_pipeline_checkpoints.py).

The oracle is tests/reference.py (one process, the model's own mean loss over the global batch, torch's clipping).
The script under test is the Accelerate-style loop of tests/scripts/accelerate_style.py, unchanged: under pp the
prepared model runs the schedule (forward and backward) in its call and `accelerator.backward` has nothing left to do.
Tolerances as in test_parity.py: per-step losses within 1e-5 (fp32, 6 AdamW steps, clipping at 1.0), SGD-trained
parameters within 1e-6.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from torch import nn

import accelerate_style
from harness import assert_refused, outcomes, run_ranks
from ndparallel.configuration.handlers import PipelineParallelConfig
from ndparallel.parallel.pipeline import StageLayers, cut_to_rank
from ndparallel.parallel.pipeline.runner import SPLIT_BACKWARD_TORCH, check_schedule
from ndparallel.parallel.pipeline.split import _balanced, plan_stages
from reference import reference_run
from tiny_models import VOCAB, build_model

GLOBAL_BATCH = 8
LAYERS = 4
# torch below 2.13 refuses the zero-bubble schedules (`runner.SPLIT_BACKWARD_TORCH`)
OLD_TORCH = torch.torch_version.TorchVersion(torch.__version__) < SPLIT_BACKWARD_TORCH


# ---- tier 1: plans and refusals, no processes ---------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(schedule="pipedream"), r"unknown pipeline schedule 'pipedream'; use one of \['gpipe', '1f1b'"),
    (dict(schedule="1f1b", stages_per_rank=2), r"schedule '1f1b' runs 1 stage\(s\) per rank, got stages_per_rank=2"),
    (dict(schedule="zbv", stages_per_rank=3), r"schedule 'zbv' runs 2 stage\(s\) per rank"),
    (dict(schedule="interleaved_1f1b", stages_per_rank=1), r"runs 2 or more stage\(s\) per rank"),
    (dict(microbatches=0), r"microbatches must be an int >= 1"),
    (dict(split=[1, "layers.2"]), r"split must be a list of layer indices or a list of module names"),
    (dict(loss_fn=3), r"loss_fn must be callable"),
])
def test_bad_pipeline_settings_are_refused(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        PipelineParallelConfig(**kwargs)


def test_interleaved_schedules_default_to_two_stages_per_rank():
    assert PipelineParallelConfig().stages_per_rank == 1
    assert PipelineParallelConfig(schedule="interleaved_1f1b").stages_per_rank == 2
    assert PipelineParallelConfig(schedule="zbv").stages_per_rank == 2


def test_balanced_split_is_the_best_contiguous_split():
    """Against brute force over every contiguous split: the heaviest stage is as light as it can be."""
    gen = torch.Generator().manual_seed(0)
    for n, k in [(4, 2), (6, 3), (8, 4), (7, 2), (9, 3)]:
        weights = torch.randint(1, 100, (n,), generator=gen).tolist()
        starts = _balanced(weights, k)
        assert starts[0] == 0 and len(starts) == k and starts == sorted(set(starts))

        def heaviest(s: list[int]) -> int:
            bounds = [*s, n]
            return max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = min(heaviest([0, *c]) for c in itertools.combinations(range(1, n), k - 1))
        assert heaviest(starts) == best


def test_a_decoder_splits_by_layers_with_embedding_first_and_head_last():
    model = build_model("llama", num_hidden_layers=LAYERS)
    plan = plan_stages(model, 2, PipelineParallelConfig())
    assert plan.kind == "decoder" and plan.units == ("0", "1", "2", "3") and plan.starts == (0, 2)
    assert plan.describe() == "stage 0 (rank 0): layers 0..1; stage 1 (rank 1): layers 2..3"
    plan = plan_stages(model, 2, PipelineParallelConfig(split=[3]))
    assert plan.starts == (0, 3)
    # interleaved: stage s on rank s % pp; V-shaped (zbv): 0 1 | 1 0
    plan = plan_stages(model, 2, PipelineParallelConfig(schedule="interleaved_1f1b"))
    assert [plan.rank_of(s) for s in range(4)] == [0, 1, 0, 1] and plan.stages_of(0) == [0, 2]
    plan = plan_stages(model, 2, PipelineParallelConfig(schedule="zbv"))
    assert [plan.rank_of(s) for s in range(4)] == [0, 1, 1, 0] and plan.stages_of(0) == [0, 3]


def test_cutting_keeps_only_this_ranks_stages_under_their_own_names():
    model = build_model("llama", num_hidden_layers=LAYERS)
    names = set(dict(model.named_parameters()))
    plan = plan_stages(model, 2, PipelineParallelConfig(schedule="zbv"))  # rank 1 holds stages 1 and 2: 1, 2
    cut = cut_to_rank(model, plan, 1)
    kept = set(dict(cut.named_parameters()))
    assert kept < names and isinstance(cut.model.layers, StageLayers)
    assert {n.split(".")[2] for n in kept} == {"1", "2"}  # model.layers.<i>...
    assert cut.model.embed_tokens is None and cut.lm_head is None and cut.model.norm is None
    assert [type(m).__name__ for m in cut.model.layers[:10]] == ["LlamaDecoderLayer"] * 2


@pytest.mark.parametrize("split,match", [
    ([2, 2], r"split=\[2, 2\] gives 3 stages; the pipeline has 2"),
    ([0], r"split=\[0\] leaves a stage empty or goes backwards"),
    ([7], r"split entry 7 is not a layer index of the model; valid: 0..3"),
])
def test_bad_splits_are_refused(split, match):
    with pytest.raises(ValueError, match=match):
        plan_stages(build_model("llama", num_hidden_layers=LAYERS), 2, PipelineParallelConfig(split=split))


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match=r"pp_size=4 x stages_per_rank=2 = 8 stages, but LlamaForCausalLM has only 4 "
                                         r"decoder layers: every stage needs at least one; use at most 4 stages"):
        plan_stages(build_model("llama", num_hidden_layers=LAYERS), 4, PipelineParallelConfig(
            schedule="interleaved_1f1b"))


@pytest.mark.parametrize("name,overrides,match", [
    ("gpt2", {}, r"GPT2LMHeadModel cannot be split into pipeline stages: ndparallel splits Hugging Face causal LMs"),
    ("plain", {}, r"PlainTransformer cannot be split into pipeline stages: .* nn.Sequential"),
])
def test_models_a_pipeline_cannot_run_exactly_are_refused(name, overrides, match):
    with pytest.raises(ValueError, match=match):
        plan_stages(build_model(name, **overrides), 2, PipelineParallelConfig())


def test_a_mixture_of_experts_whose_routers_the_family_table_does_not_know_is_refused_with_its_balancing_loss():
    """The stages add the load-balancing term from the routers the family table names (tests/parallel/experts cover
    the families it knows); FlexOlmo is not among them. Without the term it splits."""
    import transformers

    from tiny_models import _SMALL

    def flex_olmo(aux: bool):
        config = transformers.FlexOlmoConfig(**dict(_SMALL, num_experts=4, pad_token_id=0, output_router_logits=aux))
        return transformers.FlexOlmoForCausalLM(config)
    with pytest.raises(ValueError, match=r"FlexOlmoForCausalLM is a mixture of experts \(num_experts=4\) whose loss "
                                         r"adds a load-balancing term .* does not know its routers \(model_type "
                                         r"'flex_olmo'\); set config.output_router_logits=False"):
        plan_stages(flex_olmo(True), 2, PipelineParallelConfig())
    plan_stages(flex_olmo(False), 2, PipelineParallelConfig())


def test_schedules_needing_more_microbatches_are_refused():
    plan = plan_stages(build_model("llama", num_hidden_layers=LAYERS), 4, PipelineParallelConfig())
    with pytest.raises(ValueError, match=r"schedule '1f1b' needs at least as many micro-batches as stages: "
                                         r"microbatches=2 < 4 stages"):
        check_schedule(PipelineParallelConfig(microbatches=2), plan)
    check_schedule(PipelineParallelConfig(schedule="gpipe", microbatches=2), plan)  # GPipe takes any count


@pytest.mark.skipif(not OLD_TORCH, reason=f"torch {torch.__version__} runs the zero-bubble schedules")
@pytest.mark.parametrize("schedule", ["zero_bubble", "zbv"])
def test_zero_bubble_schedules_are_refused_below_torch_2_13(schedule):
    plan = plan_stages(build_model("llama", num_hidden_layers=LAYERS), 2, PipelineParallelConfig(schedule=schedule))
    with pytest.raises(ValueError, match=rf"schedule '{schedule}' needs torch >= 2\.13 \(installed: torch "
                                         rf"{re.escape(torch.__version__)}\): older torch's split backward fails"):
        check_schedule(PipelineParallelConfig(schedule=schedule, microbatches=4), plan)


def test_a_config_file_carries_pp_size_and_says_its_pp_handler_stays_in_the_script(tmp_path):
    from ndparallel.launch.launcher import read_config_file

    path = tmp_path / "pp.yaml"
    path.write_text("parallelism:\n  pp_size: 2\n  dp_shard_size: 2\n  pp_handler: {schedule: gpipe}\n")
    translated = read_config_file(path)
    assert translated.sizes == {"pp_size": 2, "dp_shard_size": 2}
    assert translated.warnings == [f"config file '{path}': parallelism.pp_handler is not passed to the script (only "
                                   "sizes are); build it in the script's ParallelismConfig"]
    path.write_text("parallelism:\n  pp_size: 2\n  pp_handler: {schedule: pipedream}\n")
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'pipedream'"):
        read_config_file(path)


# ---- against the oracle --------------------------------------------------------------------------------------------
_references: dict[tuple, dict] = {}


def reference(model: str = "llama", **kwargs) -> dict:
    key = (model, tuple(sorted(kwargs.items())))
    if key not in _references:
        _references[key] = reference_run(model, global_batch=GLOBAL_BATCH, layers=LAYERS, **kwargs)
    return _references[key]


def run(world: int, flags: list[str], accum: int = 1, model: str = "llama", *extra: str) -> list[dict]:
    data = 1
    for axis in ("--dp-replicate-size", "--dp-shard-size"):
        if axis in flags:
            data *= int(flags[flags.index(axis) + 1])
    argv = ["--model", model, "--layers", str(LAYERS), "--micro-batch", str(GLOBAL_BATCH // (data * accum)),
            "--accum", str(accum), *flags, *extra]
    return run_ranks(accelerate_style.main, world, argv)


def assert_losses_match(results: list[dict], ref: dict, what: str) -> None:
    for rank, res in enumerate(results):
        assert len(res["losses"]) == len(ref["losses"]) == 6
        diff = max(abs(a - b) for a, b in zip(res["losses"], ref["losses"]))
        assert diff <= 1e-5, f"{what} rank {rank}: per-step losses differ by {diff:.2e}"
        assert res["lr"] == pytest.approx(ref["lr"])


LAYOUTS = [
    ("pp2", 2, ["--pp-size", "2"], 1),
    ("pp2_gpipe", 2, ["--pp-size", "2", "--pp-schedule", "gpipe"], 1),
    ("pp4", 4, ["--pp-size", "4"], 1),
    ("pp2_fsdp2", 4, ["--pp-size", "2", "--dp-shard-size", "2"], 1),
    ("pp2_ddp2", 4, ["--pp-size", "2", "--dp-replicate-size", "2", "--no-fsdp-plugin"], 1),
    ("pp2_tp2", 4, ["--pp-size", "2", "--tp-size", "2"], 1),
    ("pp2_interleaved_1f1b", 2, ["--pp-size", "2", "--pp-schedule", "interleaved_1f1b"], 1),
    ("pp2_zero_bubble", 2, ["--pp-size", "2", "--pp-schedule", "zero_bubble"], 1),
    ("pp2_zbv", 2, ["--pp-size", "2", "--pp-schedule", "zbv"], 1),
    ("pp2_accum2", 2, ["--pp-size", "2"], 2),
    ("pp2_8_microbatches", 2, ["--pp-size", "2", "--pp-microbatches", "8"], 1),
    ("pp2_cp2", 4, ["--pp-size", "2", "--cp-size", "2"], 1),
    ("pp2_cp2_ring", 4, ["--pp-size", "2", "--cp-size", "2", "--cp-strategy", "ring"], 1),
    ("pp2_sp2", 4, ["--pp-size", "2", "--sp-size", "2"], 1),
    ("pp2_activation_checkpointing", 2, ["--pp-size", "2", "--activation-checkpointing"], 1),
    ("pp2_fsdp2_interleaved_1f1b", 4, ["--pp-size", "2", "--dp-shard-size", "2", "--pp-schedule", "interleaved_1f1b"],
     1),
    ("pp2_ddp2_zbv", 4, ["--pp-size", "2", "--dp-replicate-size", "2", "--pp-schedule", "zbv"], 1),
    ("pp2_tp2_zero_bubble", 4, ["--pp-size", "2", "--tp-size", "2", "--pp-schedule", "zero_bubble"], 1),
    ("pp2_fsdp2_activation_checkpointing", 4, ["--pp-size", "2", "--dp-shard-size", "2", "--activation-checkpointing"],
     1),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,world,flags,accum", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_pipeline_layouts_match_single_process(name, world, flags, accum):
    if OLD_TORCH and ("zero_bubble" in flags or "zbv" in flags):
        pytest.skip(f"torch {torch.__version__} refuses the zero-bubble schedules "
                    "(test_zero_bubble_schedules_are_refused_below_torch_2_13)")
    assert_losses_match(run(world, flags, accum), reference(), name)


def test_the_launchers_pp_size_reaches_a_script_that_leaves_it_unset():
    """`ndparallel launch --pp-size 2` exports NDPARALLEL_PP_SIZE; a script building ParallelismConfig() without
    pp_size gets its pipeline from it."""
    argv = ["--model", "llama", "--layers", str(LAYERS), "--micro-batch", str(GLOBAL_BATCH)]
    results = run_ranks(accelerate_style.main, 2, argv, env={"NDPARALLEL_PP_SIZE": "2"})
    assert_losses_match(results, reference(), "pp2 from the environment")


@pytest.mark.slow
@pytest.mark.parametrize("world,micro,flags", [
    (2, 8, ["--pp-size", "2"]),
    (4, 2, ["--pp-size", "2", "--dp-shard-size", "2", "--accum", "2"]),
    (4, 8, ["--pp-size", "2", "--cp-size", "2"]),
    (2, 8, ["--pp-size", "2", "--pp-schedule", "interleaved_1f1b"]),
    (4, 8, ["--pp-size", "2", "--tp-size", "2"]),
], ids=["pp2", "pp2_fsdp2_accum2", "pp2_cp2", "pp2_interleaved", "pp2_tp2"])
def test_a_tied_embedding_and_head_train_as_one_weight_across_stages(world, micro, flags):
    """The embedding's copy on the first stage and the head's on the last get the sum of both gradients (once per
    optimizer step, after accumulation) and count once in the clipped norm: the single-process losses. Under tp both
    copies are split over the vocabulary, as the whole model's plan splits the tied weight."""
    argv = ["--model", "llama_tied", "--layers", str(LAYERS), "--micro-batch", str(micro), *flags]
    assert_losses_match(run_ranks(accelerate_style.main, world, argv), reference("llama_tied"), "tied " + str(flags))


def _without_tied_sum(argv: list[str]) -> dict:
    from ndparallel.parallel.pipeline.runner import PipelineModel

    PipelineModel._sum_tied_gradients = lambda self: None  # in this forked rank only
    return accelerate_style.main(argv)


def test_the_tied_test_catches_copies_that_drift_apart():
    """Guards the test above: without summing the two copies' gradients the losses leave the reference by far more
    than the tolerance."""
    argv = ["--model", "llama_tied", "--layers", str(LAYERS), "--micro-batch", "8", "--pp-size", "2"]
    results = run_ranks(_without_tied_sum, 2, argv)
    assert max(abs(a - b) for a, b in zip(results[0]["losses"], reference("llama_tied")["losses"])) > 1e-4


def test_qwen2_under_pipeline_stages_matches_single_process():
    assert_losses_match(run(2, ["--pp-size", "2"], 1, "qwen2"), reference("qwen2"), "qwen2 pp2")


@pytest.mark.slow
def test_eight_ranks_pp_fsdp_tp():
    assert_losses_match(run(8, ["--pp-size", "2", "--dp-shard-size", "2", "--tp-size", "2"]), reference(),
                        "pp2 x dp_shard2 x tp2")


@pytest.mark.slow
def test_eight_ranks_pp_cp_sp():
    assert_losses_match(run(8, ["--pp-size", "2", "--cp-size", "2", "--sp-size", "2"]), reference(),
                        "pp2 x cp2 x sp2")


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--pp-size", "2"], ["--pp-size", "2", "--dp-shard-size", "2"]],
                         ids=["pp2", "pp2_fsdp2"])
def test_bf16_under_pipeline_stages_follows_the_fp32_trajectory(flags):
    results = run(2 if len(flags) == 2 else 4, flags, 1, "llama", "--mixed-precision", "bf16")
    ref = reference()
    for res in results:
        diff = max(abs(a - b) for a, b in zip(res["losses"], ref["losses"]))
        assert 0 < diff < 5e-2, f"bf16: {diff:.2e} from the fp32 run"  # rounding, not another trajectory


@pytest.mark.slow
def test_sixteen_ranks_pp_hsdp_tp():
    results = run(16, ["--pp-size", "2", "--dp-replicate-size", "2", "--dp-shard-size", "2", "--tp-size", "2"], 1,
                  "llama", "--return-params")
    assert_losses_match(results, reference(), "pp2 x dp_replicate2 x dp_shard2 x tp2")
    # replicas (same pp stage, other dp_replicate coordinate: 8 ranks apart) hold equal parameters
    for rank in range(4):
        a, b = results[rank]["params"], results[rank + 4]["params"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_uneven_ignored_labels_give_single_process_parameters():
    """-100 labels spread unevenly over ranks, micro-batches and accumulation steps: SGD-trained parameters of every
    stage equal the single-process ones (each stage's, together every parameter)."""
    ref = reference(uneven_labels=True, optimizer="sgd", lr=0.5)
    results = run(4, ["--pp-size", "2", "--dp-shard-size", "2"], 2, "llama", "--uneven-labels", "--optimizer", "sgd",
                  "--lr", "0.5", "--return-params")
    seen = set()
    for res in results:
        for name, value in res["params"].items():
            diff = (value - ref["params"][name]).abs().max().item()
            assert diff <= 1e-6, f"{name}: {diff:.2e} from the reference"
            seen.add(name)
    assert seen == set(ref["params"])  # the stages together hold the whole model
    moved = max((ref["params"][k] - reference_run("llama", global_batch=GLOBAL_BATCH, layers=LAYERS, steps=0)
                 ["params"][k]).abs().max().item() for k in ref["params"])
    assert moved > 1e-3  # training moved the parameters: the comparison is not trivially true


# ---- evaluation, checkpoints, export ------------------------------------------------------------------------------
def _evaluate(extra: dict) -> tuple[float, float, bool]:
    from ndparallel import Accelerator, ParallelismConfig

    accelerator = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, **extra))
    torch.manual_seed(0)
    model = build_model("llama", num_hidden_layers=LAYERS)
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100
    with torch.no_grad():
        expected = model(input_ids=ids, labels=labels)
    model = accelerator.prepare(model)
    model.eval()
    all_eval = not any(m.training for stage in model.stage_modules for m in stage.modules())
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    accelerator.end_training()
    return (out.logits - expected.logits).abs().max().item(), (out.loss - expected.loss).abs().item(), all_eval


def _prepare_twice() -> tuple[bool, int, int]:
    from ndparallel import Accelerator, ParallelismConfig

    accelerator = Accelerator(parallelism_config=ParallelismConfig(pp_size=2))
    torch.manual_seed(0)
    model = accelerator.prepare(build_model("llama", num_hidden_layers=LAYERS))
    again = accelerator.prepare(model)
    stage = (accelerator.pipeline_parallel_rank, accelerator.pp_size)
    accelerator.end_training()
    return (again is model, *stage)


def test_a_prepared_pipeline_model_comes_back_from_prepare_as_it_is():
    """As a DDP or FSDP2 model does (it used to be prepared again, and the ranks' stages disagreed); each rank
    reports its stage as ``pipeline_parallel_rank`` (Accelerate's property, which raises there)."""
    assert run_ranks(_prepare_twice, 2) == [(True, 0, 2), (True, 1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("world,extra", [(2, {}), (4, {"dp_shard_size": 2})], ids=["pp2", "pp2_fsdp2"])
def test_evaluation_returns_logits_and_loss_on_every_stage(world, extra):
    for logits_diff, loss_diff, all_eval in run_ranks(_evaluate, world, extra):
        assert logits_diff <= 1e-6 and loss_diff <= 1e-6
        assert all_eval  # model.eval() reached the stage modules (views of the model, not its children)


# ---- a model that is not a Hugging Face model ------------------------------------------------------------------
def _sequential(pp: int) -> dict:
    from ndparallel import Accelerator, ParallelismConfig

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)
    accelerator = None
    if pp > 1:
        accelerator = Accelerator(parallelism_config=ParallelismConfig(pp_size=pp, pp_handler=PipelineParallelConfig(
            split=["2"], loss_fn=loss_fn, microbatches=4)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(2))
    targets = torch.randn(3, 8, 4, generator=torch.Generator().manual_seed(3))
    if accelerator is not None:
        model, optimizer = accelerator.prepare(model, optimizer)
    losses, norms = [], []
    for x, y in zip(data, targets):
        if accelerator is None:
            loss = loss_fn(model(x), y)
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        else:
            loss = model(x, labels=y).loss
            accelerator.backward(loss)
            norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.05)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    params = {k: v.detach().clone() for k, v in (accelerator.unwrap_model(model) if accelerator else model)
              .named_parameters()}
    if accelerator is not None:
        accelerator.end_training()
    return {"losses": losses, "norms": norms, "params": params}


def test_an_nn_sequential_split_by_module_names_trains_as_one_process():
    """A plain nn.Sequential split at its child "2", with its own loss function: losses, the clipped global gradient
    norm (summed over both stages) and the parameters match one process."""
    ref = _sequential(1)
    results = run_ranks(_sequential, 2, 2)
    assert min(ref["norms"]) > 0.05  # clipping is active, so a wrong norm would change the parameters
    for res in results:
        assert max(abs(a - b) for a, b in zip(res["losses"], ref["losses"])) <= 1e-6
        assert max(abs(a - b) for a, b in zip(res["norms"], ref["norms"])) <= 1e-6
    assert set(results[0]["params"]) == {"0.weight", "0.bias"}
    assert set(results[1]["params"]) == {"2.weight", "2.bias", "4.weight", "4.bias"}
    for res in results:
        for name, value in res["params"].items():
            assert (value - ref["params"][name]).abs().max().item() <= 1e-6, name


# ---- bad input ------------------------------------------------------------------------------------------------------
def _bad_inputs() -> dict:
    from ndparallel import Accelerator, ParallelismConfig

    accelerator = Accelerator(parallelism_config=ParallelismConfig(pp_size=2))
    torch.manual_seed(0)
    model = accelerator.prepare(build_model("llama", num_hidden_layers=LAYERS))
    ids = torch.randint(0, VOCAB, (3, 16))
    model.train()
    result = outcomes({
        "rows": lambda: model(input_ids=ids, labels=ids),
        "no_labels": lambda: model(input_ids=ids[:2]),
        "extra_input": lambda: model(input_ids=ids[:2], labels=ids[:2], token_type_ids=ids[:2]),
    })
    accelerator.end_training()
    return result


def test_bad_batches_are_refused_before_the_schedule_runs():
    per_rank = run_ranks(_bad_inputs, 2)
    for case, message in [("rows", "this rank's batch has 3 rows, which do not split into 2 micro-batches"),
                          ("no_labels", "training runs the loss inside the schedule, so the batch needs labels"),
                          ("extra_input", "unexpected model input(s) ['token_type_ids']")]:
        assert_refused(per_rank, ("ValueError", re.escape(message)), case)


def _padded_under_context_parallelism() -> dict:
    import torch.nn.functional as F

    from ndparallel import Accelerator, ParallelismConfig

    accelerator = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, cp_size=2))
    torch.manual_seed(0)
    model = accelerator.prepare(build_model("llama", num_hidden_layers=LAYERS))
    ids = torch.randint(0, VOCAB, (2, 16))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    shift = F.pad(ids[:, 1:], (0, 1), value=-100)

    def step() -> None:
        buffers = [ids, shift, mask]
        with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                                no_restore_buffers=set(buffers)):
            model(input_ids=ids, shift_labels=shift, attention_mask=mask)
    result = outcomes({"padded": step})
    accelerator.end_training()
    return result


@pytest.mark.slow
def test_padded_batches_under_pipeline_and_context_parallelism_are_refused():
    assert_refused(run_ranks(_padded_under_context_parallelism, 4), ("ValueError", re.escape(
        "pipeline stages with context/sequence parallelism take whole causal rows only: padded or packed batches")),
        "padded")


def _refused_layout(sizes: dict, model_name: str, overrides: dict, settings: dict) -> dict:
    from ndparallel import (
        Accelerator,
        FullyShardedDataParallelPlugin,
        ParallelismConfig,
        TorchDynamoPlugin,
        TorchTensorParallelConfig,
    )

    extra = {"dynamo_plugin": TorchDynamoPlugin(backend="aot_eager")} if settings.get("compile") else {}
    accelerator = Accelerator(
        parallelism_config=ParallelismConfig(**sizes, tp_handler=TorchTensorParallelConfig(
            loss_parallel=settings.get("loss_parallel", False)), pp_handler=PipelineParallelConfig(
            schedule=settings.get("schedule", "1f1b"))),
        mixed_precision=settings.get("mixed_precision", "no"),
        fsdp_plugin=FullyShardedDataParallelPlugin(
            state_dict_type=settings.get("state_dict_type", "SHARDED_STATE_DICT"),
            activation_checkpointing=settings.get("activation_checkpointing", False)), **extra)
    model = build_model(model_name, **overrides)
    cases = {"prepare": lambda: accelerator.prepare(model)}
    if settings.get("save"):
        cases["save"] = lambda: accelerator.save_state(settings["save"])
    result = outcomes(cases)
    accelerator.end_training()
    return result


FOUR = {"num_hidden_layers": LAYERS}


@pytest.mark.slow
@pytest.mark.parametrize("sizes,model_name,overrides,settings,message", [
    (dict(pp_size=4), "llama", {}, {}, "pp_size=4 x stages_per_rank=1 = 4 stages, but LlamaForCausalLM has only 2"),
    (dict(pp_size=2), "llama", {**FOUR, "tie_word_embeddings": True}, {"schedule": "zbv"},
     "pp_size=2: LlamaForCausalLM ties its input embedding to its LM head, and schedule 'zbv' puts the first and the "
     "last stage on one rank"),
    (dict(pp_size=2), "llama", FOUR, {"mixed_precision": "fp16"},
     "pp_size=2: fp16 mixed precision (a gradient scaler) is not supported with pipeline stages"),
    (dict(pp_size=2, tp_size=2), "llama", FOUR, {"loss_parallel": True},
     "pp_size=2: loss_parallel is not supported with pipeline stages"),
    (dict(pp_size=2), "llama", FOUR, {"compile": True},
     "pp_size=2: whole-model compilation is not supported with pipeline stages; use regional compilation"),
    (dict(pp_size=2, dp_shard_size=2), "llama", FOUR, {"schedule": "zbv"},
     "pp_size=2: schedule 'zbv' computes weight gradients after FSDP2 has reduced them"),
    (dict(pp_size=2, cp_size=2), "llama", FOUR, {"schedule": "zero_bubble"},
     "pp_size=2: schedule 'zero_bubble' computes weight gradients after FSDP2 has reduced them"),
    (dict(pp_size=2), "llama", FOUR, {"schedule": "zbv", "activation_checkpointing": True},
     "pp_size=2: schedule 'zbv' splits backward in two, which activation checkpointing does not support"),
], ids=["too_many_stages", "tied_zbv", "fp16", "loss_parallel", "whole_model_compile", "zbv_fsdp",
        "zero_bubble_cp", "zbv_checkpointing"])
def test_layouts_a_pipeline_cannot_run_are_refused_on_every_rank(sizes, model_name, overrides, settings, message):
    world = 1
    for size in sizes.values():
        world *= size
    per_rank = run_ranks(_refused_layout, world, sizes, model_name, overrides, settings)
    assert_refused(per_rank, ("ValueError", re.escape(message)), "prepare")


def test_full_state_dict_checkpoints_are_refused_under_pipeline_stages(tmp_path):
    per_rank = run_ranks(_refused_layout, 2, dict(pp_size=2), "llama", FOUR,
                         {"state_dict_type": "FULL_STATE_DICT", "save": str(tmp_path / "ckpt")})
    assert_refused(per_rank, ("no error", ""), "prepare")
    assert_refused(per_rank, ("ValueError", re.escape("FULL_STATE_DICT checkpoints are written and read by rank 0, "
                                                      "which holds only the first pipeline stage")), "save")
    assert not (tmp_path / "ckpt").exists()  # refused before anything was written
