"""What every tracker shares: `GeneralTracker` (the class users subclass), `LoggerType` (the names), and the two
helpers the built-in trackers use -- importing a tracker's library with an error that says what to install, and
turning tensors and numpy scalars into plain Python values.

A tracker knows nothing about processes: `Trackers` (trackers.py) decides which process calls it.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any, ClassVar


class _ContainsByValue(enum.EnumMeta):
    """Lets ``"wandb" in LoggerType`` answer True/False (a plain Enum raises TypeError on a str in Python 3.11)."""

    def __contains__(cls, item: object) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class LoggerType(str, enum.Enum, metaclass=_ContainsByValue):
    """The tracker names `log_with=` accepts (Accelerate's, plus ``JSONL``: ndparallel's dependency-free tracker).

    A member equals its string (``LoggerType.WANDB == "wandb"``) and prints as it (``str(LoggerType.WANDB)``).
    ``ALL`` means every tracker whose library is installed, plus ``JSONL``.
    """

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    TRACKIO = "trackio"
    JSONL = "jsonl"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        """Every member's string, in definition order."""
        return [member.value for member in cls]


class GeneralTracker:
    """Base class of every tracker, built-in or yours; pass an instance in ``Accelerator(log_with=...)``.

    A subclass sets two class attributes and overrides the methods it needs (the base ones do nothing):

    - ``name`` (str): what ``log_kwargs``/``init_kwargs`` keys and ``get_tracker(name)`` call it;
    - ``requires_logging_directory`` (bool): for a tracker chosen by name (built-in, or registered with
      `register_tracker_class`), whether it is built as ``cls(project_name, logging_dir, **kwargs)`` rather than
      ``cls(project_name, **kwargs)`` -- and refused when no logging directory is set; unused for tracker objects;
    - ``main_process_only`` (bool, default True): False makes `Trackers` start, log and finish it on every process.

    ``start()`` opens the run (called by ``init_trackers``, so constructing a tracker touches nothing), then
    ``store_init_configuration(config)`` once if a config was given, ``log(values, step, **kwargs)`` per
    ``accelerator.log``, ``finish()`` at ``end_training``. ``tracker`` is the library's own object (a wandb run,
    a SummaryWriter...); the base returns the tracker itself.
    """

    name: ClassVar[str]
    requires_logging_directory: ClassVar[bool]
    main_process_only: ClassVar[bool] = True

    def __init__(self) -> None:
        problems = tracker_problems(self)
        if problems:
            raise TypeError(f"{type(self).__name__} cannot be used as a tracker: {'; '.join(problems)}")

    def start(self) -> None:
        """Open the run. Called once by ``init_trackers``, before anything is stored or logged."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record `values` (hyperparameters) for the run."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record `values` (metrics) at `step` (None: the library's own counter, or no step)."""

    def finish(self) -> None:
        """Close the run (flush files, end the remote run)."""

    @property
    def tracker(self) -> Any:
        """The underlying library object; a tracker that wraps none is its own."""
        return self


def tracker_problems(tracker: GeneralTracker | type) -> list[str]:
    """What stops `tracker` (a tracker object, or a class to register) from being used (empty when it is fine)."""
    if not (isinstance(tracker, GeneralTracker) or (isinstance(tracker, type) and issubclass(tracker, GeneralTracker))):
        return [f"{tracker!r} is not a subclass of ndparallel.tracking.GeneralTracker"]
    problems = []
    name = getattr(tracker, "name", None)
    if not isinstance(name, str) or not name:
        problems.append("set the class attribute `name` to a non-empty str (e.g. name = \"my_tracker\")")
    elif name == LoggerType.ALL.value:
        problems.append("`name` cannot be \"all\", which log_with reserves for every installed tracker")
    if not isinstance(getattr(tracker, "requires_logging_directory", None), bool):
        problems.append("set the class attribute `requires_logging_directory` to True or False")
    if not isinstance(getattr(tracker, "main_process_only", True), bool):
        problems.append("`main_process_only` must be True or False")
    return problems


class LibraryTracker(GeneralTracker):
    """A built-in tracker backed by a third-party library: `module` is imported by `start()`, `pip_package` is
    what the error tells the user to install."""

    module: ClassVar[str]
    pip_package: ClassVar[str]

    @classmethod
    def installed(cls) -> bool:
        return is_installed(cls.module)

    @classmethod
    def library(cls) -> ModuleType:
        """Import `module`, or raise an ImportError that names the pip package to install."""
        return import_library(cls.module, cls.pip_package, cls.name)


def is_installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it (a ``sys.modules`` entry of None counts as absent)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_library_error(module: str, pip_package: str, tracker: str) -> ImportError:
    return ImportError(f"log_with={tracker!r} needs the `{module}` library, which is not installed: "
                       f"run `pip install {pip_package}`, or leave {tracker!r} out of log_with")


def import_library(module: str, pip_package: str, tracker: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        if error.name is not None and error.name != module and not module.startswith(error.name + "."):
            raise  # the library is there but one of *its* imports failed: show that error unchanged
        raise missing_library_error(module, pip_package, tracker) from error


def plain(value: Any) -> Any:
    """`value` with tensors and numpy values turned into Python numbers or lists (one-element tensors into a
    number); mappings, lists and tuples converted item by item; anything else unchanged."""
    if isinstance(value, (str, bytes, bool, int, float)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if hasattr(value, "tolist") and hasattr(value, "item"):  # a torch tensor, a numpy array or scalar
        return value.item() if _one_element(value) else value.tolist()
    return value


def scalar_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` with one-element tensors and numpy scalars turned into Python numbers, everything else unchanged
    (for libraries that take their own objects -- images, tables, histograms -- but not a torch scalar)."""
    return {key: plain(value) if _one_element(value) else value for key, value in values.items()}


def _one_element(value: Any) -> bool:
    numel = getattr(value, "numel", None) or getattr(value, "size", None)
    if not (hasattr(value, "tolist") and hasattr(value, "item")) or numel is None:
        return False
    return (numel() if callable(numel) else numel) == 1


def plain_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """`plain` applied to each value of a metrics or config dict."""
    return {key: plain(value) for key, value in values.items()}
