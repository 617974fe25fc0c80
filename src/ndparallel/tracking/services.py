"""Trackers for experiment-tracking services, each a thin translation onto its library's own API.

Every class is built as ``Cls(project_name, **init_kwargs)`` (aim: ``Cls(project_name, logging_dir, ...)``), where
``init_kwargs`` is ``init_trackers(..., init_kwargs={name: {...}})[name]``; keyword arguments go to the library's
run constructor and win over what the tracker would pass itself. The library is imported by ``start()``.
comet_ml, mlflow, clearml and dvclive skip values they cannot log as metrics with a warning, never silently;
wandb, trackio, swanlab and aim pass every value to the library (one-element tensors as numbers).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

from .base import LibraryTracker, plain, plain_values, scalar_values


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))


def _skipped(tracker: str, key: str, value: Any) -> None:
    warnings.warn(f"{tracker} tracker: {key!r} was not logged: it takes numbers as metrics, got a "
                  f"{type(value).__name__}", stacklevel=4)


class _RunTracker(LibraryTracker):
    """wandb, trackio and swanlab share one shape: ``lib.init(project=...)`` returns a run with ``config``,
    ``log(values, step=...)`` and ``finish()``. One-element tensors are logged as numbers (trackio skips tensors);
    other values go to the library unchanged (its own images, tables, histograms...)."""

    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run: Any = None

    def start(self) -> None:
        self.run = self.library().init(**{"project": self.run_name, **self.init_kwargs})

    @property
    def tracker(self) -> Any:
        """The library's run object."""
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log(scalar_values(values), step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class WandBTracker(_RunTracker):
    """Weights & Biases: ``wandb.init(project=project_name, **kwargs)``; the config may change values already set."""

    name = "wandb"
    module = pip_package = "wandb"

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)


class TrackioTracker(_RunTracker):
    """Trackio: ``trackio.init(project=project_name, **kwargs)``; the config joins the run's ``config``."""

    name = "trackio"
    module = pip_package = "trackio"


class SwanLabTracker(_RunTracker):
    """SwanLab: ``swanlab.init(project=project_name, **kwargs)``."""

    name = "swanlab"
    module = pip_package = "swanlab"


