"""Tier 1: the trackers of `ndparallel.tracking` that use a library: TensorBoard and the services (wandb, mlflow,
trackio, swanlab, comet_ml, aim, clearml, dvclive), each against a stand-in library in ``sys.modules`` that records
every call (always run), and against the real library where it is installed (``test_real_*``, offline, reading back
what the library stored; skipped otherwise). The tracker API itself is tests/tracking/test_tracking.py.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ndparallel import tracking
from ndparallel.tracking import Trackers
from ndparallel.tracking.trackers import BUILTIN_TRACKERS

LIBRARY_TRACKERS = {name: cls for name, cls in BUILTIN_TRACKERS.items() if name != "jsonl"}

# -- TensorBoard, for real ------------------------------------------------------------------------------------------

def test_tensorboard_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = Trackers(["tensorboard"], logging_dir=tmp_path)
    trackers.init("run", config={"lr": 0.1, "dtype": torch.float32},
                  init_kwargs={"tensorboard": {"flush_secs": 1}})
    assert trackers.get("tensorboard", unwrap=True).log_dir == str(tmp_path / "run")
    trackers.log({"loss": torch.tensor(2.5), "note": "hello"}, step=0)
    trackers.log({"loss": 2.0}, step=1)
    with pytest.warns(UserWarning, match="'hist' was not logged: a list is not a number"):
        trackers.log({"hist": torch.ones(3)}, step=1)
    trackers.finish()

    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(0, 2.5), (1, 2.0)]
    assert "note/text_summary" in events.Tags()["tensors"]
    hparams = [p for p in (tmp_path / "run").iterdir() if p.is_dir()]  # add_hparams writes a run of its own
    assert len(hparams) == 1 and any(f.name.startswith("events.out.tfevents") for f in hparams[0].iterdir())


# -- the service trackers against stand-in libraries ------------------------------------------------------------------

class FakeLibrary:
    """Stands in for a library module: any attribute is another FakeLibrary named by its dotted path; calling one
    records ``(path, args, kwargs)`` and returns the FakeLibrary ``path + "()"``; attribute and item assignments are
    recorded as ``(path.attr + " =", value)``. `values` fixes what chosen paths are (attributes) or return (calls)."""

    def __init__(self, path: str, log: list, values: dict[str, Any]) -> None:
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_log", log)
        object.__setattr__(self, "_values", values)

    def _child(self, path: str) -> Any:
        return self._values[path] if path in self._values else FakeLibrary(path, self._log, self._values)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._child(f"{self._path}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._log.append((self._path, args, kwargs))
        return self._child(self._path + "()")

    def __setattr__(self, name: str, value: Any) -> None:
        self._log.append((f"{self._path}.{name} =", value))

    def __setitem__(self, key: str, value: Any) -> None:
        self._log.append((f"{self._path}[{key!r}] =", value))


def _calls(prefix: str, *calls: tuple) -> list[tuple]:
    """`calls` with `prefix` put before each path (``(".log", ...)`` -> ``("wandb.init().log", ...)``)."""
    return [(prefix + call[0], *call[1:]) for call in calls]


# tracker name -> (its run object, init_kwargs, log values, log_kwargs, fixed values of the fake library,
#                   the calls expected from init("proj", {"lr": 0.1}), log(values, step=3) and finish())
SERVICE_CASES: dict[str, tuple] = {
    "wandb": ("wandb.init()", {"name": "r1"}, {"loss": torch.tensor(1.5), "note": "hi"}, {"commit": False}, {},
              [("wandb.init", (), {"project": "proj", "name": "r1"}),
               *_calls("wandb.init()", (".config.update", ({"lr": 0.1},), {"allow_val_change": True}),
                       (".log", ({"loss": 1.5, "note": "hi"},), {"step": 3, "commit": False}), (".finish", (), {}))]),
    "trackio": ("trackio.init()", {"name": "r1"}, {"loss": 1.5}, {}, {},
                [("trackio.init", (), {"project": "proj", "name": "r1"}),
                 *_calls("trackio.init()", (".config.update", ({"lr": 0.1},), {}),
                         (".log", ({"loss": 1.5},), {"step": 3}), (".finish", (), {}))]),
    "swanlab": ("swanlab.init()", {"mode": "offline"}, {"loss": np.float32(1.5)}, {}, {},
                [("swanlab.init", (), {"project": "proj", "mode": "offline"}),
                 *_calls("swanlab.init()", (".config.update", ({"lr": 0.1},), {}),
                         (".log", ({"loss": 1.5},), {"step": 3}), (".finish", (), {}))]),
    "comet_ml": ("comet_ml.start()", {"online": False}, {"loss": torch.tensor(1.5), "note": "hi", "eval": {"acc": 0.5}, "bad": [1]}, {},
                 {},
                 [("comet_ml.start", (), {"project_name": "proj", "online": False}),
                  *_calls("comet_ml.start()", (".log_parameters", ({"lr": 0.1},), {}), (".set_step", (3,), {}),
                          (".log_metric", ("loss", 1.5), {"step": 3}), (".log_other", ("note", "hi"), {}),
                          (".log_metrics", ({"acc": 0.5},), {"prefix": "eval", "step": 3}), (".end", (), {}))]),
    "mlflow": ("mlflow.start_run()", {"run_name": "r1", "tags": '{"team": "a"}'}, {"loss": torch.tensor(1.5), "note": "hi"}, {},
               {"mlflow.get_experiment_by_name()": None, "mlflow.create_experiment()": "7",
                "mlflow.utils.validation.MAX_PARAM_VAL_LENGTH": 6000,
                "mlflow.utils.validation.MAX_PARAMS_TAGS_PER_BATCH": 100},
               [("mlflow.get_experiment_by_name", ("proj",), {}),
                ("mlflow.create_experiment", ("proj",), {"artifact_location": None, "tags": {"team": "a"}}),
                ("mlflow.start_run", (), {"experiment_id": "7", "nested": False, "tags": {"team": "a"},
                                          "run_name": "r1"}),
                ("mlflow.log_params", ({"lr": 0.1},), {}), ("mlflow.log_metrics", ({"loss": 1.5},), {"step": 3}),
                ("mlflow.end_run", (), {})]),
    "aim": ("aim.Run()", {"experiment": "e1"}, {"loss": torch.tensor(1.5), "note": "hi"}, {"context": {"subset": "train"}},
            {"aim.Text": str.upper},
            [("aim.Run", (), {"repo": "<logging_dir>", "experiment": "e1"}),
             *_calls("aim.Run()", (".name =", "proj"), ("['hparams'] =", {"lr": 0.1}),
                     (".track", (1.5,), {"name": "loss", "step": 3, "context": {"subset": "train"}}),
                     (".track", ("HI",), {"name": "note", "step": 3, "context": {"subset": "train"}}),
                     (".close", (), {}))]),
    "clearml": ("clearml.Task.init()", {"tags": ["a"]}, {"eval_loss": torch.tensor(1.5), "loss": 2.0, "note": "hi"}, {},
                {"clearml.Task.current_task()": None},
                [("clearml.Task.current_task", (), {}),
                 ("clearml.Task.init", (), {"project_name": "proj", "task_name": "proj", "tags": ["a"]}),
                 *_calls("clearml.Task.init()", (".connect_configuration", ({"lr": 0.1},), {}),
                         (".get_logger", (), {}),
                         (".get_logger().report_scalar", (),
                          {"title": "loss", "series": "eval", "value": 1.5, "iteration": 3}),
                         (".get_logger().report_scalar", (),
                          {"title": "loss", "series": "train", "value": 2.0, "iteration": 3}),
                         (".close", (), {}))]),
    "dvclive": ("dvclive.Live()", {"dir": "out"}, {"loss": torch.tensor(1.5), "note": "hi"}, {}, {},
                [("dvclive.Live", (), {"dir": "out"}),
                 *_calls("dvclive.Live()", (".log_params", ({"lr": 0.1},), {}), (".step =", 3),
                         (".log_metric", ("loss", 1.5), {}), (".next_step", (), {}), (".end", (), {}))]),
}


def _logging_dir(part: Any, directory: Path) -> Any:
    """`part` of an expected call with the "<logging_dir>" placeholder in a kwargs dict replaced by `directory`."""
    if isinstance(part, dict):
        return {key: str(directory) if value == "<logging_dir>" else value for key, value in part.items()}
    return part


@pytest.mark.parametrize("name", sorted(SERVICE_CASES))
def test_service_tracker_calls_its_library(name, monkeypatch, tmp_path):
    for variable in ("MLFLOW_EXPERIMENT_NAME", "CLEARML_PROJECT", "CLEARML_TASK"):
        monkeypatch.delenv(variable, raising=False)
    run_path, init_kwargs, values, log_kwargs, fixed, expected = SERVICE_CASES[name]
    module = LIBRARY_TRACKERS[name].module
    log: list[tuple] = []
    monkeypatch.setitem(sys.modules, module, FakeLibrary(module, log, fixed))

    trackers = Trackers([name], logging_dir=tmp_path)
    trackers.init("proj", config={"lr": 0.1}, init_kwargs={name: init_kwargs})
    run = trackers.get(name, unwrap=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trackers.log(values, step=3, log_kwargs={name: log_kwargs})
    trackers.finish()

    expected = [(call[0], *(_logging_dir(part, tmp_path) for part in call[1:])) for call in expected]
    assert log == expected
    assert run._path == run_path  # unwrap gives the library's run object
    skipped = sorted(str(w.message).split("'")[1] for w in caught)
    logged_as_metric_only = {"comet_ml": ["bad"], "mlflow": ["note"], "clearml": ["note"], "dvclive": ["note"]}
    assert skipped == logged_as_metric_only.get(name, [])


def test_mlflow_skips_config_values_over_its_limit(monkeypatch):
    log: list[tuple] = []
    fixed = {"mlflow.utils.validation.MAX_PARAM_VAL_LENGTH": 5, "mlflow.utils.validation.MAX_PARAMS_TAGS_PER_BATCH": 2}
    monkeypatch.setitem(sys.modules, "mlflow", FakeLibrary("mlflow", log, fixed))
    tracker = tracking.MLflowTracker()
    with pytest.warns(UserWarning, match="config 'long' was not stored: MLflow parameters hold at most 5 characters"):
        tracker.store_init_configuration({"a": 1, "long": "x" * 6, "b": 2, "c": 3})
    assert log == [("mlflow.log_params", ({"a": 1, "b": 2},), {}), ("mlflow.log_params", ({"c": 3},), {})]


def test_clearml_reuses_a_running_task_and_leaves_it_open(monkeypatch):
    log: list[tuple] = []
    monkeypatch.setitem(sys.modules, "clearml", FakeLibrary("clearml", log, {}))
    tracker = tracking.ClearMLTracker("proj")
    tracker.start()
    tracker.log({"loss": 1.0})  # no step: a single value
    tracker.finish()
    assert log == [("clearml.Task.current_task", (), {}),
                   ("clearml.Task.current_task().get_logger", (), {}),
                   ("clearml.Task.current_task().get_logger().report_single_value", (), {"name": "loss", "value": 1.0})]


# -- the service trackers against the real libraries, where installed ---------------------------------------------

@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """Keep a real library's files in `tmp_path`: it is the working directory and the home directory, and the
    cache/config variables the libraries read point into it; nothing is sent anywhere (offline modes)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.chdir(tmp_path)
    for variable, value in {"HOME": home, "XDG_CACHE_HOME": home / ".cache", "XDG_CONFIG_HOME": home / ".config",
                            "WANDB_DIR": tmp_path, "WANDB_CACHE_DIR": home / "wandb", "WANDB_CONFIG_DIR": home / "wandb",
                            "WANDB_DATA_DIR": home / "wandb", "CLEARML_CACHE_DIR": home / "clearml",
                            "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}.items():
        monkeypatch.setenv(variable, str(value))
    for variable in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "CLEARML_PROJECT", "CLEARML_TASK"):
        monkeypatch.delenv(variable, raising=False)
    return tmp_path


