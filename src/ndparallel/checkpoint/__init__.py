"""Checkpoints: crash-safe save and exact resume across layouts, pretrained weights into sharded models, and
Hugging Face export. The Accelerator's methods (`save_state`, `load_state`, `save_model`, `get_state_dict`,
`register_for_checkpointing`) call into this package; see docs/checkpoints.md.

- `storage`: staging directory + atomic rename (replacing only a previous checkpoint), metadata file, checksums,
  safe reading, plain-words write errors (disk full, permission);
- `project`: `ProjectConfiguration`, automatic naming, ``total_limit``, the newest complete checkpoint;
- `manifest`: the metadata file, tensor names and shapes, tied names: what is checked before anything loads;
- `validate`: the values of the small files and metadata fields, checked before anything loads;
- `verify`: the whole check before a load (what was saved against what is prepared, checksums, DCP metadata, the
  small states), and the newest complete checkpoint of a project that verifies;
- `training_state`: what `save_state` / `load_state` write and read, from the Accelerator's record of prepared objects;
- `background`: ``save_state(async_save=True)``: host copies of the state, the writer thread, waiting for it;
- `positional`: optimizers of no single prepared model, saved by position (every rank its own), loaded only under
  the layout they were saved under;
- `state_dicts`: a model's and optimizer's sharded state dicts as torch makes them, without its naming pass each call;
- `export`: `save_model`, `get_state_dict`, `merge_weights` (``ndparallel merge-weights``);
- `adapters`: PEFT models saved as PEFT saves them (the adapter), or with their LoRA merged in;
- `load_pretrained`: ``cpu_ram_efficient_loading`` and `init_empty_weights`.
"""

from .adapters import adapter_state_dict, is_peft_model, save_adapter
from .background import wait as wait_for_saves
from .export import get_state_dict, merge_weights, save_model
from .load_pretrained import announce, init_empty_weights, parallelize_loading_weights
from .manifest import read_metadata
from .project import ProjectConfiguration, latest_checkpoint
from .storage import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from .training_state import FULL, SHARDED, RunRecord, load_state, save_state

__all__ = [
    "adapter_state_dict",
    "is_peft_model",
    "save_adapter",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "FULL",
    "ProjectConfiguration",
    "RunRecord",
    "SHARDED",
    "announce",
    "get_state_dict",
    "init_empty_weights",
    "latest_checkpoint",
    "load_state",
    "merge_weights",
    "parallelize_loading_weights",
    "read_metadata",
    "save_model",
    "save_state",
    "wait_for_saves",
]