class CometMLTracker(LibraryTracker):
    """Comet: ``comet_ml.start(project_name=project_name, **kwargs)`` (``comet_ml.Experiment`` on versions without
    ``start``). Numbers go to ``log_metric``, strings to ``log_other``, a dict of numbers to ``log_metrics`` with
    its key as prefix."""

    name = "comet_ml"
    requires_logging_directory = False
    module = "comet_ml"
    pip_package = "comet-ml"

    def __init__(self, run_name: str | None, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.writer: Any = None

    def start(self) -> None:
        comet_ml = self.library()
        create = comet_ml.start if hasattr(comet_ml, "start") else comet_ml.Experiment
        self.writer = create(**{"project_name": self.run_name, **self.init_kwargs})

    @property
    def tracker(self) -> Any:
        """The Comet experiment."""
        return self.writer

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.writer.log_parameters(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if step is not None:
            self.writer.set_step(step)
        for key, value in plain_values(values).items():
            if _is_number(value):
                self.writer.log_metric(key, value, step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.log_other(key, value)
            elif isinstance(value, dict):
                self.writer.log_metrics(value, prefix=key, step=step, **kwargs)
            else:
                _skipped(self.name, key, value)

    def finish(self) -> None:
        self.writer.end()


class MLflowTracker(LibraryTracker):
    """MLflow: the experiment named `experiment_name` (``$MLFLOW_EXPERIMENT_NAME`` wins; created with
    `logging_dir` as its artifact location if it does not exist), then ``mlflow.start_run(**kwargs)`` in it.
    `tags` may be a JSON string; `nested_run` is ``start_run``'s ``nested``. Config values longer than MLflow's
    parameter limit are skipped with a warning; only numbers are logged as metrics."""

    name = "mlflow"
    requires_logging_directory = False
    module = pip_package = "mlflow"

    def __init__(self, experiment_name: str | None = None, logging_dir: str | os.PathLike | None = None,
                 tags: dict[str, Any] | str | None = None, nested_run: bool = False, **start_run_kwargs: Any) -> None:
        super().__init__()
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        self.logging_dir = logging_dir
        self.tags = json.loads(tags) if isinstance(tags, str) else tags
        self.nested_run = nested_run
        self.start_run_kwargs = start_run_kwargs
        self.active_run: Any = None

    def start(self) -> None:
        mlflow = self.library()
        experiment_id = None
        if self.experiment_name is not None:
            experiment = mlflow.get_experiment_by_name(self.experiment_name)
            experiment_id = experiment.experiment_id if experiment is not None else mlflow.create_experiment(
                self.experiment_name, artifact_location=None if self.logging_dir is None else str(self.logging_dir),
                tags=self.tags)
        self.active_run = mlflow.start_run(**{"experiment_id": experiment_id, "nested": self.nested_run,
                                              "tags": self.tags, **self.start_run_kwargs})

    @property
    def tracker(self) -> Any:
        """The active ``mlflow.ActiveRun``."""
        return self.active_run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        mlflow = self.library()
        limit = getattr(mlflow.utils.validation, "MAX_PARAM_VAL_LENGTH", 6000)
        batch = getattr(mlflow.utils.validation, "MAX_PARAMS_TAGS_PER_BATCH", 100)
        params = {}
        for key, value in values.items():
            if len(str(value)) > limit:
                warnings.warn(f"mlflow tracker: config {key!r} was not stored: MLflow parameters hold at most "
                              f"{limit} characters, this one has {len(str(value))}", stacklevel=3)
            else:
                params[key] = value
        items = list(params.items())
        for start in range(0, len(items), batch):  # MLflow takes a bounded number of parameters per call
            mlflow.log_params(dict(items[start:start + batch]))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        metrics = {}
        for key, value in plain_values(values).items():
            if _is_number(value):
                metrics[key] = value
            else:
                _skipped(self.name, key, value)
        self.library().log_metrics(metrics, step=step, **kwargs)

    def finish(self) -> None:
        self.library().end_run()


class AimTracker(LibraryTracker):
    """Aim: ``aim.Run(repo=logging_dir, **kwargs)`` named `project_name`; the config is stored as
    ``run["hparams"]``; each value is ``run.track``-ed (strings as ``aim.Text``)."""

    name = "aim"
    requires_logging_directory = True
    module = pip_package = "aim"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike = ".", **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.repo = logging_dir
        self.init_kwargs = kwargs
        self.writer: Any = None

    def start(self) -> None:
        self.writer = self.library().Run(**{"repo": str(self.repo), **self.init_kwargs})
        self.writer.name = self.run_name

    @property
    def tracker(self) -> Any:
        """The ``aim.Run``."""
        return self.writer

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.writer["hparams"] = plain_values(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in plain_values(values).items():
            if isinstance(value, str):
                value = self.library().Text(value)
            self.writer.track(value, name=key, step=step, **kwargs)

    def finish(self) -> None:
        self.writer.close()


class ClearMLTracker(LibraryTracker):
    """ClearML: the task already running (``Task.current_task()``, left open at `finish`), else
    ``Task.init(project_name=..., task_name=..., **kwargs)`` with both names from ``$CLEARML_PROJECT`` /
    ``$CLEARML_TASK`` or `project_name`. With a step, numbers are reported as scalars (a key's ``train_``,
    ``eval_`` or ``test_`` prefix picks the series, default ``train``); without one, as single values."""

    name = "clearml"
    requires_logging_directory = False
    module = pip_package = "clearml"

    def __init__(self, run_name: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.task: Any = None
        self._external = False

    def start(self) -> None:
        task_class = self.library().Task
        current = task_class.current_task()
        if current is not None:
            self.task, self._external = current, True
            return
        self.task = task_class.init(**{"project_name": os.environ.get("CLEARML_PROJECT", self.run_name),
                                       "task_name": os.environ.get("CLEARML_TASK", self.run_name),
                                       **self.init_kwargs})

    @property
    def tracker(self) -> Any:
        """The ClearML ``Task``."""
        return self.task

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.task.connect_configuration(values)

    @staticmethod
    def title_and_series(key: str) -> tuple[str, str]:
        for series in ("train", "eval", "test"):
            if key.startswith(series + "_"):
                return key[len(series) + 1:], series
        return key, "train"

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        logger = self.task.get_logger()
        for key, value in plain_values(values).items():
            if not _is_number(value):
                _skipped(self.name, key, value)
            elif step is None:
                logger.report_single_value(name=key, value=value, **kwargs)
            else:
                title, series = self.title_and_series(key)
                logger.report_scalar(title=title, series=series, value=value, iteration=step, **kwargs)

    def finish(self) -> None:
        if self.task is not None and not self._external:
            self.task.close()


class DVCLiveTracker(LibraryTracker):
    """DVCLive: ``dvclive.Live(**kwargs)`` (or the `live` object given); `run_name` is not used. Each `log` call
    is one DVCLive step: `step` sets it, else it follows the previous one."""

    name = "dvclive"
    requires_logging_directory = False
    module = pip_package = "dvclive"

    def __init__(self, run_name: str | None = None, live: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self.live = live
        self.init_kwargs = kwargs

    def start(self) -> None:
        if self.live is None:
            self.live = self.library().Live(**self.init_kwargs)

    @property
    def tracker(self) -> Any:
        """The ``dvclive.Live``."""
        return self.live

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.live.log_params(plain_values(values))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if step is not None:
            self.live.step = step
        for key, value in values.items():
            value = plain(value)
            if _is_number(value):
                self.live.log_metric(key, value, **kwargs)
            else:
                _skipped(self.name, key, value)
        self.live.next_step()

    def finish(self) -> None:
        self.live.end()
