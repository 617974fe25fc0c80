"""A progress bar drawn by the main process only (Accelerate's ``accelerator.progress_bar`` / ``utils.progress_bar``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def progress_bar(iterable: Iterable[Any] | None = None, *, main_process: bool = True, **kwargs: Any):
    """A tqdm progress bar, shown only when `main_process` is True."""
    from tqdm.auto import tqdm

    disable = kwargs.pop("disable", False)
    return tqdm(iterable, disable=disable or not main_process, **kwargs)
