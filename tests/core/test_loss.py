"""The loss: which tokens count (one rule, `ndparallel.training.loss`), which data loader a step follows, and the logged
global loss (`Accelerator.reduce_loss`) against the single-process run.

Tier 1 checks the rule and the bookkeeping directly. Tier 2 trains a float64 model with a float64 loss (transformers'
own causal-LM loss computes in float32, which alone puts ~1e-6 between any two summation orders) on data whose -100
labels fall unevenly on ranks, shards and micro-steps, with an evaluation loader of other token counts iterated
inside every training step: the logged loss of every step equals the single-process loss to float64 rounding, and
training is untouched by the evaluation.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from ndparallel.training.loss import IGNORE_INDEX, BatchInfo, GradientState, count_loss_tokens, loss_factor, loss_labels
from ndparallel.parallel.sequence import SequenceSharding
from test_parity import max_param_diff, reference, run_layout


# ---- which tokens count ----------------------------------------------------------------------------------------------
def test_labels_are_aligned_with_the_positions_that_predict_them():
    labels = torch.tensor([[5, 6, -100, 7]])
    assert loss_labels({"labels": labels}).tolist() == [[6, -100, 7, -100]]  # Hugging Face's shift
    shifted = torch.tensor([[1, -100, -100, 2]])
    assert loss_labels({"labels": labels, "shift_labels": shifted}) is shifted  # already shifted: as given
    assert loss_labels({"input_ids": labels}) is None and loss_labels([labels]) is None
    assert count_loss_tokens({"labels": labels}) == 2 and count_loss_tokens({"shift_labels": shifted}) == 2
    assert count_loss_tokens({"input_ids": labels}) is None


def test_a_shard_counts_its_own_positions():
    labels = torch.arange(16).view(1, 16)
    labels[0, 3:9] = IGNORE_INDEX
    first_half = count_loss_tokens({"shift_labels": labels}, shard=lambda t: t[..., :8])
    assert first_half == 8 - 5
    assert count_loss_tokens({"shift_labels": labels}, shard=lambda t: None) is None


@pytest.mark.parametrize("cp,sp,load_balance", [(2, 1, True), (2, 1, False), (1, 4, True), (2, 2, True)])
def test_sequence_shards_count_every_loss_token_once(cp, sp, load_balance):
    """cp x sp shards of a batch: their counts add up to the whole batch's, each equal to a count by hand."""
    g = torch.Generator().manual_seed(cp * 10 + sp)
    labels = torch.randint(0, 50, (3, 16), generator=g)
    labels[torch.rand(3, 16, generator=g) < 0.4] = IGNORE_INDEX
    batch = {"labels": labels}
    total = 0
    for c in range(cp):
        for s in range(sp):
            sharding = SequenceSharding(cp, c, sp, s, load_balance)
            shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
            positions = sharding.shards(16).positions()
            assert sharding.count_loss_tokens(batch) == int((shifted[:, positions] != IGNORE_INDEX).sum())
            total += sharding.count_loss_tokens(batch)
    assert total == count_loss_tokens(batch)
    assert SequenceSharding(cp, 0, sp, 0, load_balance).count_loss_tokens({"labels": labels[:, :15]}) is None


def test_loss_factor():
    info = BatchInfo(local_tokens=3, window_tokens=12, window_batches=2, ends_window=False, end_of_dataloader=False)
    assert loss_factor(info, loss_world_size=4, accumulation_steps=2) == 3 * 4 / 12
    unknown = BatchInfo(None, None, window_batches=3, ends_window=False, end_of_dataloader=False)
    # A short last window of 3 micro-batches still divides by the 4 accumulation steps, as Accelerate's backward
    assert loss_factor(unknown, 4, 4) == pytest.approx(1 / 4)
    assert loss_factor(None, 4, 2) == 0.5  # no prepared loader: Accelerate's 1 / accumulation steps


# ---- which loader the step follows ---------------------------------------------------------------------------------
def _info(tokens: int, ends: bool, end: bool = False, remainder: int = 0) -> BatchInfo:
    return BatchInfo(tokens, 10 * tokens, 2, ends, end, remainder)


