"""Layouts: every way to split a world of GPUs over pp x dp_replicate x dp_shard x cp x sp x tp, and why the library
accepts or refuses each.

The checks are the library's own, restated without a model or a process group (the library raises at ``prepare``
or at the first batch; the planner says it before anything runs):

- tp divides num_attention_heads, num_key_value_heads, intermediate_size and vocab_size (`parallel.tensor.check_plan`;
  the LM head is split along the vocabulary), and stays inside a node unless allowed across;
- sp x tp divides num_attention_heads (Ulysses gives each rank whole heads: `parallel.sequence.ulysses.check_heads`);
- the sequence splits: a multiple of 2 x cp (the load-balanced layout's chunks), each cp rank's share a multiple of
  sp (`parallel.sequence.layout`);
- cp/sp attention computes no logit soft-capping;
- dp_replicate x dp_shard divides the global batch's samples (each data-parallel rank gets whole samples);
- pipeline stages (`parallel.pipeline`): at least one decoder layer per stage, and each micro-step's rows split into
  the default schedule's micro-batches (one per stage).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..config import AXES  # the mesh's order, outermost first
from .model import ModelSpec


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    sp: int = 1
    tp: int = 1
    pp: int = 1  # last, so that positional construction keeps its meaning; outermost in the mesh (AXES)

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.sp * self.tp

    @property
    def batch(self) -> int:
        """Ranks that receive different samples (the ``batch`` view)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """Ranks FSDP2 shards parameters over (the ``fsdp`` view: dp_shard x cp x sp)."""
        return self.dp_shard * self.cp * self.sp

    @property
    def seq_split(self) -> int:
        return self.cp * self.sp

    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def name(self) -> str:
        """Compact name, the sizes other than 1: ``dp_shard=4,tp=2`` (``single`` for one GPU)."""
        return ",".join(f"{a}={s}" for a, s in self.sizes().items() if s > 1) or "single"

    def config_kwargs(self) -> dict[str, int]:
        """``ParallelismConfig`` keyword arguments (every size, explicit)."""
        return {f"{axis}_size": size for axis, size in self.sizes().items()}

    def config_line(self) -> str:
        args = ", ".join(f"{axis}_size={size}" for axis, size in self.sizes().items() if size > 1)
        return f"ParallelismConfig({args})"

    def group(self, axes: tuple[str, ...], rank: int = 0) -> list[int]:
        """Global ranks of the group over `axes` that contains `rank` (ranks laid out in mesh order)."""
        sizes = self.sizes()
        strides, stride = {}, 1
        for axis in reversed(AXES):
            strides[axis] = stride
            stride *= sizes[axis]
        base = rank
        for axis in axes:
            base -= ((rank // strides[axis]) % sizes[axis]) * strides[axis]
        ranks = [base]
        for axis in axes:
            ranks = [r + i * strides[axis] for r in ranks for i in range(sizes[axis])]
        return sorted(ranks)


def parse_layout(text: str, world: int | None = None) -> Layout:
    """``dp_shard=4,tp=2`` (or ``dp_shard_size=4 tp_size=2``; unnamed axes are 1) as a `Layout`."""
    sizes: dict[str, int] = {}
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip().removesuffix("_size")
        if not sep or key not in AXES:
            raise ValueError(f"layout {text!r}: expected axis=size pairs such as 'dp_shard=4,tp=2'; axes: "
                             f"{', '.join(AXES)}")
        try:
            sizes[key] = int(value)
        except ValueError:
            raise ValueError(f"layout {text!r}: {key}={value!r} is not an integer") from None
        if sizes[key] < 1:
            raise ValueError(f"layout {text!r}: {key} must be >= 1")
    layout = Layout(**sizes)
    if world is not None and layout.world != world:
        formula = " * ".join(f"{a}({s})" for a, s in layout.sizes().items() if s > 1) or "1"
        raise ValueError(f"layout {text!r}: {formula} = {layout.world} != world size {world}")
    return layout


def factorizations(world: int, parts: int = len(AXES)) -> list[tuple[int, ...]]:
    """Every ordered tuple of `parts` positive integers whose product is `world`."""
    if parts == 1:
        return [(world,)]
    return [(d, *rest) for d in range(1, world + 1) if world % d == 0 for rest in factorizations(world // d, parts - 1)]


def all_layouts(world: int) -> list[Layout]:
    return [Layout(**dict(zip(AXES, sizes))) for sizes in factorizations(world)]


@dataclass(frozen=True)
class Constraints:
    """What a layout must satisfy besides the product."""

    model: ModelSpec
    seq_len: int
    samples: int  # sequences in the global batch
    gpus_per_node: int
    allow_cross_node_tp: bool = False


def tp_reasons(tp: int, c: Constraints) -> list[str]:
    m, out = c.model, []
    for field, value in (("num_attention_heads", m.heads), ("num_key_value_heads", m.kv_heads),
                         ("intermediate_size", m.intermediate), ("vocab_size", m.vocab)):
        if value % tp:
            out.append(f"tp={tp} does not divide {field}={value}")
    if tp > 1 and not c.allow_cross_node_tp and (tp > c.gpus_per_node or c.gpus_per_node % tp):
        out.append(f"tp={tp} would span nodes of {c.gpus_per_node} GPUs (--allow-cross-node-tp to consider it)")
    return out


def sequence_reasons(cp: int, sp: int, tp: int, c: Constraints) -> list[str]:
    m, out = c.model, []
    if sp > 1 and m.heads % (tp * sp):
        out.append(f"sp={sp}{f' x tp={tp}' if tp > 1 else ''} does not divide num_attention_heads={m.heads}")
    if cp > 1 and c.seq_len % (2 * cp):
        out.append(f"seq_len={c.seq_len} is not a multiple of 2 x cp = {2 * cp} (load-balanced chunks)")
    elif c.seq_len % cp == 0 and (c.seq_len // cp) % sp:
        out.append(f"seq_len={c.seq_len} does not split over cp={cp} x sp={sp}")
    if cp * sp > 1 and m.softcap is not None:
        out.append("attention logit soft-capping is not computed by the cp/sp attention")
    return out


def batch_reasons(batch: int, c: Constraints) -> list[str]:
    if c.samples % batch:
        return [f"{c.samples} samples per step do not split over dp_replicate x dp_shard = {batch}"]
    return []


def pipeline_reasons(pp: int, batch: int, c: Constraints) -> list[str]:
    m, out = c.model, []
    if pp == 1:
        return out
    if pp > m.layers:
        out.append(f"pp={pp} stages for {m.layers} decoder layers (every stage needs one)")
    if c.samples % batch == 0 and (c.samples // batch) % pp:
        out.append(f"pp={pp}: {c.samples // batch} samples per data-parallel rank do not split into {pp} micro-batches")
    return out


def reasons(layout: Layout, c: Constraints) -> list[str]:
    """Why the library would refuse `layout` (empty: it accepts it)."""
    return (tp_reasons(layout.tp, c) + sequence_reasons(layout.cp, layout.sp, layout.tp, c)
            + batch_reasons(layout.batch, c) + pipeline_reasons(layout.pp, layout.batch, c))


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def explain_no_layout(world: int, c: Constraints) -> str:
    """Why no layout of `world` GPUs is accepted, axis by axis: each size > 1 the world allows, with why it fails
    on its own; then what is left when the sizes that pass alone must multiply to the world."""
    lines = []
    alone = {
        "tp": lambda d: tp_reasons(d, c),
        "sp": lambda d: sequence_reasons(1, d, 1, c),
        "cp": lambda d: sequence_reasons(d, 1, 1, c),
        "dp_replicate / dp_shard": lambda d: batch_reasons(d, c),
        "pp": lambda d: pipeline_reasons(d, 1, c),
    }
    some_allowed = False
    for axis, check in alone.items():
        bad = [f"{d} ({'; '.join(check(d))})" for d in _divisors(world) if check(d)]
        good = [str(d) for d in _divisors(world) if not check(d)]
        some_allowed = some_allowed or bool(good)
        lines.append(f"  {axis}: " + (f"refused: {', '.join(bad)}" if bad else "every size allowed alone")
                     + (f"; allowed alone: 1, {', '.join(good)}" if good and bad else ""))
    if some_allowed:
        lines.append(f"  together: no product of sizes allowed alone reaches {world} while meeting the joint limits "
                     f"(tp x sp must divide num_attention_heads={c.model.heads}, seq_len={c.seq_len} must split over "
                     f"cp x sp, dp_replicate x dp_shard must divide the {c.samples} samples)")
    return (f"no layout of {world} GPUs is valid for {c.model.name} at seq_len={c.seq_len} with {c.samples} "
            "samples per step:\n" + "\n".join(lines))


def valid_layouts(world: int, c: Constraints) -> tuple[list[Layout], dict[Layout, list[str]]]:
    """(accepted layouts, refused ones with their reasons), in enumeration order."""
    ok, refused = [], {}
    for layout in all_layouts(world):
        why = reasons(layout, c)
        if why:
            refused[layout] = why
        else:
            ok.append(layout)
    return ok, refused


@functools.lru_cache(maxsize=65536)
def cross_node(layout: Layout, axes: tuple[str, ...], gpus_per_node: int) -> bool:
    """Whether the groups over `axes` span nodes (ranks fill nodes in order; every group of a view is alike)."""
    if math.prod(layout.sizes()[a] for a in axes) == 1:
        return False
    ranks = layout.group(axes)
    return ranks[0] // gpus_per_node != ranks[-1] // gpus_per_node
