"""The ways in for tools people already train with, in one place.

- `trainer`: the Hugging Face ``Trainer`` -- and what builds on it, TRL's ``SFTTrainer`` among them -- trains on
  ndparallel's N-D layouts when it is asked for one: under ``ndparallel launch`` with sizes, or with
  ``TrainingArguments(parallelism_config=ndparallel.ParallelismConfig(...))`` under any launcher. Its
  ``Accelerator`` is then ndparallel's, and the few Trainer steps that depend on the layout (the loss's token count,
  context-parallel inputs, saving and resuming) take ndparallel's route; everything else is the Trainer's own.
- `axolotl`: Axolotl's configs (``ndparallel launch ... -m axolotl.cli.train config.yml``): its N-D keys become the
  launch's sizes, and the few places where its code assumes stock Accelerate on CUDA (the device mesh, the device map,
  its ring-attention context parallelism, saving on one rank) take ndparallel's route; the rest is the Trainer's.
- `guard`: under ``ndparallel launch`` with sizes, a plain Accelerate ``Accelerator`` (which would train something
  else than the sizes asked for, without a word) is refused with what to do instead.

Each attaches when its module is first imported (`ndparallel.launch.worker.after_import`): importing ndparallel (which
a script that passes an ndparallel config does) registers them, and so does the launcher's worker before the script
imports anything (the Trainer's and the guard when the launch has sizes; Axolotl's always, and it acts only under
``ndparallel launch``). Nothing else in the library patches another project.
"""

from __future__ import annotations

from types import ModuleType

from ..launch.worker import AXOLOTL_HOOKS, INTEGRATION_HOOKS, after_import

__all__ = ["enable", "on_import"]


def on_import(module: ModuleType) -> None:
    """Attach the integration of `module` (one of `ndparallel.launch.worker.INTEGRATION_HOOKS`), once it is imported."""
    if module.__name__ == "transformers.trainer":
        from . import trainer

        trainer.install(module)
    elif module.__name__ == "accelerate.accelerator":
        from . import guard

        guard.install(module)
    elif module.__name__ in AXOLOTL_HOOKS:
        from . import axolotl

        axolotl.install(module)


def enable() -> None:
    """Attach the integrations when (or now, if) transformers' Trainer, Accelerate and Axolotl are imported."""
    for name in INTEGRATION_HOOKS + AXOLOTL_HOOKS:
        after_import(name, f"{__name__}:on_import")
