"""Tier 1: experiment trackers (`ndparallel.tracking`): Accelerate's ``log_with=`` API, no ranks.

The JSON-lines tracker is checked by reading back what it wrote; names, errors, warnings, the registry and the
main-process rule with recording trackers of its own. The trackers that use a library (TensorBoard and the
services) are tests/tracking/test_tracking_libraries.py.
"""

from __future__ import annotations

import json
import sys
import time
import types
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from ndparallel import tracking
from ndparallel.tracking import GeneralTracker, LoggerType, Trackers
from ndparallel.tracking.trackers import BUILTIN_TRACKERS

LIBRARY_TRACKERS = {name: cls for name, cls in BUILTIN_TRACKERS.items() if name != "jsonl"}


class Recorder(GeneralTracker):
    """A user-defined tracker that records what it is asked to do."""

    name = "recorder"
    requires_logging_directory = False

    def __init__(self, main_process_only: bool = True, fail_on: str | None = None) -> None:
        super().__init__()
        self.main_process_only = main_process_only
        self.fail_on = fail_on
        self.calls: list[tuple] = []

    def _record(self, *call: Any) -> None:
        self.calls.append(call)
        if call[0] == self.fail_on:
            raise RuntimeError(f"{self.name} failed in {call[0]}")

    def start(self) -> None:
        self._record("start")

    def store_init_configuration(self, values: dict) -> None:
        self._record("config", values)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        self._record("log", values, step, kwargs)

    def finish(self) -> None:
        self._record("finish")


def _named(cls: type[Recorder], name: str) -> type[Recorder]:
    return type(f"{name.title()}Tracker", (cls,), {"name": name})


@pytest.fixture
def registry(monkeypatch):
    """The name registry, restored after the test."""
    monkeypatch.setattr(tracking.trackers, "TRACKER_CLASSES", dict(tracking.trackers.TRACKER_CLASSES))
    return tracking.trackers.TRACKER_CLASSES


def _block(monkeypatch, *modules: str) -> None:
    """Make `modules` impossible to import, as if they were not installed."""
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


def _block_all_libraries(monkeypatch) -> None:
    _block(monkeypatch, "tensorboardX", *(cls.module for cls in LIBRARY_TRACKERS.values()))


def _install(monkeypatch, *modules: str) -> None:
    """Make `modules` look installed (an empty module stands in for each)."""
    for module in modules:
        monkeypatch.setitem(sys.modules, module, types.ModuleType(module))


# -- the JSON-lines tracker ---------------------------------------------------------------------------------------

def test_jsonl_round_trip(tmp_path):
    trackers = Trackers("jsonl", logging_dir=tmp_path)
    config = {"lr": 1e-3, "steps": 12, "dtype": torch.bfloat16, "layers": [2, 2], "name": "llama"}
    before = time.time()
    trackers.init("run1", config=config)
    trackers.log({"loss": torch.tensor(2.5), "tokens": np.int64(512), "lr": np.float32(0.5)}, step=0)
    trackers.log({"loss": 2.25, "note": "warm", "grads": torch.tensor([1.0, 2.0])}, step=1)
    trackers.log({"eval": {"acc": torch.tensor(0.75)}})
    trackers.finish()

    directory = tmp_path / "run1"
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "metrics.jsonl"]
    assert json.loads((directory / "config.json").read_text()) == {
        "lr": 1e-3, "steps": 12, "dtype": "torch.bfloat16", "layers": [2, 2], "name": "llama"}
    lines = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["values"]) for line in lines] == [
        (0, {"loss": 2.5, "tokens": 512, "lr": 0.5}),
        (1, {"loss": 2.25, "note": "warm", "grads": [1.0, 2.0]}),
        (None, {"eval": {"acc": 0.75}}),
    ]
    times = [line["time"] for line in lines]
    assert before <= times[0] <= times[1] <= times[2] <= time.time()
    assert trackers.trackers == []  # finished: nothing running


def test_jsonl_appends_when_a_run_restarts(tmp_path):
    for step in (0, 1):
        trackers = Trackers(["jsonl"], logging_dir=tmp_path)
        trackers.init("run")
        trackers.log({"loss": float(step)}, step=step)
        trackers.finish()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]
    assert not (tmp_path / "run" / "config.json").exists()  # no config given, none written


