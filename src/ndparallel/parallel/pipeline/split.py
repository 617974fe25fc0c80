"""Where pipeline stages begin, as data, and cutting a model down to this rank's stages.

A model is a sequence of *units* run in order: the decoder layers of a Hugging Face causal LM (the embedding belongs
to the first stage, the final norm and the LM head to the last), or the top-level children of an ``nn.Sequential``.
A `StagePlan` says which units each of the pipeline's ``pp_size * stages_per_rank`` stages runs and which rank
holds each stage. Stage s lives on rank ``s % pp`` (the loop order of torch's interleaved schedules) or, for the
V-shaped "zbv" schedule, rank s for s < pp and rank ``2*pp-1-s`` after.

Cutting keeps every parameter's name: a decoder's ``layers`` becomes a `StageLayers` keyed by the original layer
indices (``model.layers.5.mlp...`` stays that), modules of other stages are dropped. Checkpoints written under
pipeline stages therefore hold the model's own names and load under any other layout. A tied embedding and LM head
become two copies, the embedding's on the first stage and the head's on the last (`runner` keeps them equal).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from torch import nn

from ...configuration.handlers import PP_SCHEDULES, PipelineParallelConfig
from ...models.families import ROUTER_LOSS, expert_counts
from ..adapted import adapter_free
from ..target import Target

# Attributes of a decoder's inner model that hold positions added to the embeddings in its forward: a later stage
# that is handed hidden states would add them again, so such models are split by the user (an nn.Sequential).
_POSITION_MODULES = ("embed_positions", "wpe", "position_embeddings")


class StageLayers(nn.ModuleDict):
    """A decoder's layers cut to some of them, keyed by their original indices. Slicing and iterating give the kept
    layers in order, as the model's forward expects of its ``nn.ModuleList``."""

    def __getitem__(self, key):  # type: ignore[override]
        if isinstance(key, slice):
            return list(self.values())[key]
        if isinstance(key, int):
            return list(self.values())[key]
        return super().__getitem__(key)

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())


@dataclass(frozen=True)
class StagePlan:
    """Which units each stage runs, and where each stage lives."""

    kind: str  # "decoder" (a Hugging Face causal LM) or "sequential"
    units: tuple[str, ...]  # unit names in order: layer indices ("0", "1"...) or child names
    starts: tuple[int, ...]  # index into `units` at which each stage begins (starts[0] == 0)
    pp: int
    v_shape: bool  # stage placement of the "zbv" schedule
    tied: bool = False  # a decoder whose LM head shares its weight with the input embedding (first and last stage)

    @property
    def num_stages(self) -> int:
        return len(self.starts)

    def stage_units(self, stage: int) -> tuple[str, ...]:
        end = self.starts[stage + 1] if stage + 1 < self.num_stages else len(self.units)
        return self.units[self.starts[stage]:end]

    def rank_of(self, stage: int) -> int:
        """The pp coordinate of the rank that holds `stage`."""
        if self.v_shape and stage >= self.pp:
            return 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of(self, pp_rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.rank_of(s) == pp_rank]

    def describe(self) -> str:
        return "; ".join(f"stage {s} (rank {self.rank_of(s)}): {_span(self.stage_units(s), self.kind)}"
                         for s in range(self.num_stages))


def _span(units: Sequence[str], kind: str) -> str:
    what = "layers" if kind == "decoder" else "modules"
    return f"{what} {units[0]}..{units[-1]}" if len(units) > 1 else f"{what[:-1]} {units[0]}"


# ---- recognising what can be split -------------------------------------------------------------------------------
def decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList] | None:
    """(inner model, its layers) of a Hugging Face causal LM built as ``model.{embed_tokens, layers, norm}`` plus
    ``lm_head``, or None for any other model."""
    inner = getattr(model, "model", None)
    if getattr(model, "config", None) is None or not isinstance(getattr(model, "lm_head", None), nn.Module):
        return None
    if not isinstance(inner, nn.Module) or not isinstance(getattr(inner, "layers", None), (nn.ModuleList,
                                                                                            StageLayers)):
        return None
    if not all(isinstance(getattr(inner, name, None), nn.Module) for name in ("embed_tokens", "norm")):
        return None
    return inner, inner.layers


def check_splittable(model: nn.Module, pp: int, target: Target | None = None) -> str:
    """The plan kind for `model` ("decoder" or "sequential"), or raise saying why it cannot be split. `target`: `model`
    as `parallelize` resolved it (resolved here when not given)."""
    where = f"pp_size={pp}"
    target = Target.of(model) if target is None else target
    model = target.inner  # under PEFT: the transformers model it adapts (its layers hold the adapters)
    parts = decoder_parts(model)
    if parts is None:
        if isinstance(model, nn.Sequential):
            return "sequential"
        raise ValueError(
            f"{where}: {type(model).__name__} cannot be split into pipeline stages: ndparallel splits Hugging Face "
            "causal LMs built as model.embed_tokens / model.layers / model.norm / lm_head (Llama, Qwen2, Qwen3, "
            "Mistral, OLMo 2, Phi-3...) and nn.Sequential models; build your model as an nn.Sequential of its "
            "stages' parts, or use a layout without pp")
    inner, _ = parts
    config = model.config
    name = type(model).__name__
    positions = [a for a in _POSITION_MODULES if isinstance(getattr(inner, a, None), nn.Module)]
    if positions:
        raise ValueError(f"{where}: {name} adds learned positions ({positions[0]}) to its embeddings inside its "
                         "forward, which a later stage cannot skip; pipeline stages are not supported for it")
    experts = [k for k, v in expert_counts(config).items() if v]
    if experts and ROUTER_LOSS.on(config) and target.experts is None:
        # The stages add the load-balancing term from the routers' logits (`balancing`): the family table says
        # where a family's routers are.
        raise ValueError(f"{where}: {name} is a mixture of experts ({experts[0]}={getattr(config, experts[0])}) "
                         f"whose loss adds a load-balancing term (output_router_logits=True) over every layer of "
                         f"every stage, and ndparallel's family table does not know its routers (model_type "
                         f"{config.model_type!r}); set config.output_router_logits=False (the token loss alone), or "
                         "use a layout without pp (FSDP2 / TP / CP / SP)")
    if getattr(config, "logit_scale", None) not in (None, 1, 1.0):
        raise ValueError(f"{where}: {name} scales its logits (logit_scale) in its forward; pipeline stages are not "
                         "supported for it")
    return "decoder"


