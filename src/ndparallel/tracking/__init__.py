"""Experiment tracking with Accelerate's ``log_with=`` API.

    accelerator = Accelerator(log_with=["jsonl", "tensorboard"], project_dir="runs")
    accelerator.init_trackers("my_project", config={"lr": 1e-3}, init_kwargs={"tensorboard": {"flush_secs": 30}})
    accelerator.log({"loss": loss}, step=step)          # main process only; a no-op elsewhere
    accelerator.end_training()                          # closes every tracker

Trackers: "jsonl" (no dependency: ``<logging_dir>/<project>/metrics.jsonl`` and ``config.json``), "tensorboard",
"wandb", "mlflow", "trackio", "swanlab", "comet_ml", "aim", "clearml", "dvclive" (each through its own library;
naming one that is not installed raises an ImportError that says what to ``pip install``), "all" (every installed
one, plus jsonl), or your own `GeneralTracker` subclass, as an object or registered by name with
`register_tracker_class`.

base.py      GeneralTracker, LoggerType, importing a tracker's library, plain values from tensors
files.py     the trackers that write files: JSON lines, TensorBoard
services.py  the trackers of tracking services and their libraries
trackers.py  Trackers (what the Accelerator holds: choice, main-process rule, init/log/get/finish), registry
progress.py  the main process's progress bar
"""

from .base import GeneralTracker, LoggerType
from .files import JSONLinesTracker, TensorBoardTracker
from .progress import progress_bar
from .services import (
    AimTracker,
    ClearMLTracker,
    CometMLTracker,
    DVCLiveTracker,
    MLflowTracker,
    SwanLabTracker,
    TrackioTracker,
    WandBTracker,
)
from .trackers import TRACKER_CLASSES, Trackers, get_available_trackers, register_tracker_class

__all__ = [
    "TRACKER_CLASSES",
    "AimTracker",
    "ClearMLTracker",
    "CometMLTracker",
    "DVCLiveTracker",
    "GeneralTracker",
    "JSONLinesTracker",
    "LoggerType",
    "MLflowTracker",
    "SwanLabTracker",
    "TensorBoardTracker",
    "Trackers",
    "TrackioTracker",
    "WandBTracker",
    "get_available_trackers",
    "progress_bar",
    "register_tracker_class",
]