def test_jsonl_lines_are_on_disk_before_finish(tmp_path):
    trackers = Trackers("jsonl", logging_dir=tmp_path)
    trackers.init("run")
    trackers.log({"loss": 1.0}, step=7)
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text())["values"] == {"loss": 1.0}
    trackers.finish()


def test_jsonl_refuses_log_options(tmp_path):
    trackers = Trackers("jsonl", logging_dir=tmp_path)
    trackers.init("run")
    with pytest.raises(TypeError, match="jsonl tracker takes no log options"):
        trackers.log({"loss": 1.0}, log_kwargs={"jsonl": {"commit": True}})
    trackers.finish()


# -- main process only --------------------------------------------------------------------------------------------

def test_other_processes_run_no_main_only_tracker(tmp_path):
    everywhere = Recorder(main_process_only=False)
    main_only = _named(Recorder, "main_only")()
    trackers = Trackers(["jsonl", everywhere, main_only], logging_dir=tmp_path, is_main_process=False)
    trackers.init("run", config={"lr": 0.1})
    trackers.log({"loss": 1.0}, step=3)

    assert not (tmp_path / "run").exists()  # the jsonl tracker never started here
    assert main_only.calls == []
    assert trackers.trackers == [everywhere]
    assert everywhere.calls == [("start",), ("config", {"lr": 0.1}), ("log", {"loss": 1.0}, 3, {})]
    # a tracker this process does not run comes back as one that does nothing, unwrapped or not
    for unwrap in (False, True):
        stand_in = trackers.get("jsonl", unwrap=unwrap)
        assert isinstance(stand_in, GeneralTracker) and stand_in.name == "jsonl" and stand_in.tracker is None
        stand_in.log({"loss": 2.0}, step=4)
    assert trackers.get("recorder") is everywhere
    trackers.finish()
    assert not (tmp_path / "run").exists()
    assert everywhere.calls[-1] == ("finish",) and main_only.calls == []


def test_the_main_process_runs_every_tracker(tmp_path):
    main_only = _named(Recorder, "main_only")()
    trackers = Trackers(["jsonl", main_only], logging_dir=tmp_path, is_main_process=True)
    trackers.init("run")
    trackers.log({"loss": 1.0}, step=0)
    trackers.finish()
    assert main_only.calls == [("start",), ("log", {"loss": 1.0}, 0, {}), ("finish",)]
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_errors_are_the_same_on_every_process(tmp_path):
    for is_main in (True, False):
        trackers = Trackers("jsonl", logging_dir=tmp_path, is_main_process=is_main)
        with pytest.raises(RuntimeError, match=r"log\(\) was called before accelerator.init_trackers"):
            trackers.log({"loss": 1.0})
        trackers.init("run")
        with pytest.raises(RuntimeError, match="init_trackers was already called"):
            trackers.init("run")
        trackers.finish()
        with pytest.raises(RuntimeError, match="after end_training"):
            trackers.log({"loss": 1.0})


# -- a user-defined tracker ---------------------------------------------------------------------------------------

def test_user_tracker_sees_every_call_with_its_own_options():
    tracker = Recorder()
    trackers = Trackers(tracker)
    config = {"lr": 0.1}
    trackers.init(None, config=config)  # only tracker objects: no project name needed (Accelerate allows None)
    trackers.log({"loss": 1.5}, step=2, log_kwargs={"recorder": {"commit": False}})
    trackers.log({"loss": 1.25})
    trackers.finish()
    trackers.finish()  # a second end_training does nothing
    assert tracker.calls == [("start",), ("config", {"lr": 0.1}), ("log", {"loss": 1.5}, 2, {"commit": False}),
                             ("log", {"loss": 1.25}, None, {}), ("finish",)]
    assert tracker.calls[1][1] is not config  # each tracker gets its own copy


def test_user_tracker_without_log_kwargs_parameter_still_works():
    class Minimal(GeneralTracker):  # Accelerate's documented minimum: log(values, step)
        name = "minimal"
        requires_logging_directory = False

        def __init__(self):
            super().__init__()
            self.rows = []

        def log(self, values, step=None):
            self.rows.append((step, values))

    tracker = Minimal()
    trackers = Trackers([tracker])
    trackers.init("run")
    trackers.log({"loss": 1.0}, step=5)
    assert tracker.rows == [(5, {"loss": 1.0})]
    assert trackers.get("minimal", unwrap=True) is tracker  # wraps no library object: it is its own