# ---- planning -------------------------------------------------------------------------------------------------------
def _balanced(weights: Sequence[int], stages: int) -> list[int]:
    """Starts of `stages` contiguous non-empty groups of `weights` that minimise the heaviest group."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the least possible heaviest group splitting the first i units into k groups
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def plan_stages(model: nn.Module, pp: int, handler: PipelineParallelConfig, target: Target | None = None) -> StagePlan:
    """The `StagePlan` of `model` over `pp` ranks under `handler`; raises (naming what works) for a split that
    leaves a stage empty, names units the model lacks, or asks for more stages than the model has units. `target`:
    as for `check_splittable`."""
    target = Target.of(model) if target is None else target
    kind = check_splittable(model, pp, target)
    model = target.inner
    stages = pp * handler.stages_per_rank
    if kind == "decoder":
        inner, layers = decoder_parts(model)
        units = tuple(str(i) for i in range(len(layers)))
        # The embedding weighs on the first stage, the final norm and the head on the last.
        weights = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        if weights:
            weights[0] += sum(p.numel() for p in inner.embed_tokens.parameters())
            weights[-1] += sum(p.numel() for p in (*inner.norm.parameters(), *model.lm_head.parameters()))
    else:
        units = tuple(name for name, _ in model.named_children())
        weights = [max(1, sum(p.numel() for p in child.parameters())) for child in model.children()]
    what = "decoder layers" if kind == "decoder" else "top-level modules"
    if stages > len(units):
        raise ValueError(f"pp_size={pp} x stages_per_rank={handler.stages_per_rank} = {stages} stages, but "
                         f"{type(model).__name__} has only {len(units)} {what}: every stage needs at least one; use "
                         f"at most {len(units)} stages")
    if handler.split is None:
        starts = _balanced(weights, stages)
    else:
        starts = [0] + [_unit_index(entry, units, kind) for entry in handler.split]
        if len(handler.split) != stages - 1:
            raise ValueError(f"split={handler.split!r} gives {len(handler.split) + 1} stages; the pipeline has "
                             f"{stages} (pp_size={pp} x stages_per_rank={handler.stages_per_rank}): give "
                             f"{stages - 1} places where a stage begins")
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise ValueError(f"split={handler.split!r} leaves a stage empty or goes backwards: each entry must come "
                             f"after the one before it and after the first of the model's {what} ({units[0]!r})")
    v_shape = PP_SCHEDULES[handler.schedule][1] == "2"
    tied = kind == "decoder" and model.lm_head.weight is decoder_parts(model)[0].embed_tokens.weight
    if tied and v_shape:
        raise ValueError(f"pp_size={pp}: {type(model).__name__} ties its input embedding to its LM head, and schedule "
                         f"{handler.schedule!r} puts the first and the last stage on one rank; use another schedule")
    return StagePlan(kind, units, tuple(starts), pp, v_shape=v_shape, tied=tied)


def _unit_index(entry: int | str, units: tuple[str, ...], kind: str) -> int:
    key = str(entry)
    if key not in units:
        what = "layer index" if kind == "decoder" else "top-level module name"
        raise ValueError(f"split entry {entry!r} is not a {what} of the model; valid: {units[0]}..{units[-1]}"
                         if kind == "decoder" else f"split entry {entry!r} is not a {what} of the model; valid: "
                         f"{list(units)}")
    return units.index(key)


# ---- cutting --------------------------------------------------------------------------------------------------
def cut_to_rank(model: nn.Module, plan: StagePlan, pp_rank: int, inner: nn.Module | None = None) -> nn.Module:
    """Drop from `model`, in place, every unit (and embedding / norm / head) that no stage of rank `pp_rank` runs.
    Names of what is kept do not change. `inner`: `model` under its adapter wrapper, as `parallelize` peeled it."""
    stages = plan.stages_of(pp_rank)
    kept = {u for s in stages for u in plan.stage_units(s)}
    first, last = 0 in stages, plan.num_stages - 1 in stages
    if plan.kind == "decoder":
        # Under PEFT, cut in place inside it: the PEFT model keeps its names.
        adapted = adapter_free(model) if inner is None else inner
        inner, layers = decoder_parts(adapted)
        inner.layers = StageLayers({str(i): layer for i, layer in enumerate(layers) if str(i) in kept})
        if not first:
            inner.embed_tokens = None
        if not last:
            inner.norm = None
            adapted.lm_head = None
    else:
        for name in [n for n, _ in model.named_children() if n not in kept]:
            delattr(model, name)
    return model
