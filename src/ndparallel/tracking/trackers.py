"""`Trackers`: the trackers one Accelerator logs to, chosen by ``log_with``, and which process runs each.

Every process builds the same `Trackers` and calls ``init`` / ``log`` / ``finish`` at the same points; each
tracker runs only on the main process unless its ``main_process_only`` is False. The bookkeeping (initialised,
finished) is the same on every process, so a misuse raises the same error on all of them.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .base import GeneralTracker, LibraryTracker, LoggerType, missing_library_error, tracker_problems
from .files import JSONLinesTracker, TensorBoardTracker
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

LogWith = str | LoggerType | GeneralTracker | Sequence[str | LoggerType | GeneralTracker] | None

BUILTIN_TRACKERS: dict[str, type[GeneralTracker]] = {cls.name: cls for cls in (
    TensorBoardTracker, WandBTracker, MLflowTracker, TrackioTracker, SwanLabTracker, CometMLTracker, AimTracker,
    ClearMLTracker, DVCLiveTracker, JSONLinesTracker)}
# Names `log_with` accepts: the built-in trackers and the classes passed to `register_tracker_class`.
TRACKER_CLASSES: dict[str, type[GeneralTracker]] = dict(BUILTIN_TRACKERS)

_NO_DIRECTORY = ("pass Accelerator(project_dir=...) or Accelerator(project_config=ProjectConfiguration("
                 "logging_dir=...))")


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Make `tracker_class` usable by its ``name`` in ``log_with``, like a built-in tracker (register it before
    building the Accelerator). It is built as ``tracker_class(project_name, **init_kwargs[name])``, with the
    logging directory as second argument when ``requires_logging_directory`` is True. Registering a name that
    is taken replaces that class, with a warning."""
    problems = tracker_problems(tracker_class)
    if problems:
        raise ValueError(f"cannot register {tracker_class!r} as a tracker: {'; '.join(problems)}")
    if tracker_class.name in TRACKER_CLASSES and TRACKER_CLASSES[tracker_class.name] is not tracker_class:
        warnings.warn(f"register_tracker_class: {tracker_class.__name__} replaces "
                      f"{TRACKER_CLASSES[tracker_class.name].__name__} as the tracker named {tracker_class.name!r}",
                      stacklevel=2)
    TRACKER_CLASSES[tracker_class.name] = tracker_class


def is_available(tracker_class: type[GeneralTracker]) -> bool:
    """Whether `tracker_class` can start here: its library is installed (always, for a tracker that needs none)."""
    return not issubclass(tracker_class, LibraryTracker) or tracker_class.installed()


def get_available_trackers() -> list[str]:
    """Names of the built-in trackers whose library is installed ("jsonl" always): what ``log_with="all"`` picks."""
    return [name for name, cls in BUILTIN_TRACKERS.items() if is_available(cls)]


class _NoOpTracker(GeneralTracker):
    """What `Trackers.get` gives a process that does not run the tracker: every method does nothing."""

    requires_logging_directory = False

    def __init__(self, name: str) -> None:
        self.name = name  # per instance: stands in for any tracker

    @property
    def tracker(self) -> None:
        return None


