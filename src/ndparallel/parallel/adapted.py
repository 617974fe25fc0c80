"""Models adapted by PEFT, as the parallel steps see them: the transformers model inside a ``PeftModel`` (whose plan,
config and forward signature the steps read), and the wrapper PEFT puts around each targeted layer."""

from __future__ import annotations

from torch import nn


def is_peft_model(model: nn.Module) -> bool:
    """A PEFT model (``PeftModel`` and its task classes): the one test of it in the package."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def adapter_free(model: nn.Module) -> nn.Module:
    """The model a plan, a config or a forward signature belongs to: under a PEFT model, the transformers model it
    adapts; any other model is itself. `parallelize` peels it once, into its `ndparallel.parallel.target.Target`."""
    return model.get_base_model() if is_peft_model(model) else model


def is_adapter_wrapper(module: nn.Module) -> bool:
    """A PEFT tuner layer: a module that wraps the original layer as ``base_layer``."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and hasattr(module, "active_adapters")
