"""Layouts: every way to split a world of GPUs over pp x dp_replicate x dp_shard x cp x sp x tp, and why the library
accepts or refuses each.

The checks are the library's own, restated without a model or a process group (the library raises at ``prepare``
or at the first batch; the planner says it before anything runs):

- tp divides num_attention_heads, num_key_value_heads, intermediate_size and vocab_size (`parallel.tensor.check_plan`;
  the LM head is split along the vocabulary), and stays inside a node unless allowed across;
- sp x tp divides num_attention_heads (Ulysses gives each rank whole heads: `parallel.sequence.ulysses.check_heads`);
- the sequence splits: a multiple of 2 x cp (the load-balanced layout's chunks), each cp rank's share a multiple of
  sp (`parallel.sequence.positions`);
- cp/sp attention computes no logit soft-capping;
- dp_replicate x dp_shard divides the global batch's samples (each data-parallel rank gets whole samples);
- pipeline stages (`parallel.pipeline`): at least one decoder layer per stage, and each micro-step's rows split into
  the default schedule's micro-batches (one per stage);
- expert parallelism (``ep_size``, carved out of dp_shard x cp x sp: no axis of the mesh, so no factor of the world):
  ep divides dp_shard x cp x sp and the number of routed experts (`config.ParallelismConfig`,
  `parallel.experts.modules.check_experts`), and only a mixture of experts of a family the library knows takes one.
  For a mixture of experts every such ep is a layout of its own (`expert_layouts`).

What the planner does not model is refused too, saying so: pipeline stages of a mixture of experts, and tensor
parallelism for the families whose plan `mixture.TP_NOT_MODELLED` names.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from ..distributed.layout import AXES, Layout, load_balanced_chunks  # the axes and their sizes: declared there
from .model import ModelSpec
from .mixture import EP_TYPES


def parse_layout(text: str, world: int | None = None) -> Layout:
    """``dp_shard=4,tp=2`` (or ``dp_shard_size=4 tp_size=2``; unnamed axes are 1) as a `Layout`."""
    sizes: dict[str, int] = {}
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip().removesuffix("_size")
        if not sep or key not in (*AXES, "ep"):
            raise ValueError(f"layout {text!r}: expected axis=size pairs such as 'dp_shard=4,tp=2'; axes: "
                             f"{', '.join(AXES)} (and ep)")
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
    ep: int | None = None  # expert parallelism pinned (--ep-size); None: every size that splits the experts


def tp_reasons(tp: int, c: Constraints) -> list[str]:
    m, out = c.model, []
    if tp > 1 and m.moe is not None and m.moe.tp_not_modelled:
        return [f"tp={tp}: not modelled for {m.model_type} ({m.moe.tp_not_modelled}; the library runs it)"]
    split = [("num_attention_heads", m.heads), ("num_key_value_heads", m.kv_heads)]
    if m.dense_layers:
        split.append(("intermediate_size", m.intermediate))
    if m.moe is not None and m.moe.shared_intermediate and m.moe.shared_split:
        split.append(("the shared experts' intermediate size", m.moe.shared_intermediate))
    for field, value in (*split, ("vocab_size", m.vocab)):
        if value % tp:
            out.append(f"tp={tp} does not divide {field}={value}")
    if tp > 1 and not c.allow_cross_node_tp and (tp > c.gpus_per_node or c.gpus_per_node % tp):
        out.append(f"tp={tp} would span nodes of {c.gpus_per_node} GPUs (--allow-cross-node-tp to consider it)")
    return out


def expert_reasons(layout: Layout, c: Constraints) -> list[str]:
    """Why the library refuses `layout`'s ep (the words of `config.ParallelismConfig` and
    `parallel.experts.modules.check_experts`), or why the planner does not model it."""
    m, ep, out = c.model, layout.ep, []
    if m.moe is not None and layout.pp > 1:
        out.append(f"pp={layout.pp}: pipeline stages of a mixture of experts are not modelled (the library runs them: "
                   "docs/expert_parallel.md)")
    if ep == 1:
        return out
    if m.moe is None:
        return out + [f"ep_size={ep}: {m.name} has no experts (expert parallelism splits the experts of a "
                      "mixture-of-experts model)"]
    if m.model_type not in EP_TYPES:
        out.append(f"ep_size={ep}: model_type {m.model_type!r} is a mixture of experts whose router and experts "
                   f"ndparallel's family table does not know (it knows {list(EP_TYPES)}); train it without ep")
    if layout.fsdp % ep:
        out.append(f"ep_size={ep} must divide the ranks the experts are split over, dp_shard({layout.dp_shard}) * "
                   f"cp({layout.cp}) * sp({layout.sp}) = {layout.fsdp}")
    if m.moe.routed.experts % ep:
        out.append(f"ep_size={ep} must divide the {m.moe.routed.experts} experts")
    return out


def expert_layouts(layout: Layout, c: Constraints) -> list[Layout]:
    """`layout` with each ep the search tries: the pinned one, else every divisor of dp_shard x cp x sp that divides
    the experts (1 included; only 1 for a dense model or a family the library cannot split)."""
    m = c.model
    if c.ep is not None:
        return [dataclasses.replace(layout, ep=c.ep)]
    if m.moe is None or m.model_type not in EP_TYPES:
        return [layout]
    return [dataclasses.replace(layout, ep=ep) for ep in range(1, layout.fsdp + 1)
            if layout.fsdp % ep == 0 and m.moe.routed.experts % ep == 0]


def sequence_reasons(cp: int, sp: int, tp: int, c: Constraints) -> list[str]:
    m, out = c.model, []
    if sp > 1 and m.heads % (tp * sp):
        out.append(f"sp={sp}{f' x tp={tp}' if tp > 1 else ''} does not divide num_attention_heads={m.heads}")
    chunks = load_balanced_chunks(cp)
    if cp > 1 and c.seq_len % chunks:
        out.append(f"seq_len={c.seq_len} is not a multiple of 2 x cp = {chunks} (load-balanced chunks)")
    elif c.seq_len % cp == 0 and (c.seq_len // cp) % sp:
        out.append(f"seq_len={c.seq_len} does not split over cp={cp} x sp={sp}")
    if (cp > 1 or sp > 1) and m.softcap is not None:
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
            + batch_reasons(layout.batch, c) + pipeline_reasons(layout.pp, layout.batch, c) + expert_reasons(layout, c))


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
    if c.ep is not None and c.ep > 1:
        lines.append(f"  ep: --ep-size {c.ep} needs dp_shard x cp x sp to be a multiple of {c.ep}")
    if some_allowed:
        lines.append(f"  together: no product of sizes allowed alone reaches {world} while meeting the joint limits "
                     f"(tp x sp must divide num_attention_heads={c.model.heads}, seq_len={c.seq_len} must split over "
                     f"cp x sp, dp_replicate x dp_shard must divide the {c.samples} samples"
                     + (f", ep={c.ep} must divide dp_shard x cp x sp" if c.ep is not None and c.ep > 1 else "") + ")")
    return (f"no layout of {world} GPUs is valid for {c.model.name} at seq_len={c.seq_len} with {c.samples} "
            "samples per step:\n" + "\n".join(lines))


def valid_layouts(world: int, c: Constraints) -> tuple[list[Layout], dict[Layout, list[str]]]:
    """(accepted layouts, refused ones with their reasons), in enumeration order."""
    ok, refused = [], {}
    for layout in (expert for mesh in all_layouts(world) for expert in expert_layouts(mesh, c)):
        why = reasons(layout, c)
        if why:
            refused[layout] = why
        else:
            ok.append(layout)
    return ok, refused


@functools.lru_cache(maxsize=65536)
def cross_node(layout: Layout, view: str, gpus_per_node: int) -> bool:
    """Whether the groups of `view` span nodes (ranks fill nodes in order; every group of a view is alike)."""
    if layout.size(view) == 1:
        return False
    ranks = layout.group(view)
    return ranks[0] // gpus_per_node != ranks[-1] // gpus_per_node