def _real_run(name: str, isolated: Path, init_kwargs: dict) -> Trackers:
    trackers = Trackers([name], logging_dir=isolated)
    trackers.init("proj", config={"lr": 0.1, "layers": 2}, init_kwargs={name: init_kwargs})
    trackers.log({"loss": torch.tensor(1.5)}, step=0)
    trackers.log({"loss": 1.25}, step=1)
    return trackers


def test_real_mlflow(isolated, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri(f"file://{isolated}/mlruns")
    trackers = _real_run("mlflow", isolated, {"run_name": "r1"})
    run_id = trackers.get("mlflow", unwrap=True).info.run_id
    trackers.finish()
    run = mlflow.MlflowClient().get_run(run_id)
    assert run.data.params == {"lr": "0.1", "layers": "2"} and run.info.run_name == "r1"
    history = mlflow.MlflowClient().get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(0, 1.5), (1, 1.25)]


def test_real_dvclive(isolated):
    pytest.importorskip("dvclive")
    out = isolated / "dvc"
    trackers = _real_run("dvclive", isolated, {"dir": str(out), "save_dvc_exp": False, "dvcyaml": None})
    trackers.finish()
    assert json.loads((out / "metrics.json").read_text()) == {"loss": 1.25, "step": 1}
    assert (out / "params.yaml").read_text().split() == ["lr:", "0.1", "layers:", "2"]
    assert (out / "plots" / "metrics" / "loss.tsv").read_text() == "step\tloss\n0\t1.5\n1\t1.25\n"
    # dvclive makes the git repository around the working directory a DVC one unless told not to (`isolated`)
    assert not {".dvc", ".dvcignore", "dvc.yaml"} & {p.name for p in isolated.iterdir()}


