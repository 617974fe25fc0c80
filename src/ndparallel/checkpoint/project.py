"""Where checkpoints live: Accelerate's `ProjectConfiguration`, automatic naming, ``total_limit``, newest one.

With ``automatic_checkpoint_naming=True``, ``save_state()`` writes ``<project_dir>/checkpoints/checkpoint_<i>``
with i the larger of ``iteration`` and one past the highest number already in the folder (so a new checkpoint
always has the highest number, also in a folder an earlier run filled), then sets ``iteration`` to i + 1. It then
keeps the newest ``total_limit`` complete checkpoints of the folder -- never deleting the one just written -- and
``load_state()`` without a directory loads the complete checkpoint with the highest i -- never a directory a
crash left half written -- or, when that one is damaged, the newest one that verifies.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

from .storage import OLD_SUFFIX, PARTIAL_SUFFIX, is_complete_checkpoint

CHECKPOINTS_DIR = "checkpoints"
_NAME = re.compile(r"checkpoint_(\d+)")


@dataclass
class ProjectConfiguration:
    """Accelerate's project settings that concern checkpoints.

    - project_dir: root of the project; automatic checkpoints go to ``<project_dir>/checkpoints``.
    - logging_dir: where trackers (`ndparallel.tracking`) write; defaults to `project_dir`.
    - automatic_checkpoint_naming: name checkpoints ``checkpoint_<iteration>`` and find the newest one (needs a
      project_dir, here or given to the Accelerator: it checks).
    - total_limit: keep at most this many automatic checkpoints in the folder (the lowest-numbered are deleted
      after a save; the one just written always has the highest number and is kept).
    - iteration: lowest number of the next automatic checkpoint (a higher one is taken when the folder already
      holds ``checkpoint_<iteration>`` or higher); set past the loaded one by ``load_state``.
    - save_on_each_node: not supported (checkpoints need a filesystem shared by all nodes); warns if set.
    """

    project_dir: str | os.PathLike | None = None
    logging_dir: str | os.PathLike | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
        if self.total_limit is not None and (isinstance(self.total_limit, bool) or not isinstance(self.total_limit, int)
                                             or self.total_limit < 1):
            raise ValueError(f"total_limit must be an int >= 1 or None, got {self.total_limit!r}")
        if isinstance(self.iteration, bool) or not isinstance(self.iteration, int) or self.iteration < 0:
            raise ValueError(f"iteration must be an int >= 0, got {self.iteration!r}")
        if self.save_on_each_node:
            warnings.warn("ProjectConfiguration(save_on_each_node=True) is ignored: ndparallel writes one checkpoint "
                          "to a filesystem that every node shares", stacklevel=3)

    def set_directories(self, project_dir: str | os.PathLike | None = None) -> None:
        """Set `project_dir` (and `logging_dir`, when it was unset), as Accelerate's method of that name."""
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    @property
    def checkpoints_dir(self) -> Path:
        if self.project_dir is None:
            raise ValueError("no project_dir: pass Accelerator(project_dir=...) or a ProjectConfiguration")
        return Path(self.project_dir) / CHECKPOINTS_DIR


def checkpoint_number(path: Path) -> int | None:
    match = _NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete ``checkpoint_<i>`` directories under `directory`, oldest (lowest i) first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if checkpoint_number(p) is not None and is_complete_checkpoint(p)]
    return sorted(found, key=checkpoint_number)


def next_number(directory: Path, iteration: int) -> int:
    """The number of the next automatic checkpoint: `iteration`, or one past the highest ``checkpoint_<i>`` in
    `directory` (complete or not, file or directory) if that is higher -- never an existing name."""
    taken = [checkpoint_number(p) for p in directory.iterdir()] if directory.is_dir() else []
    return max([iteration, *(n + 1 for n in taken if n is not None)])


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in `directory` (a project's ``checkpoints`` folder), or None.

    A project directory works too: its ``checkpoints`` subfolder is searched.
    """
    directory = Path(directory)
    if (directory / CHECKPOINTS_DIR).is_dir():
        directory = directory / CHECKPOINTS_DIR
    found = complete_checkpoints(directory)
    return found[-1] if found else None


def prune(directory: Path, total_limit: int | None, keep: Path) -> list[Path]:
    """Rank 0, after the save of `keep`: delete the oldest complete checkpoints beyond `total_limit` (never
    `keep`), and leftovers of interrupted saves. Returns the deleted checkpoints."""
    removed = []
    if total_limit is not None:
        found = [p for p in complete_checkpoints(directory) if p != keep]
        for path in found[: max(0, len(found) + 1 - total_limit)]:
            doomed = path.parent / f".{path.name}.deleting"
            os.rename(path, doomed)  # atomic: a crash mid-delete leaves no half-deleted "complete" checkpoint
            shutil.rmtree(doomed)
            removed.append(path)
    for leftover in directory.iterdir():
        stale = leftover.name.endswith((".deleting", PARTIAL_SUFFIX, OLD_SUFFIX))
        if leftover.name.startswith(".checkpoint_") and stale:
            shutil.rmtree(leftover, ignore_errors=True)
    return removed