def test_the_innermost_active_loader_feeds_the_step():
    state = GradientState(accumulation_steps=2, loss_world_size=1)
    train, evaluation = object(), object()
    state.enter(train)
    state.on_batch(train, _info(5, ends=False))
    assert state.advance() is False and state.batch.local_tokens == 5
    state.enter(evaluation)  # an evaluation pass inside the training step
    state.on_batch(evaluation, _info(1, ends=True, end=True, remainder=3))
    assert state.batch.local_tokens == 1 and state.remainder == 3  # gather_for_metrics inside the pass: its rows
    state.leave(evaluation)
    assert state.batch.local_tokens == 5 and state.remainder == 0  # back to the training batch
    assert state.loss_factor() == 5 / 50
    state.on_batch(train, _info(7, ends=True))
    assert state.advance() is True and state.sync_gradients
    state.leave(train)
    assert state.batch.local_tokens == 7  # no loader active: the last one to yield


def test_log_loss_sums_a_window_and_starts_the_next():
    state = GradientState(accumulation_steps=2, loss_world_size=1)
    loader = object()
    state.enter(loader)
    state.on_batch(loader, BatchInfo(4, 10, 2, ends_window=False, end_of_dataloader=False))
    assert state.log_loss(torch.tensor(2.0)).tolist() == [8.0, 4.0]
    with pytest.raises(ValueError, match=r"reduce_loss was called twice for one micro-batch"):
        state.log_loss(torch.tensor(2.0))
    state.on_batch(loader, BatchInfo(0, 10, 2, ends_window=True, end_of_dataloader=False))
    assert state.log_loss(torch.tensor(float("nan"))).tolist() == [8.0, 4.0]  # no tokens: nothing added, no NaN
    state.on_batch(loader, BatchInfo(6, 6, 1, ends_window=True, end_of_dataloader=True))
    assert state.log_loss(torch.tensor(1.0)).tolist() == [6.0, 6.0]  # a new window
    unknown = object()  # a loader without labels: each loss weighs one
    state.enter(unknown)
    state.on_batch(unknown, BatchInfo(None, None, 1, ends_window=True, end_of_dataloader=False))
    assert state.log_loss(torch.tensor(3.0)).tolist() == [3.0, 1.0]
    with pytest.raises(ValueError, match=r"one element"):
        state.log_loss(torch.ones(2))


# ---- the logged loss against one process ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name,world,flags", [
    ("ddp2", 2, ["--dp-replicate-size", "2", "--no-fsdp-plugin"]),
    ("fsdp2_cp2_ring", 4, ["--dp-shard-size", "2", "--cp-size", "2", "--cp-strategy", "ring"]),
    ("sp2", 2, ["--sp-size", "2"]),
    ("cp2_sp2", 4, ["--cp-size", "2", "--sp-size", "2"]),
])
def test_reduce_loss_is_the_single_process_loss(name, world, flags):
    """Uneven -100 labels, 2 accumulation steps, an evaluation loader iterated inside every step (float64)."""
    ref = reference("llama", uneven_labels=True, optimizer="sgd", lr=0.5, float64=True)
    results = run_layout("llama", world, flags, 2, "--uneven-labels", "--optimizer", "sgd", "--lr", "0.5",
                         "--float64", "--eval-inside-step", "--return-params")
    for rank, res in enumerate(results):
        diff = max(abs(a - b) for a, b in zip(res["losses"], ref["losses"]))
        assert len(res["losses"]) == 6 and diff <= 1e-12, f"{name} rank {rank}: logged losses differ by {diff:.2e}"
        # every micro-step ran a whole evaluation pass (2 batches per data rank), logged alike on every rank
        assert len(res["eval_losses"]) == 6 * 2 * 2 and res["eval_losses"] == results[0]["eval_losses"]
        assert all(math.isfinite(x) for x in res["eval_losses"])
    assert max_param_diff(results[0]["params"], ref["params"]) <= 1e-12


# ---- losses that are not a mean over LM tokens keep Accelerate's meaning ----------------------------------------------
TASKS = ("sequence_classification", "token_classification", "regression", "plain_module")


def _task_model(task: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, pad_token_id=0, attn_implementation="sdpa")
    if task == "sequence_classification":
        return transformers.LlamaForSequenceClassification(transformers.LlamaConfig(num_labels=3, **config))
    if task == "token_classification":
        return transformers.LlamaForTokenClassification(transformers.LlamaConfig(num_labels=5, classifier_dropout=0.0,
                                                                                 **config))
    if task == "regression":
        return transformers.LlamaForSequenceClassification(transformers.LlamaConfig(num_labels=1, **config))
    return _PlainRegressor()


