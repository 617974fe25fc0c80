"""`ndparallel.big_modeling`: Accelerate's `accelerate.big_modeling` names that apply here. `init_empty_weights`
(build a model without allocating its weights; home: `ndparallel.checkpoint.load_pretrained`) and
`attach_layerwise_casting_hooks` (keep weights in a small dtype between uses, for inference; home:
`ndparallel.parallel.layerwise_casting`)."""

from .checkpoint.load_pretrained import init_empty_weights
from .parallel.layerwise_casting import CASTABLE_LAYERS, attach_layerwise_casting_hooks

__all__ = ["CASTABLE_LAYERS", "attach_layerwise_casting_hooks", "init_empty_weights"]
