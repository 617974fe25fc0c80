"""Trackers that write files under ``<logging_dir>/<project_name>``: JSON lines (no dependency) and TensorBoard."""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import IO, Any

from .base import GeneralTracker, LibraryTracker, import_library, is_installed, plain, plain_values

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"


class JSONLinesTracker(GeneralTracker):
    """Writes ``<logging_dir>/<project_name>/metrics.jsonl`` -- one JSON object per `log` call,
    ``{"step": 3, "time": 1718000000.0, "values": {"loss": 2.1}}`` (``step`` null when not given, ``time`` in
    seconds since the epoch) -- and the init configuration to ``config.json`` beside it.

    Lines are appended, so a restarted run continues the same file; each line is flushed as it is written.
    Tensors and numpy values become numbers or lists; values JSON cannot hold are written as their ``str()``.
    """

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike) -> None:
        super().__init__()
        self.run_name = run_name
        self.directory = Path(logging_dir) / run_name
        self._file: IO[str] | None = None

    @property
    def metrics_path(self) -> Path:
        return self.directory / METRICS_FILE

    @property
    def config_path(self) -> Path:
        return self.directory / CONFIG_FILE

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._file = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115 -- open until finish()

    @property
    def tracker(self) -> IO[str] | None:
        """The open metrics file (None before `start` and after `finish`)."""
        return self._file

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(json.dumps(plain_values(values), indent=2, default=str) + "\n", encoding="utf-8")

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"the jsonl tracker takes no log options, got {sorted(kwargs)}")
        if self._file is None:
            raise RuntimeError("the jsonl tracker is not open: call start() (init_trackers) before log()")
        record = {"step": step, "time": time.time(), "values": plain_values(values)}
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardTracker(LibraryTracker):
    """Writes TensorBoard event files to ``<logging_dir>/<project_name>`` with ``torch.utils.tensorboard`` (needs
    the ``tensorboard`` package), or ``tensorboardX`` when only that is installed. Extra keyword arguments go to
    ``SummaryWriter``. Numbers are logged as scalars, strings as text, dicts of numbers as grouped scalars
    (``add_scalars``); other values are skipped with a warning. The config goes to ``add_hparams`` (values other
    than bool/int/float/str as their ``str()``)."""

    name = "tensorboard"
    requires_logging_directory = True
    module = "tensorboard"
    pip_package = "tensorboard"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.logging_dir = Path(logging_dir) / run_name
        self.init_kwargs = kwargs
        self.writer: Any = None

    @classmethod
    def installed(cls) -> bool:
        return is_installed("tensorboard") or is_installed("tensorboardX")

    def start(self) -> None:
        if is_installed("tensorboard"):
            from torch.utils.tensorboard import SummaryWriter
        else:
            SummaryWriter = import_library("tensorboardX", self.pip_package, self.name).SummaryWriter
        self.writer = SummaryWriter(log_dir=str(self.logging_dir), **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        """The ``SummaryWriter``."""
        return self.writer

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        hparams = {key: value if isinstance(value, (bool, int, float, str)) else str(value)
                   for key, value in plain_values(values).items()}
        self.writer.add_hparams(hparams, metric_dict={})
        self.writer.flush()

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            value = plain(value)
            if isinstance(value, (int, float)):  # bool included
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
            else:
                warnings.warn(f"tensorboard tracker: {key!r} was not logged: a {type(value).__name__} is not a "
                              "number, a str or a dict of numbers", stacklevel=3)
        self.writer.flush()

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()