class _PlainRegressor(torch.nn.Module):
    """A module that computes its own (mean squared error) loss from a `labels` of shape [batch]."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict:
        return {"loss": F.mse_loss(self.net(inputs).squeeze(-1), labels)}


def _task_data(task: str, n: int) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    if task == "plain_module":
        return [{"inputs": torch.randn(6, generator=g), "labels": torch.randn((), generator=g)} for _ in range(n)]
    ids = torch.randint(1, 96, (n, 8), generator=g)
    if task == "sequence_classification":
        labels = torch.randint(0, 3, (n,), generator=g)
    elif task == "token_classification":
        labels = torch.randint(0, 5, (n, 8), generator=g)
    else:
        labels = torch.randn(n, generator=g)
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


def _train_task(task: str, world_flags: dict, accum: int, micro: int, steps: int, weighting: str = "auto") -> dict:
    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(**world_flags), gradient_accumulation_steps=accum,
                      loss_weighting=weighting)
    model = _task_model(task)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = _task_data(task, steps * micro * accum * acc.data_parallel_size)
    loader = torch.utils.data.DataLoader(data, batch_size=micro)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    logged = []
    for batch in loader:
        with acc.accumulate(model):
            loss = model(**batch)["loss"]
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step_loss = acc.reduce_loss(loss)
        if acc.sync_gradients:
            logged.append(float(step_loss))
    params = {n: p.detach().clone() for n, p in acc.get_state_dict(model).items()}
    acc.end_training()
    return {"params": params, "losses": logged, "token_weighted": acc.gradient_state.token_weighted}


def _task_reference(task: str, global_batch: int, steps: int) -> dict:
    model = _task_model(task)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for batch in torch.utils.data.DataLoader(_task_data(task, steps * global_batch), batch_size=global_batch):
        loss = model(**batch)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"params": {n: p.detach().clone() for n, p in model.state_dict().items()}, "losses": losses}


@pytest.mark.slow
@pytest.mark.parametrize("task", TASKS)
def test_non_lm_losses_match_the_single_process_gradient(task):
    """2 ranks (DDP) x 2 accumulation steps x micro-batch 1 against one process on batches of 4: each loss is a mean
    over samples (or over all of a sequence's tokens), so the mean of the ranks' and micro-steps' losses is exact."""
    ref = _task_reference(task, global_batch=4, steps=3)
    results = run_ranks(_train_task, 2, task, {"dp_replicate_size": 2}, 2, 1, 3)
    assert results[0]["token_weighted"] is False
    diff = max((results[0]["params"][n] - ref["params"][n]).abs().max().item() for n in ref["params"])
    assert diff <= 1e-6, f"{task}: parameters differ from one process by {diff:.2e}"
    assert max(abs(a - b) for a, b in zip(results[0]["losses"], ref["losses"])) <= 1e-6


def test_token_weighting_of_a_classification_loss_would_train_wrong():
    """Guards the test above: forcing LM token weighting on sequence classification at micro-batch 1 counts no
    tokens (labels[..., 1:] of a [1] tensor is empty), so the gradient is zero and nothing trains."""
    ref = _task_reference("sequence_classification", global_batch=4, steps=3)
    forced = run_ranks(_train_task, 2, "sequence_classification", {"dp_replicate_size": 2}, 2, 1, 3, "tokens")
    start = _task_model("sequence_classification").state_dict()
    assert max((forced[0]["params"][n] - start[n]).abs().max().item() for n in start) == 0.0
    assert max((ref["params"][n] - start[n]).abs().max().item() for n in start) > 1e-3


def test_causal_lms_are_recognised_under_the_class_fsdp2_gives_them():
    """GPT-2 has no ``loss_type``: it is recognised by its class name, which FSDP2 replaces by a subclass's
    (FSDPGPT2LMHeadModel); the check goes through the class's bases, so token weighting stays on under FSDP2."""
    from tiny_models import build_model

    from ndparallel.training.loss import is_causal_lm

    model = build_model("gpt2")
    assert getattr(model, "loss_type", None) is None and is_causal_lm(model)
    model.__class__ = type(f"FSDP{type(model).__name__}", (type(model),), {})  # what fully_shard does
    assert is_causal_lm(model)
    assert not is_causal_lm(torch.nn.Linear(2, 2))