def test_tracker_class_without_its_attributes_is_refused():
    class Nameless(GeneralTracker):
        requires_logging_directory = False

    with pytest.raises(TypeError, match="Nameless cannot be used as a tracker: set the class attribute `name`"):
        Nameless()

    class NoFlag(GeneralTracker):
        name = "no_flag"

    with pytest.raises(TypeError, match="requires_logging_directory"):
        NoFlag()


def test_two_trackers_with_one_name_are_refused(tmp_path):
    with pytest.raises(ValueError, match="two trackers named 'recorder'"):
        Trackers([Recorder(), Recorder()])
    jsonl = tracking.JSONLinesTracker("run", tmp_path)
    with pytest.raises(ValueError, match="names 'jsonl' and also gives a tracker object named 'jsonl'"):
        Trackers(["jsonl", jsonl], logging_dir=tmp_path)


def test_a_failing_start_closes_the_trackers_already_started():
    first, second = Recorder(), _named(Recorder, "second")(fail_on="start")
    trackers = Trackers([first, second])
    with pytest.raises(RuntimeError, match="second failed in start"):
        trackers.init("run")
    assert first.calls == [("start",), ("finish",)]
    assert trackers.trackers == []


def test_finish_closes_every_tracker_then_raises_the_first_error():
    first, second = Recorder(fail_on="finish"), _named(Recorder, "second")()
    trackers = Trackers([first, second])
    trackers.init("run")
    with pytest.raises(RuntimeError, match="recorder failed in finish"):
        trackers.finish()
    assert second.calls[-1] == ("finish",)
    trackers.finish()  # already closed: nothing left to do
    assert [c for c in first.calls if c == ("finish",)] == [("finish",)]


# -- get ---------------------------------------------------------------------------------------------------------

def test_get(tmp_path):
    tracker = Recorder()
    trackers = Trackers(["jsonl", tracker], logging_dir=tmp_path)
    with pytest.raises(RuntimeError, match=r"get_tracker\('jsonl'\) was called before init_trackers"):
        trackers.get("jsonl")
    trackers.init("run")
    jsonl = trackers.get("jsonl")
    assert isinstance(jsonl, tracking.JSONLinesTracker) and jsonl.metrics_path == tmp_path / "run" / "metrics.jsonl"
    assert trackers.get("jsonl", unwrap=True) is jsonl.tracker and not jsonl.tracker.closed  # the open file
    assert trackers.get("recorder") is tracker
    assert list(trackers) == [tracker, jsonl] and len(trackers) == 2 and trackers[1] is jsonl  # as Accelerate's list
    with pytest.raises(ValueError, match=r"no tracker named 'wandb'; log_with chose 'recorder', 'jsonl'"):
        trackers.get("wandb")
    trackers.finish()
    assert jsonl.tracker is None


def test_no_trackers_means_logging_does_nothing():
    trackers = Trackers(None)
    assert trackers.names == [] and trackers.log_with == []
    assert trackers.log({"loss": 1.0}, step=0) is None  # before init too, as in Accelerate
    trackers.init("run")
    trackers.log({"loss": 1.0})
    assert trackers.trackers == []
    with pytest.raises(ValueError, match="log_with chose none"):
        trackers.get("jsonl")
    trackers.finish()


# -- choosing trackers: names, errors -------------------------------------------------------------------------------

def test_logger_type_names():
    assert LoggerType.list() == ["all", "aim", "tensorboard", "wandb", "comet_ml", "mlflow", "clearml", "dvclive",
                                 "swanlab", "trackio", "jsonl"]
    assert LoggerType.COMETML == "comet_ml" and str(LoggerType.JSONL) == "jsonl"
    assert "wandb" in LoggerType and "weights_and_biases" not in LoggerType
    assert set(BUILTIN_TRACKERS) == set(LoggerType.list()) - {"all"}


def test_names_and_logger_types_choose_the_same_trackers(tmp_path, monkeypatch):
    _install(monkeypatch, "tensorboard")
    by_enum = Trackers([LoggerType.JSONL, LoggerType.TENSORBOARD], logging_dir=tmp_path)
    by_str = Trackers(["jsonl", "tensorboard", "jsonl"], logging_dir=tmp_path)  # repeats are dropped
    assert by_enum.names == by_str.names == ["jsonl", "tensorboard"]
    assert by_str.log_with == [LoggerType.JSONL, LoggerType.TENSORBOARD]


