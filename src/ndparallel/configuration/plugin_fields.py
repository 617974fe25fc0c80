"""Fields of the settings objects (`ndparallel.configuration.plugins`): `parse_bool`, how each reads a flag (as
launchers and YAML files spell it), and the FSDP plugin's ``activation_checkpointing`` (`ActivationCheckpointing`,
`parse_activation_checkpointing`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


TRUE_STRINGS, FALSE_STRINGS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bool(value: Any, what: str) -> bool:
    """A bool from a bool or a string such as "true" / "False" / "1" (how launchers and YAML files spell them)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in TRUE_STRINGS + FALSE_STRINGS:
        return value.strip().lower() in TRUE_STRINGS
    raise TypeError(f"{what} must be a bool (or 'true' / 'false'), got {value!r}")


@dataclass(frozen=True)
class ActivationCheckpointing:
    """Which blocks to checkpoint and what to keep: ``FullyShardedDataParallelPlugin(activation_checkpointing=...)``
    takes one of these (or a spelling of it, `parse_activation_checkpointing`).

    every: checkpoint blocks 0, every, 2*every, ... (1: all of them); the others keep their activations.
    policy: "full" recomputes a checkpointed block's whole forward in backward; "selective" keeps the outputs of its
        matrix multiplies and attention kernels and recomputes the rest (norms, activations, casts, reshapes: cheap
        to recompute, as large to keep).
    offload: the checkpointed blocks' inputs go to (pinned) host memory during forward and come back, prefetched,
        for backward (`ndparallel.parallel.memory.offload`); exact.
    """

    every: int = 1
    policy: str = "full"
    offload: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"activation_checkpointing every={self.every!r}: an int >= 1 (1: every block)")
        if self.policy not in CHECKPOINT_POLICIES:
            raise ValueError(f"activation_checkpointing policy={self.policy!r}: one of {list(CHECKPOINT_POLICIES)}")
        object.__setattr__(self, "offload", parse_bool(self.offload, "activation_checkpointing offload"))


CHECKPOINT_POLICIES = ("full", "selective")


def parse_activation_checkpointing(value: Any) -> bool | ActivationCheckpointing:
    """False (off), True (every block, full recompute) or an `ActivationCheckpointing`, from: a bool or its string;
    "full" / "selective"; an int k (every k-th block; also as a string); a dict of `ActivationCheckpointing`'s
    fields; or one of those."""
    if value is None:
        return False
    if isinstance(value, bool) or (isinstance(value, str) and value.strip().lower() in TRUE_STRINGS + FALSE_STRINGS):
        return parse_bool(value, "activation_checkpointing")
    if isinstance(value, ActivationCheckpointing):
        spec = value
    elif isinstance(value, dict):
        unknown = sorted(set(value) - {"every", "policy", "offload"})
        if unknown:
            raise ValueError(f"activation_checkpointing: unknown field(s) {unknown}; valid: ['every', 'policy', "
                             "'offload']")
        spec = ActivationCheckpointing(**value)
    elif isinstance(value, int) and not isinstance(value, bool):
        spec = ActivationCheckpointing(every=value)
    elif isinstance(value, str) and value.strip().isdigit():
        spec = ActivationCheckpointing(every=int(value))
    elif isinstance(value, str) and value.strip().lower() in CHECKPOINT_POLICIES:
        spec = ActivationCheckpointing(policy=value.strip().lower())
    else:
        raise TypeError(f"activation_checkpointing must be a bool, 'full', 'selective', an int k (every k-th block), "
                        f"a dict {{'every': k, 'policy': 'full' | 'selective', 'offload': bool}} or "
                        f"ActivationCheckpointing, got "
                        f"{value!r}")
    return True if spec == ActivationCheckpointing() else spec