class Trackers:
    """The trackers of one Accelerator.

    - log_with: a tracker name (`LoggerType` or str: a built-in's or a registered class's), ``"all"``, a
      `GeneralTracker` instance, or a list of them; None for no tracking. Names are checked here: unknown ones,
      missing libraries and a missing logging directory raise now, not at ``init``. ``"all"`` adds every
      installed built-in tracker (`get_available_trackers`); those that write files are left out, with a
      warning, when there is no logging directory.
    - logging_dir: where the file-writing trackers (jsonl, tensorboard, aim) write: ``<logging_dir>/<project>``.
    - is_main_process: whether this process runs the trackers whose ``main_process_only`` is True (all built-in).
    """

    def __init__(self, log_with: LogWith = None, logging_dir: str | os.PathLike | None = None,
                 is_main_process: bool = True) -> None:
        self.logging_dir = logging_dir
        self.is_main_process = bool(is_main_process)
        self._requested = self._resolve(log_with)
        self._running: list[GeneralTracker] | None = None  # None: not initialised (or finished)
        self._finished = False

    # -- choosing the trackers -------------------------------------------------------------------------------------

    def _resolve(self, log_with: LogWith) -> list[type[GeneralTracker] | GeneralTracker]:
        if log_with is None:
            return []
        entries = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
        instances = [entry for entry in entries if isinstance(entry, GeneralTracker)]
        names: list[str] = []
        for entry in entries:
            if isinstance(entry, GeneralTracker):
                problems = tracker_problems(entry)
                if problems:
                    raise TypeError(f"log_with got a {type(entry).__name__} that is not a usable tracker: "
                                    f"{'; '.join(problems)}")
            elif isinstance(entry, str):  # LoggerType members are str
                if str(entry) not in names:
                    names.append(str(entry))
            elif isinstance(entry, type) and issubclass(entry, GeneralTracker):
                raise TypeError(f"log_with got the class {entry.__name__}: pass an instance ({entry.__name__}(...)), "
                                "or register_tracker_class(...) it and pass its name")
            else:
                raise TypeError(f"log_with takes tracker names (str or LoggerType), GeneralTracker instances or a "
                                f"list of them, got {type(entry).__name__}: {entry!r}")

        given = [tracker.name for tracker in instances]
        chosen: list[str] = []
        for name in names:
            if name == LoggerType.ALL.value:
                continue
            if name not in TRACKER_CLASSES:
                raise ValueError(f"log_with: unknown tracker {name!r}; valid names: "
                                 f"{', '.join(['all', *TRACKER_CLASSES])}")
            cls = TRACKER_CLASSES[name]
            if name in given:
                raise ValueError(f"log_with names {name!r} and also gives a tracker object named {name!r}: keep one")
            if not is_available(cls):
                raise missing_library_error(cls.module, cls.pip_package, name)
            if cls.requires_logging_directory and self.logging_dir is None:
                raise ValueError(f"Logging with `{name}` requires a `logging_dir`, and none is set: {_NO_DIRECTORY}")
            chosen.append(name)
        if LoggerType.ALL.value in names:
            skipped = []
            for name in get_available_trackers():
                if name in chosen or name in given:
                    continue
                if BUILTIN_TRACKERS[name].requires_logging_directory and self.logging_dir is None:
                    skipped.append(name)
                else:
                    chosen.append(name)
            if skipped:
                self._warn(f"log_with='all' leaves out {', '.join(skipped)}: they write files and no logging "
                           f"directory is set ({_NO_DIRECTORY})", stacklevel=4)
        seen: set[str] = set()
        for name in [*given, *chosen]:
            if name in seen:
                raise ValueError(f"log_with has two trackers named {name!r}: get_tracker({name!r}) could not tell "
                                 "them apart; give each a different `name`")
            seen.add(name)
        return [*instances, *(TRACKER_CLASSES[name] for name in chosen)]

    def _warn(self, message: str, stacklevel: int) -> None:
        """Warn once, from the main process (errors, by contrast, are raised on every process)."""
        if self.is_main_process:
            warnings.warn(message, stacklevel=stacklevel + 1)

    @property
    def log_with(self) -> list[LoggerType | str | GeneralTracker]:
        """The trackers chosen, as Accelerate's ``accelerator.log_with``: built-in names as `LoggerType`, registered
        names as str, tracker objects as given."""
        return [entry if not isinstance(entry, type) else LoggerType(entry.name) if entry.name in LoggerType
                else entry.name for entry in self._requested]

    @property
    def names(self) -> list[str]:
        """The names of the trackers chosen (on every process, whichever runs them)."""
        return [entry.name for entry in self._requested]

    def _runs_here(self, entry: type[GeneralTracker] | GeneralTracker) -> bool:
        return self.is_main_process or not entry.main_process_only

    # -- the run ---------------------------------------------------------------------------------------------------

    @property
    def trackers(self) -> list[GeneralTracker]:
        """The trackers started on this process (empty before `init`, and on a process that runs none)."""
        return list(self._running or [])

    def __iter__(self) -> Iterator[GeneralTracker]:
        return iter(self.trackers)

    def __len__(self) -> int:
        return len(self.trackers)

    def __getitem__(self, index: int) -> GeneralTracker:
        """``accelerator.trackers[0]``, as with Accelerate's list of started trackers."""
        return self.trackers[index]

    def init(self, project_name: str | None, config: Mapping[str, Any] | None = None,
             init_kwargs: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Start a run on every tracker this process runs (Accelerate's ``init_trackers``): build the named ones as
        ``cls(project_name, [logging_dir,] **init_kwargs[name])``, call ``start()`` on each, then
        ``store_init_configuration(config)`` when a config is given. Call it on every process. Once per run: a
        second call raises until `finish` ends the run."""
        if self._running is not None:
            raise RuntimeError("init_trackers was already called: call end_training() (Trackers.finish) before "
                               "starting another run")
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"config must be a dict of hyperparameters (e.g. vars(args)), got {type(config).__name__}")
        init_kwargs = self._per_tracker(init_kwargs, "init_kwargs")
        named = [entry for entry in self._requested if isinstance(entry, type)]
        if named and not isinstance(project_name, str):
            raise TypeError(f"project_name must be a str (the run's name; file trackers write to "
                            f"<logging_dir>/<project_name>), got {project_name!r}")
        for entry in self._requested:
            if not isinstance(entry, type) and entry.name in init_kwargs:
                self._warn(f"init_kwargs[{entry.name!r}] is ignored: that tracker was passed to log_with as an "
                           "object, already built; give its options to its constructor", stacklevel=3)

        running: list[GeneralTracker] = []
        try:
            for entry in self._requested:
                if not self._runs_here(entry):
                    continue
                if isinstance(entry, type):  # chosen by name: built here
                    directory = (self.logging_dir,) if entry.requires_logging_directory else ()
                    entry = entry(project_name, *directory, **init_kwargs.get(entry.name, {}))
                entry.start()
                running.append(entry)
            if config is not None:
                for tracker in running:
                    tracker.store_init_configuration(dict(config))
        except BaseException:
            _finish_all(running, raise_first=False)
            raise
        self._running = running
        self._finished = False

    def log(self, values: Mapping[str, Any], step: int | None = None,
            log_kwargs: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Log `values` at `step` to every tracker this process runs; ``log_kwargs[name]`` goes to that tracker's
        ``log``. With no tracker chosen, does nothing (as Accelerate); otherwise `init` must come first."""
        if not self._requested:
            return
        if self._running is None:
            raise RuntimeError("accelerator.log() was called before accelerator.init_trackers(project_name)"
                               if not self._finished else
                               "accelerator.log() was called after end_training() closed the trackers")
        if not isinstance(values, Mapping):
            raise TypeError(f"values must be a dict of name -> value, got {type(values).__name__}")
        if step is not None:
            try:
                step = int(step.__index__())
            except (AttributeError, TypeError):
                raise TypeError(f"step must be an int or None, got {type(step).__name__}: {step!r}") from None
        log_kwargs = self._per_tracker(log_kwargs, "log_kwargs")
        for tracker in self._running:
            tracker.log(dict(values), step=step, **log_kwargs.get(tracker.name, {}))

    def get(self, name: str, unwrap: bool = False) -> Any:
        """The tracker named `name` (Accelerate's ``get_tracker``); with ``unwrap=True``, its library object
        (``tracker.tracker``). On a process that does not run it, a tracker whose methods do nothing (whatever
        `unwrap`), so code that logs through it runs on every process."""
        if name not in self.names:
            raise ValueError(f"no tracker named {name!r}; log_with chose "
                             f"{', '.join(map(repr, self.names)) if self.names else 'none'}")
        if self._running is None:
            raise RuntimeError(f"get_tracker({name!r}) was called before init_trackers(project_name)"
                               if not self._finished else f"get_tracker({name!r}) was called after end_training()")
        for tracker in self._running:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        return _NoOpTracker(name)

    def finish(self) -> None:
        """Call ``finish()`` on every running tracker (all of them, even if one raises; the first error is then
        raised). Does nothing when no run is open, so ``end_training`` can always call it."""
        if self._running is None:
            return
        running, self._running, self._finished = self._running, None, True
        _finish_all(running, raise_first=True)

    def _per_tracker(self, kwargs: Mapping[str, Mapping[str, Any]] | None, what: str) -> dict[str, dict[str, Any]]:
        """`kwargs` ({tracker name: {option: value}}) checked; names of no chosen tracker warn (a typo, usually)."""
        if kwargs is None:
            return {}
        if not isinstance(kwargs, Mapping) or not all(isinstance(v, Mapping) for v in kwargs.values()):
            raise TypeError(f"{what} must map a tracker name to a dict of options, e.g. "
                            f"{{'wandb': {{'tags': ['a']}}}}, got {kwargs!r}")
        unknown = [name for name in kwargs if name not in self.names]
        if unknown:
            self._warn(f"{what} for {', '.join(map(repr, unknown))} ignored: no such tracker in log_with "
                       f"(chosen: {', '.join(map(repr, self.names)) or 'none'})", stacklevel=4)
        return {str(name): dict(options) for name, options in kwargs.items()}


def _finish_all(trackers: list[GeneralTracker], raise_first: bool) -> None:
    first: BaseException | None = None
    for tracker in trackers:
        try:
            tracker.finish()
        except Exception as error:  # noqa: BLE001 -- close the others first, then raise the first error
            first = first or error
    if first is not None and raise_first:
        raise first