def test_unknown_tracker_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown tracker 'tensorbord'; valid names: all, tensorboard, wandb, "
                                         r"mlflow, trackio, swanlab, comet_ml, aim, clearml, dvclive, jsonl"):
        Trackers("tensorbord")


@pytest.mark.parametrize("log_with, match", [
    (tracking.JSONLinesTracker, r"got the class JSONLinesTracker: pass an instance \(JSONLinesTracker\(...\)\)"),
    (3, "log_with takes tracker names .* got int: 3"),
    ([{"wandb": {}}], "got dict"),
])
def test_log_with_of_the_wrong_type(log_with, match):
    with pytest.raises(TypeError, match=match):
        Trackers(log_with)


@pytest.mark.parametrize("name", ["jsonl", "tensorboard", "aim"])
def test_file_trackers_need_a_logging_directory(name, monkeypatch):
    if name in LIBRARY_TRACKERS:
        _install(monkeypatch, LIBRARY_TRACKERS[name].module)
    with pytest.raises(ValueError, match=rf"Logging with `{name}` requires a `logging_dir`, and none is set: pass "
                                         r"Accelerator\(project_dir=...\)"):
        Trackers(name)


def test_bad_arguments_to_init_and_log(tmp_path):
    trackers = Trackers("jsonl", logging_dir=tmp_path)
    with pytest.raises(TypeError, match="project_name must be a str"):
        trackers.init(None)
    with pytest.raises(TypeError, match=r"config must be a dict of hyperparameters \(e.g. vars\(args\)\)"):
        trackers.init("run", config=[("lr", 0.1)])
    with pytest.raises(TypeError, match="init_kwargs must map a tracker name to a dict of options"):
        trackers.init("run", init_kwargs={"jsonl": 3})
    trackers.init("run")
    with pytest.raises(TypeError, match="values must be a dict"):
        trackers.log([1.0])
    with pytest.raises(TypeError, match="step must be an int or None, got float: 1.5"):
        trackers.log({"loss": 1.0}, step=1.5)
    trackers.log({"loss": 1.0}, step=torch.tensor(4))  # an integer tensor or numpy int is a step
    trackers.log({"loss": 1.0}, step=np.int64(5))
    trackers.finish()
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [4, 5] and all(type(step) is int for step in steps)


def test_options_for_no_chosen_tracker_warn(tmp_path):
    tracker = Recorder()
    trackers = Trackers(["jsonl", tracker], logging_dir=tmp_path)
    with pytest.warns(UserWarning) as caught:
        trackers.init("run", init_kwargs={"wandb": {"tags": ["a"]}, "recorder": {"x": 1}})
    messages = [str(w.message) for w in caught]
    assert any("init_kwargs for 'wandb' ignored: no such tracker in log_with (chosen: 'recorder', 'jsonl')" in m
               for m in messages)
    assert any("init_kwargs['recorder'] is ignored: that tracker was passed to log_with as an object" in m
               for m in messages)
    with pytest.warns(UserWarning, match="log_kwargs for 'tensorboard' ignored"):
        trackers.log({"loss": 1.0}, log_kwargs={"tensorboard": {}})
    trackers.finish()