def test_real_wandb_offline(isolated, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    trackers = _real_run("wandb", isolated, {"dir": str(isolated)})
    run = trackers.get("wandb", unwrap=True)
    assert (run.config["lr"], run.config["layers"]) == (0.1, 2)
    trackers.finish()
    assert list((isolated / "wandb").glob("offline-run-*/run-*.wandb"))


def test_real_comet_offline(isolated):
    comet_ml = pytest.importorskip("comet_ml")
    import zipfile

    trackers = _real_run("comet_ml", isolated, {
        "online": False, "experiment_config": comet_ml.ExperimentConfig(offline_directory=str(isolated / "c"))})
    trackers.finish()
    (archive,) = (isolated / "c").iterdir()
    messages = [json.loads(line)["payload"] for line in
                zipfile.ZipFile(archive).read("messages.json").decode().splitlines()]
    params = {m["param"]["paramName"]: m["param"]["paramValue"] for m in messages if "param" in m}
    metrics = [(m["metric"]["step"], m["metric"]["metricValue"]) for m in messages
               if m.get("metric", {}).get("metricName") == "loss"]
    assert (params["lr"], params["layers"]) == (0.1, 2) and metrics == [(0, 1.5), (1, 1.25)]


def test_real_aim(isolated):
    aim = pytest.importorskip("aim")
    trackers = _real_run("aim", isolated, {"system_tracking_interval": None})
    run_hash = trackers.get("aim", unwrap=True).hash
    trackers.finish()
    run = aim.Run(run_hash, repo=str(isolated))  # reopened: a read-only run sees only what aim has indexed
    (metric,) = [m for m in run.metrics() if m.name == "loss"]
    steps, (values, *_) = metric.data.items_list()
    assert run.name == "proj" and run["hparams"] == {"lr": 0.1, "layers": 2}
    assert (steps, values) == ([0, 1], [1.5, 1.25])
    run.close()


def test_real_trackio(isolated, monkeypatch):
    pytest.importorskip("trackio")
    from trackio import sqlite_storage, utils

    for module in (utils, sqlite_storage):  # trackio reads TRACKIO_DIR once, at import
        if hasattr(module, "TRACKIO_DIR"):
            monkeypatch.setattr(module, "TRACKIO_DIR", isolated)
    trackers = _real_run("trackio", isolated, {"name": "r1", "auto_log_cpu": False})
    trackers.finish()
    logs = sqlite_storage.SQLiteStorage.get_logs("proj", "r1")
    assert [(row["step"], row["loss"]) for row in logs] == [(0, 1.5), (1, 1.25)]
    assert sqlite_storage.SQLiteStorage.get_run_config("proj", "r1")["lr"] == 0.1


def test_real_swanlab_offline(isolated):
    pytest.importorskip("swanlab")
    trackers = _real_run("swanlab", isolated, {"mode": "offline", "log_dir": str(isolated / "s")})
    run = trackers.get("swanlab", unwrap=True)
    assert (run.config["lr"], run.config["layers"]) == (0.1, 2)
    trackers.finish()
    assert list((isolated / "s").glob("run-*/run-*.swanlab"))


def test_real_clearml_offline(isolated, monkeypatch):
    pytest.importorskip("clearml")
    monkeypatch.setenv("CLEARML_OFFLINE_MODE", "1")
    from clearml import Task
    from clearml.config import get_offline_dir

    Task.set_offline(True)
    # clearml's stream hook waits minutes at close under pytest's output capture: leave the streams alone
    trackers = _real_run("clearml", isolated, {"auto_connect_streams": False})
    task = trackers.get("clearml", unwrap=True)
    trackers.finish()  # clearml's Task.close takes about 10 s
    metrics_file = Path(get_offline_dir(task_id=task.id)) / "metrics.jsonl"
    events = [event for line in metrics_file.read_text().splitlines() for event in json.loads(line)]
    assert [(e["iter"], e["value"]) for e in events if e.get("metric") == "loss"] == [(0, 1.5), (1, 1.25)]
