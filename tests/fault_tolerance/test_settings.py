"""What fault tolerance refuses before any process or collective starts, and the data loader's jump to another
group's position (`PreparedDataLoader.continue_at`), in one process."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ndparallel.configuration.parallelism import ParallelismConfig
from ndparallel.fault_tolerance.settings import FaultToleranceKwargs, replica_group_config
from ndparallel.launch.cli import build_parser
from ndparallel.launch.launcher import plan_launch
from ndparallel.training.data import PreparedDataLoader

SCRIPT = __file__
HAS_TORCHFT = importlib.util.find_spec("torchft") is not None


def plan(*args: str):
    return plan_launch(build_parser().parse_args(["launch", "--cpu", *args, SCRIPT]))


def test_off_without_a_handler_or_the_launcher():
    assert FaultToleranceKwargs.from_env(None, {}) is None


def test_the_launchers_variables_fill_what_the_handler_leaves_unset():
    env = {"NDPARALLEL_FT_REPLICAS": "3", "NDPARALLEL_FT_REPLICA_ID": "2", "TORCHFT_LIGHTHOUSE": "http://h:1",
           "NDPARALLEL_FT_QUORUM_TIMEOUT": "7"}
    ft = FaultToleranceKwargs.from_env(FaultToleranceKwargs(min_replicas=2, timeout=5), env)
    assert (ft.replicas, ft.replica_id, ft.lighthouse, ft.min_replicas, ft.quorum_timeout, ft.timeout) == \
        (3, 2, "http://h:1", 2, 7.0, 5)


@pytest.mark.parametrize("handler, env, message", [
    (FaultToleranceKwargs(), {}, "replicas ($NDPARALLEL_FT_REPLICAS), replica_id ($NDPARALLEL_FT_REPLICA_ID), "
                                 "lighthouse ($TORCHFT_LIGHTHOUSE) are not set"),
    (None, {"NDPARALLEL_FT_REPLICAS": "2", "NDPARALLEL_FT_REPLICA_ID": "2", "TORCHFT_LIGHTHOUSE": "x"},
     "replica_id 2 is not one of the 2 groups"),
    (FaultToleranceKwargs(min_replicas=3), {"NDPARALLEL_FT_REPLICAS": "2", "NDPARALLEL_FT_REPLICA_ID": "0",
                                            "TORCHFT_LIGHTHOUSE": "x"}, "min_replicas=3 is more than the 2"),
    (None, {"NDPARALLEL_FT_REPLICAS": "two"}, "$NDPARALLEL_FT_REPLICAS='two' is not a valid int"),
])
def test_what_cannot_work_is_refused_naming_it(handler, env, message):
    with pytest.raises(ValueError) as err:
        FaultToleranceKwargs.from_env(handler, env)
    assert message in str(err.value)


def test_bad_fields_are_refused():
    with pytest.raises(ValueError, match="quorum_timeout must be a number of seconds > 0"):
        FaultToleranceKwargs(quorum_timeout=0)
    with pytest.raises(ValueError, match="min_replicas must be an int >= 1"):
        FaultToleranceKwargs(min_replicas=0)


def test_a_group_runs_the_layout_without_the_replicated_axis():
    group = replica_group_config(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2), 2)
    assert (group.dp_replicate_size, group.dp_shard_size, group.tp_size) == (1, 2, 2)
    with pytest.raises(ValueError, match="runs 3 replica groups, but the ParallelismConfig has dp_replicate_size=2"):
        replica_group_config(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2), 3)
    with pytest.raises(ValueError, match="pp_size=2"):
        replica_group_config(ParallelismConfig(dp_replicate_size=2, pp_size=2), 2)


@pytest.mark.parametrize("args, message", [
    (["--min-replicas", "2"], "--min-replicas is for --fault-tolerant runs"),
    (["--fault-tolerant", "--dp-shard-size", "2", "--nproc-per-node", "2"], "give --dp-replicate-size R with R >= 2"),
    (["--fault-tolerant", "--dp-replicate-size", "2", "--nproc-per-node", "2", "--min-replicas", "3"],
     "--min-replicas must be in 1..2"),
    (["--fault-tolerant", "--dp-replicate-size", "2", "--nproc-per-node", "2", "--stall-timeout", "5"],
     "--stall-timeout does not apply"),
    (["--fault-tolerant", "--dp-replicate-size", "2", "--nproc-per-node", "1", "--nnodes", "2",
      "--rdzv-endpoint", "h:29500"], "with --nnodes 2 start them yourself"),
])
def test_the_launcher_refuses_before_any_process_starts(args, message):
    with pytest.raises(ValueError) as err:
        plan(*args)
    assert message in str(err.value)


@pytest.mark.skipif(not HAS_TORCHFT, reason="needs torchft (the test extra)")
def test_the_launcher_plans_one_group_per_replica():
    launch = plan("--fault-tolerant", "--dp-replicate-size", "2", "--dp-shard-size", "2", "--nproc-per-node", "4",
                  "--min-replicas", "2").replicas
    assert (launch.replicas, launch.group_size, launch.min_replicas, launch.restarts) == (2, 2, 2, 3)


def _loader(shards: int = 2, index: int = 0) -> PreparedDataLoader:
    data = TensorDataset(torch.arange(40.0))
    return PreparedDataLoader(DataLoader(data, batch_size=2), num_shards=shards, shard_index=index, seed=0,
                              device=torch.device("cpu"), put_on_device=False, window=1, window_group=None)


def test_a_loader_continues_where_another_groups_loader_stands_mid_pass():
    ahead, behind = _loader(), _loader()
    it = iter(ahead)
    for _ in range(4):
        next(it)
    seen = [next(iter_behind := iter(behind))[0].tolist()]  # the group that heals has drawn its first batch
    behind.continue_at(ahead.state_dict())
    seen += [batch[0].tolist() for batch in iter_behind]
    assert seen == [[0.0, 1.0], *[batch[0].tolist() for batch in it]]  # then exactly what the other goes on with
    assert seen[1] == [16.0, 17.0]


def test_a_position_in_a_later_epoch_ends_the_pass():
    ahead, behind = _loader(), _loader()
    list(ahead)  # its pass is over: the next starts epoch 1
    it = iter(behind)
    next(it)
    behind.continue_at(ahead.state_dict())
    assert list(it) == []
    assert behind.epoch == 1 and [b[0].tolist() for b in behind][0] == [0.0, 1.0]


def _trainer(tmp_path, cls=None, **arguments):
    transformers = pytest.importorskip("transformers")
    from tiny_models import build_model

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                          parallelism_config=ParallelismConfig(), **arguments)
    return (cls or transformers.Trainer)(model=build_model("llama"), args=args)


def test_the_trainer_refuses_what_fault_tolerance_cannot_run_before_any_collective(monkeypatch, tmp_path):
    import ndparallel  # noqa: F401 -- attaches the Trainer integration
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("NDPARALLEL_FT_REPLICAS", "2")
    # the groups would end with different weights: only the group that writes checkpoints knows the best one
    with pytest.raises(ValueError, match="load_best_model_at_end=True is not supported"):
        _trainer(tmp_path, eval_strategy="steps", save_strategy="steps", load_best_model_at_end=True)

    class OwnCheckpoints(transformers.Trainer):  # every group would write the same checkpoint directory
        def _save_checkpoint(self, model, trial):
            pass

    with pytest.raises(RuntimeError, match=r"OwnCheckpoints\._save_checkpoint overrides it without calling"):
        _trainer(tmp_path, cls=OwnCheckpoints)
    # no process group exists here: both raised before any collective