def test_warnings_come_from_the_main_process_only(tmp_path):
    trackers = Trackers(["jsonl"], logging_dir=tmp_path, is_main_process=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trackers.init("run", init_kwargs={"wandb": {}})
        trackers.log({"loss": 1.0}, log_kwargs={"wandb": {}})
    assert caught == []
    with pytest.raises(TypeError, match="step must be an int"):  # errors, by contrast, are raised everywhere
        trackers.log({"loss": 1.0}, step="3")


# -- libraries that are not installed, "all" ----------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(LIBRARY_TRACKERS))
def test_missing_library_says_what_to_install(name, monkeypatch, tmp_path):
    cls = LIBRARY_TRACKERS[name]
    _block(monkeypatch, cls.module, "tensorboardX")
    with pytest.raises(ImportError, match=rf"log_with='{name}' needs the `{cls.module}` library, which is not "
                                          rf"installed: run `pip install {cls.pip_package}`"):
        Trackers([name], logging_dir=tmp_path)
    with pytest.raises(ImportError, match=rf"pip install {cls.pip_package}"):  # a tracker object built by hand
        cls.library()


def test_pip_package_names():
    assert {name: cls.pip_package for name, cls in LIBRARY_TRACKERS.items()} == {
        "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio",
        "swanlab": "swanlab", "comet_ml": "comet-ml", "aim": "aim", "clearml": "clearml", "dvclive": "dvclive"}


def test_a_broken_library_shows_its_own_import_error(monkeypatch):
    class Broken:  # the library is there, but importing it fails on one of its own dependencies
        def find_spec(self, name, path=None, target=None):
            if name == "wandb":
                raise ModuleNotFoundError("No module named 'pydantic'", name="pydantic")

    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    with pytest.raises(ModuleNotFoundError, match="No module named 'pydantic'"):
        tracking.WandBTracker.library()


def test_all_is_every_installed_tracker_plus_jsonl(monkeypatch, tmp_path):
    _block_all_libraries(monkeypatch)
    assert Trackers("all", logging_dir=tmp_path).names == ["jsonl"]
    _install(monkeypatch, "wandb")
    tracker = Recorder()
    trackers = Trackers([tracker, LoggerType.ALL], logging_dir=tmp_path)
    assert trackers.names == ["recorder", "wandb", "jsonl"]
    assert trackers.log_with == [tracker, LoggerType.WANDB, LoggerType.JSONL]


def test_all_without_a_logging_directory_leaves_file_trackers_out(monkeypatch):
    _block_all_libraries(monkeypatch)
    _install(monkeypatch, "tensorboard", "wandb")
    with pytest.warns(UserWarning, match=r"log_with='all' leaves out tensorboard, jsonl: they write files and no "
                                         r"logging directory is set \(pass Accelerator\(project_dir=...\)"):
        trackers = Trackers("all")
    assert trackers.names == ["wandb"]


def test_all_does_not_repeat_a_tracker_given_as_an_object(monkeypatch, tmp_path):
    _block_all_libraries(monkeypatch)
    mine = tracking.JSONLinesTracker("mine", tmp_path)
    trackers = Trackers(["all", mine], logging_dir=tmp_path)
    assert trackers.log_with == [mine]


# -- registering a tracker class by name ------------------------------------------------------------------------

class NamedTracker(Recorder):
    name = "named"

    def __init__(self, run_name: str, *directory: Any, **kwargs: Any) -> None:
        super().__init__()
        self.run_name, self.directory, self.kwargs = run_name, directory, kwargs


def test_register_tracker_class(registry, tmp_path):
    tracking.register_tracker_class(NamedTracker)
    trackers = Trackers(["named"], logging_dir=tmp_path)
    trackers.init("proj", config={"lr": 0.1}, init_kwargs={"named": {"color": "red"}})
    tracker = trackers.get("named")
    assert (tracker.run_name, tracker.directory, tracker.kwargs) == ("proj", (), {"color": "red"})
    assert trackers.log_with == ["named"]

    DirectoryTracker = type("DirectoryTracker", (NamedTracker,), {"name": "dir", "requires_logging_directory": True})
    tracking.register_tracker_class(DirectoryTracker)
    with pytest.raises(ValueError, match="Logging with `dir` requires a `logging_dir`"):
        Trackers("dir")
    trackers = Trackers("dir", logging_dir=tmp_path)
    trackers.init("proj")
    assert trackers.get("dir").directory == (tmp_path,)


def test_register_tracker_class_refusals(registry):
    with pytest.raises(ValueError, match="cannot register <class 'dict'> as a tracker: .* not a subclass"):
        tracking.register_tracker_class(dict)
    Nameless = type("Nameless", (GeneralTracker,), {"requires_logging_directory": False})
    with pytest.raises(ValueError, match="set the class attribute `name`"):
        tracking.register_tracker_class(Nameless)
    All = type("All", (GeneralTracker,), {"name": "all", "requires_logging_directory": False})
    with pytest.raises(ValueError, match="`name` cannot be \"all\""):
        tracking.register_tracker_class(All)
    Shadow = type("Shadow", (GeneralTracker,), {"name": "wandb", "requires_logging_directory": False})
    with pytest.warns(UserWarning, match="Shadow replaces WandBTracker as the tracker named 'wandb'"):
        tracking.register_tracker_class(Shadow)
    assert registry["wandb"] is Shadow
