"""Long sequences in less memory, side by side on the CPU: the chunked loss, tiled MLPs, activation offloading, fused
RMSNorms, head-chunked Ulysses attention.

    python benchmarks/long_context.py [--hidden 256 --layers 2 --vocab 32000 --seq 4096 --cap-mib 512]
    python benchmarks/long_context.py --loss-only          # part 1 only
    python benchmarks/long_context.py --cap-only           # part 3 only
    python benchmarks/long_context.py --norm-only --vocab 512 --cap-mib 128 --step 128   # part 6 only
    python benchmarks/long_context.py --features-only --vocab 512 --heads 8 --kv-heads 2 --seq 8192 --cap-mib 96  # 7
    python benchmarks/long_context.py --gpu               # on a CUDA GPU (scripts/gpu_check.sh): see `gpu_rows`

1. The loss alone: the LM head and transformers' ``ForCausalLMLoss`` on the full logits ("plain") next to
   ``linear_cross_entropy`` (chunked), fp32, on hidden states of ``tokens x hidden`` and a ``vocab x hidden`` head:
   the working set (peak resident memory of forward + backward above what existed before: logits, their fp32
   copy, log-softmax, gradients; for the chunked loss one chunk's, plus the head's and the hidden states' gradients)
   and the time, for each vocabulary and length. A plain run that would need more than --plain-limit-gib is not run.
2. One training step of a Llama-shaped model (hidden --hidden, --layers layers, MLP 4 x hidden, vocabulary --vocab)
   under FSDP2 over 2 ranks with activation checkpointing, one sequence of --seq tokens per rank: peak memory per
   rank above the state before the step, and the step time, for plain FSDP2 + checkpointing (the model's own loss),
   + chunked loss, + tiled MLP, + offload, and all together.
3. The longest sequence (a multiple of 1024, up to --max-seq) whose step stays within --cap-mib per rank, for the
   same settings. (Attention heads of 16 by default keep the CPU's attention time at long sequences bearable.)
6. (4 is the GPU's, 5 the comparison with ALST in docs/long_context.md.) The fused RMSNorm
   (``MemoryKwargs(fused_rms_norm=True)``), measured against the planner: (a) on a small bf16 Llama
   in one process, the bytes autograd saves (ndparallel.test_utils.memory) and the most bytes of tensors alive at
   once in a forward + backward (ndparallel.test_utils.memory's `LiveBytes`), without and with it; (b) for part 2's
   model and layout with the chunked loss and tiled MLPs (offloading moves nothing on the CPU, and the planner's CPU
   prediction leaves it out), the step's peak per rank at --seq tokens and the longest sequence within --cap-mib (a
   multiple of --step, part 3's search), without and with the fused norm, each beside what the planner's memory
   model (`ndparallel.planner.footprint.estimate`, no allocator reserve on the CPU: the step's allocated bytes above
   the parameters and optimizer state) predicts for the same model, layout and cap, and the growth factor of both.
7. The same measure for what Ulysses sequence parallelism adds (`feature_settings`): sp 2 on the 2 ranks with the
   chunked loss, tiled MLPs (tiles of 256 tokens, so that no fixed tile outweighs the per-token buffers), fused norms
   and checkpointing as the base; head chunks (``MemoryKwargs(ulysses_head_chunks=heads / 2)``, one query head per
   chunk) on Qwen2 (the attention alone: no chunked block for that family) and on Llama (the chunked block engages);
   the fused norm's backward over chunks of tokens (``rms_norm.CHUNK_BYTES`` set to 1 MiB in the ranks and for the
   planner: the library has no option for it, and at the 128 MiB default these sizes never chunk). Each growth of the
   longest sequence (`FEATURE_STEPS`) measured against the planner's, within 15% or not. The planner models "auto"
   head chunks only: it is asked with no budget, which takes the most chunks, and a count other than the ranks'
   raises (`as_the_ranks`). The measured search starts from the planner's longest (fewer forked runs). With
   --peak-op, instead: each setting's step at --seq under `LiveBytes`, the tensors alive at its peak and the op (and
   module whose backward it ran in) that reached it.

How memory is measured: each measurement runs in freshly forked processes (`run_ranks`), glibc told to serve
large blocks from mmap so that freed memory leaves the resident set, the peak resident set size (Linux VmHWM, reset
through /proc/self/clear_refs) minus the resident set before the step -- so transients count, and the weights and
optimizer state (there before) do not. tracemalloc would see none of torch's allocations. On the CPU activation
offloading moves nothing (host memory is the memory): its rows measure the cost of the path, and its memory is
measured on a GPU (part 4, `--gpu`). Speed ratios compare runs of this one invocation (shared cores: rerun for
noise).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

from common import llama, llama_config  # noqa: E402
from common import peak_above_now as _peak_of  # noqa: E402
from common import serve_large_blocks_from_mmap as _mmap_large_blocks  # noqa: E402

from ndparallel.test_utils import run_ranks  # noqa: E402
from ndparallel.test_utils.memory import LiveBytes  # noqa: E402

MiB, GiB = 2**20, 2**30


@dataclass(frozen=True)
class Setting:
    """One row of parts 2, 3, 6 and 7: the `MemoryKwargs` fields, activation offloading, the model family, the
    layout (sp 1: FSDP2 over 2 ranks, dp_shard 2; sp 2: Ulysses over the 2 ranks, FSDP2 sharding over them), and the
    fused norm's backward budget (`rms_norm.CHUNK_BYTES`; None: the library's 128 MiB)."""

    fields: dict = field(default_factory=dict)
    offload: bool = False
    family: str = "llama"
    sp: int = 1
    norm_chunk_bytes: int | None = None


SETTINGS = {
    "plain FSDP2 + AC": Setting({"chunked_loss": False}),
    "+ chunked loss": Setting({}),
    "+ tiled MLP": Setting({"chunked_loss": False, "tiled_mlp": True}),
    "+ offload": Setting({"chunked_loss": False}, True),
    "all together": Setting({"tiled_mlp": True}, True),
}
NORM_SETTINGS = {  # part 6: the fused RMSNorm on top of the chunked loss and tiled MLPs (checkpointing on)
    "chunked loss + tiled MLP": Setting({"tiled_mlp": True}),
    "+ fused RMSNorm": Setting({"tiled_mlp": True, "fused_rms_norm": True}),
}
# Part 7: Ulysses sp 2, the chunked loss, tiled MLPs, fused norms and checkpointing as the base. Head chunks: the
# most, one query head per chunk on each rank (filled in by `feature_settings`); the chunked block engages for Llama
# only (`Family.chunked_attention`), so Qwen2 (the same shapes, q/k/v biases) measures the attention-only chunks. The
# norm's chunked backward: `rms_norm.CHUNK_BYTES` set to NORM_CHUNK_BYTES in the ranks and the planner alike (the
# library has no option for it; at the 128 MiB default these sizes never chunk).
NORM_CHUNK_BYTES = 2**20
FEATURE_BASE = {"tiled_mlp": True, "mlp_tile_size": 256, "fused_rms_norm": True}
HEAD_CHUNKS = "ulysses_head_chunks"


def feature_settings(chunks: int) -> dict[str, Setting]:
    """Part 7's settings, `chunks` head chunks where they are on."""
    on = {**FEATURE_BASE, HEAD_CHUNKS: chunks}
    return {
        "qwen2 sp2": Setting(FEATURE_BASE, family="qwen2", sp=2),
        "qwen2 sp2 + head chunks": Setting(on, family="qwen2", sp=2),
        "llama sp2": Setting(FEATURE_BASE, sp=2),
        "llama sp2 + head chunks (block)": Setting(on, sp=2),
        "llama sp2 + norm chunks": Setting(FEATURE_BASE, sp=2, norm_chunk_bytes=NORM_CHUNK_BYTES),
        "llama sp2 + both": Setting(on, sp=2, norm_chunk_bytes=NORM_CHUNK_BYTES),
    }


# (before, after, what the step between them adds) for part 7's growth factors
FEATURE_STEPS = (
    ("qwen2 sp2", "qwen2 sp2 + head chunks", "head chunks, attention only (Qwen2)"),
    ("llama sp2", "llama sp2 + head chunks (block)", "head chunks and the chunked block (Llama)"),
    ("llama sp2", "llama sp2 + norm chunks", "the fused norm's backward over chunks of tokens"),
    ("llama sp2", "llama sp2 + both", "both on Llama"),
)


# ---- 1. the loss alone -----------------------------------------------------------------------------------------------
def _loss_inputs(tokens: int, vocab: int, hidden: int):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, tokens, hidden, generator=g).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).requires_grad_(True)
    return h, w, torch.randint(0, vocab, (1, tokens), generator=g)


def _loss_step(kind: str, h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> None:
    from ndparallel.parallel.memory.cross_entropy import linear_cross_entropy

    if kind == "plain":
        loss = ForCausalLMLoss(F.linear(h, w), labels, w.shape[0])
    else:
        loss = linear_cross_entropy(h, w, None, F.pad(labels[..., 1:], (0, 1), value=-100))
    loss.backward()
    h.grad = w.grad = None


def _loss_memory(kind: str, tokens: int, vocab: int, hidden: int) -> int:
    _mmap_large_blocks()
    h, w, labels = _loss_inputs(tokens, vocab, hidden)
    _loss_step(kind, h, w, labels)  # warm-up
    return _peak_of(lambda: _loss_step(kind, h, w, labels))[0]


def _loss_times(kinds: list[str], tokens: int, vocab: int, hidden: int, repeats: int) -> dict[str, float]:
    """Median seconds of each kind, the kinds interleaved in one process (shared cores: noise hits both alike)."""
    _mmap_large_blocks()
    h, w, labels = _loss_inputs(tokens, vocab, hidden)
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(repeats + 1):
        for kind in kinds:
            times[kind].append(_peak_of(lambda: _loss_step(kind, h, w, labels))[1])
    return {kind: statistics.median(t[1:]) for kind, t in times.items()}


def loss_table(args: argparse.Namespace) -> None:
    print(f"1. The loss alone: head {args.hidden} -> vocabulary, fp32, one process per measurement (working set = "
          "peak resident memory of forward + backward above the state before; time: median of 3, the two interleaved "
          "in one process)\n")
    print(f"{'vocab':>7} {'tokens':>7} {'plain':>12} {'chunked':>12} {'shrink':>7} {'plain s':>8} {'chunked s':>9} "
          f"{'time ratio':>10}")
    for vocab in args.loss_vocabs:
        for tokens in args.loss_tokens:
            plain_bytes = 4.0 * tokens * vocab * 4  # logits, log-softmax, their gradients: what the plain loss holds
            chunked = run_ranks(_loss_memory, 1, "chunked", tokens, vocab, args.hidden, timeout=3600)[0]
            if plain_bytes > args.plain_limit_gib * GiB:
                t = run_ranks(_loss_times, 1, ["chunked"], tokens, vocab, args.hidden, 3, timeout=3600)[0]
                print(f"{vocab:>7} {tokens:>7} {'not run':>12} {chunked / MiB:>8.0f} MiB {'':>7} {'':>8} "
                      f"{t['chunked']:>9.2f}   (plain would hold ~{plain_bytes / GiB:.1f} GiB)", flush=True)
                continue
            plain = run_ranks(_loss_memory, 1, "plain", tokens, vocab, args.hidden, timeout=3600)[0]
            t = run_ranks(_loss_times, 1, ["plain", "chunked"], tokens, vocab, args.hidden, 3, timeout=3600)[0]
            print(f"{vocab:>7} {tokens:>7} {plain / MiB:>8.0f} MiB {chunked / MiB:>8.0f} MiB "
                  f"{plain / max(chunked, 1):>6.1f}x {t['plain']:>8.2f} {t['chunked']:>9.2f} "
                  f"{t['chunked'] / t['plain']:>9.2f}x", flush=True)


# ---- 2 and 3. a training step ----------------------------------------------------------------------------------------
def model_config(seq: int, args: argparse.Namespace, family: str = "llama"):
    """Part 2's model (hidden --hidden, --layers layers, --heads / --kv-heads heads of --head-dim, MLP 4 x hidden,
    vocabulary --vocab); `family` "qwen2": the same shapes as Qwen2 (q/k/v biases)."""
    sizes = dict(vocab=args.vocab, hidden=args.hidden, layers=args.layers, intermediate=4 * args.hidden,
                 heads=args.heads, kv_heads=args.kv_heads, max_positions=max(seq, 1024), head_dim=args.head_dim,
                 use_cache=False)
    if family == "llama":
        return llama_config(**sizes)
    assert family == "qwen2", family
    import transformers

    return transformers.Qwen2Config(
        vocab_size=sizes["vocab"], hidden_size=sizes["hidden"], intermediate_size=sizes["intermediate"],
        num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"], num_key_value_heads=sizes["kv_heads"],
        max_position_embeddings=sizes["max_positions"], head_dim=sizes["head_dim"], use_cache=False,
        tie_word_embeddings=False, attn_implementation="sdpa")


@contextlib.contextmanager
def norm_budget(setting: Setting):
    """`rms_norm.CHUNK_BYTES` as `setting` asks for it while the block runs (the ranks' step, the planner's count)."""
    rms_norm = importlib.import_module("ndparallel.parallel.memory.rms_norm")  # (the package's is a function)
    before = rms_norm.CHUNK_BYTES
    if setting.norm_chunk_bytes is not None:
        rms_norm.CHUNK_BYTES = setting.norm_chunk_bytes
    try:
        yield
    finally:
        rms_norm.CHUNK_BYTES = before


class _PeakOp(LiveBytes):
    """`LiveBytes` that also records the op that set the peak and the module whose backward it ran in (the last one
    whose backward began: `hook` is each module's backward pre-hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.module, self.at = "forward", ""

    def hook(self, name: str):
        return lambda module, grad: setattr(self, "module", name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.peak
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.peak > before:
            self.at = f"{func} in the backward of {self.module}"
        return out


def _train_run(setting: Setting, seq: int, args: argparse.Namespace, timed: int, where: bool = False) -> dict:
    """One rank's measured step (module docstring); `where`: the step's tensors alive at its peak instead
    (`_PeakOp`), with the op that reached it."""
    _mmap_large_blocks()
    from transformers import AutoModelForCausalLM

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, MemoryKwargs, ParallelismConfig

    checkpointing = {"every": 1, "offload": True} if setting.offload else True
    layout = ParallelismConfig(sp_size=2) if setting.sp == 2 else ParallelismConfig(dp_shard_size=2)
    accelerator = Accelerator(parallelism_config=layout,
                              fsdp_plugin=FullyShardedDataParallelPlugin(activation_checkpointing=checkpointing),
                              kwargs_handlers=[MemoryKwargs(**setting.fields)])
    torch.manual_seed(0)
    model = accelerator.prepare(AutoModelForCausalLM.from_config(model_config(seq, args, setting.family)))
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-4))
    model.train()

    def step(length: int, mode: contextlib.AbstractContextManager = contextlib.nullcontext()) -> None:
        ids = torch.randint(0, args.vocab, (1, length), generator=torch.Generator().manual_seed(length))
        batch = {"input_ids": ids, "labels": ids.clone()}
        if setting.sp > 1:  # what a sequence-parallel script adds: shifted labels and positions, sharded with the ids
            batch["shift_labels"] = F.pad(ids[:, 1:], (0, 1), value=-100)
            batch["position_ids"] = torch.arange(length).unsqueeze(0)
        buffers = list(batch.values())
        with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                                no_restore_buffers=set(buffers)), mode:
            accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with norm_budget(setting):
        step(256)  # warm-up: optimizer state and one-time allocations exist before the measured step
        if where:
            live = _PeakOp()
            for name, module in model.named_modules():
                if name.rsplit(".", 1)[-1] in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
                    module.register_full_backward_pre_hook(live.hook(name))
            step(seq, live)
            accelerator.end_training()
            return {"live": live.peak, "at": live.at}
        peak, seconds = _peak_of(lambda: step(seq))
        times = [_peak_of(lambda: step(seq))[1] for _ in range(timed)]
    accelerator.end_training()
    return {"peak": peak, "time": statistics.median(times) if times else seconds}


def train(setting: Setting, seq: int, args: argparse.Namespace, timed: int = 0, where: bool = False) -> dict:
    ranks = run_ranks(_train_run, 2, setting, seq, args, timed, where, timeout=7200)
    if where:
        return max(ranks, key=lambda r: r["live"])
    return {"peak": max(r["peak"] for r in ranks), "time": max(r["time"] for r in ranks)}


def step_table(args: argparse.Namespace) -> None:
    print(f"\n2. One training step: Llama hidden {args.hidden}, {args.layers} layers, 4 query / 2 KV heads of "
          f"{args.head_dim}, MLP {4 * args.hidden}, vocabulary {args.vocab}, FSDP2 over 2 ranks, full activation "
          f"checkpointing, AdamW, one sequence of {args.seq} tokens per rank, fp32 (largest value over ranks)\n")
    print(f"{'setting':<18} {'peak per rank':>14} {'vs plain':>9} {'step s':>8} {'vs plain':>9}")
    base = None
    for setting in SETTINGS:
        r = train(SETTINGS[setting], args.seq, args, timed=2)
        base = base or r
        print(f"{setting:<18} {r['peak'] / MiB:>10.0f} MiB {r['peak'] / base['peak']:>8.2f}x {r['time']:>8.2f} "
              f"{r['time'] / base['time']:>8.2f}x", flush=True)


def longest_within(cap: int, setting: Setting, args: argparse.Namespace, step: int = 1024, fits=None,
                   start: int | None = None) -> int:
    """The longest multiple of `step` up to --max-seq whose step's peak per rank (`train`) is within `cap`: doubling
    from 1024 tokens -- or, from `start`, up or down by an eighth at a time -- then bisection down to `step` (memory
    grows with the length). `fits(length)`: another test of a length than a measured step (part 6 searches the
    planner's prediction so)."""
    fits = fits or (lambda length: train(setting, length, args)["peak"] <= cap)
    if start is None:
        lo, hi = 0, 1024
        while hi <= args.max_seq and fits(hi):
            lo, hi = hi, 2 * hi
    else:  # from a guess (part 7: the planner's longest), which saves most of the forked runs
        up = lambda x: x + max(step, x // 8 // step * step)  # noqa: E731
        down = lambda x: x - max(step, x // 8 // step * step)  # noqa: E731
        length = max(step, start // step * step)
        if fits(length):
            lo, hi = length, up(length)
            while hi <= args.max_seq and fits(hi):
                lo, hi = hi, up(hi)
        else:
            lo, hi = down(length), length
            while lo > 0 and not fits(lo):
                lo, hi = down(lo), lo
            lo = max(lo, 0)
    if hi > args.max_seq:
        return lo
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def cap_table(args: argparse.Namespace) -> None:
    print(f"\n3. Longest sequence whose step stays within {args.cap_mib:g} MiB per rank (multiples of 1024, searched up "
          f"to {args.max_seq})\n")
    print(f"{'setting':<18} {'tokens':>8} {'vs plain':>9}")
    base = None
    for setting in SETTINGS:
        tokens = longest_within(int(args.cap_mib * MiB), SETTINGS[setting], args)
        base = base or max(tokens, 1)
        print(f"{setting:<18} {tokens:>8} {tokens / base:>8.1f}x", flush=True)


# ---- 6. the fused RMSNorm, measured against the planner ---------------------------------------------------------------
def _norm_bytes(fused: bool, hidden: int, tokens: int) -> dict:
    """(a) A bf16 Llama (vocabulary 96, 8 / 4 heads; hidden `hidden`, 2 layers), one forward + backward of
    `tokens` tokens: the bytes autograd saves for backward, and the most bytes of tensors alive at once."""
    from ndparallel.parallel.memory.rms_norm import apply_fused_rms_norm
    from ndparallel.test_utils.memory import LiveBytes, training_step_kept_bytes

    model = llama(vocab=96, hidden=hidden, layers=2, intermediate=4 * hidden, max_positions=tokens)
    model = model.to(torch.bfloat16)
    if fused:
        apply_fused_rms_norm(model)
    ids = torch.randint(0, 96, (1, tokens), generator=torch.Generator().manual_seed(1))
    saved = training_step_kept_bytes(model, ids)
    model.zero_grad(set_to_none=True)
    with LiveBytes() as live:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return {"saved": saved, "peak": live.peak, "norms": 2 * model.config.num_hidden_layers + 1}


# MemoryKwargs field -> the planner's Recipe field that models it (a setting with a field not here is refused: its
# prediction would silently leave the feature out)
RECIPE_FIELDS = {"chunked_loss": "chunked_loss", "tiled_mlp": "tiled_mlp", "mlp_tile_size": "mlp_tile",
                 "fused_rms_norm": "fused_norms", HEAD_CHUNKS: "head_chunks"}


def planned(seq: int, setting: Setting, args: argparse.Namespace):
    """The planner's (model, layout, recipe) for `setting`'s step at `seq` tokens (fp32, checkpointing on)."""
    from ndparallel.planner import Layout, Recipe, spec_from_config

    unknown = set(setting.fields) - set(RECIPE_FIELDS)
    if unknown:
        raise ValueError(f"no Recipe field models MemoryKwargs {sorted(unknown)}")
    spec = spec_from_config(model_config(seq, args, setting.family).to_dict(), "bench")
    # head chunks: the planner's is a switch ("auto"); the count is checked by `as_the_ranks`
    recipe = Recipe(seq, 1, 1, "fp32", True, offload=setting.offload,
                    **{RECIPE_FIELDS[k]: bool(v) if k == HEAD_CHUNKS else v for k, v in setting.fields.items()})
    return spec, Layout(sp=2) if setting.sp == 2 else Layout(dp_shard=2), recipe


@contextlib.contextmanager
def as_the_ranks(seq: int, setting: Setting, args: argparse.Namespace):
    """The planner's (model, layout, recipe) for `setting` at `seq` tokens, its budgets as the ranks run them: the
    norm's (`norm_budget`), and the head chunks -- the planner models "auto" only, so it is asked with no budget
    (`ulysses.HEAD_CHUNK_BYTES` 0: the most chunks, which part 7's ranks run as an explicit count); a count other
    than the ranks' raises."""
    from ndparallel.planner.footprint import head_chunks

    ulysses = importlib.import_module("ndparallel.parallel.sequence.ulysses")
    spec, layout, recipe = planned(seq, setting, args)
    before = ulysses.HEAD_CHUNK_BYTES
    ulysses.HEAD_CHUNK_BYTES = 0
    try:
        chunks, asked = head_chunks(spec, layout, recipe), setting.fields.get(HEAD_CHUNKS, 1)
        if chunks != asked:
            raise ValueError(f"the planner counts {chunks} head chunks where the ranks run {asked}")
        with norm_budget(setting):
            yield spec, layout, recipe
    finally:
        ulysses.HEAD_CHUNK_BYTES = before


def predicted_step_peak(seq: int, setting: Setting, args: argparse.Namespace) -> float:
    """The planner's peak of `setting`'s step on one rank above the parameters and optimizer state (the CPU model:
    no allocator reserve; benchmarks/planner_check.py's `predicted_step_peak`)."""
    from ndparallel.planner.footprint import estimate

    with as_the_ranks(seq, setting, args) as (spec, layout, recipe):
        memory = estimate(spec, layout, recipe)
    return memory["allocated"] - memory["params"] - memory["optimizer"]


def against_planner(settings: dict[str, Setting], args: argparse.Namespace, guess: bool = False) -> dict:
    """For each setting, the step's measured peak per rank at --seq and the longest multiple of --step within
    --cap-mib, each beside the planner's; printed as a table, returned as {name: (measured, planned) longest}.
    `guess`: the measured search starts from the planner's longest (fewer forked runs; the result is checked
    either side all the same)."""
    cap = int(args.cap_mib * MiB)
    width = max(map(len, settings)) + 1
    print(f"{'setting':<{width}} {'peak measured':>14} {'predicted':>10} {'meas/pred':>9} {'longest measured':>17} "
          f"{'predicted':>10}")
    longest = {}
    for name, setting in settings.items():
        measured = train(setting, args.seq, args)["peak"]
        predicted = predicted_step_peak(args.seq, setting, args)
        plan = longest_within(cap, setting, args, args.step,
                              fits=lambda length, s=setting: predicted_step_peak(length, s, args) <= cap)
        found = longest_within(cap, setting, args, args.step, start=plan if guess else None)
        longest[name] = (found, plan)
        print(f"{name:<{width}} {measured / MiB:>10.1f} MiB {predicted / MiB:>6.1f} MiB {measured / predicted:>9.3f} "
              f"{found:>17,} {plan:>10,}", flush=True)
    return longest


def largest_backward_buffer(seq: int, setting: Setting, args: argparse.Namespace) -> str:
    """What the planner counts as a rebuilt layer's largest backward buffer for `setting` at `seq` tokens."""
    from ndparallel.planner.footprint import backward_transient

    with as_the_ranks(seq, setting, args) as planned_step:
        value, how = backward_transient(*planned_step)
    return f"{value / MiB:.2f} MiB: {how}"


def growth(longest: dict, before: str, after: str, what: str = "") -> float:
    """Print how much the longest sequence grows from `before` to `after`, measured and predicted, and whether
    they agree within 15%; the ratio measured / predicted."""
    (was, plan_was), (now, plan_now) = longest[before], longest[after]
    grown, predicted = now / max(was, 1), plan_now / max(plan_was, 1)
    ratio = grown / predicted
    print(f"{what + ': ' if what else ''}the longest sequence grows by {grown:.3f}x measured, {predicted:.3f}x "
          f"predicted: measured / predicted = {ratio:.3f} ({'within' if abs(ratio - 1) <= 0.15 else 'NOT within'} "
          "15%)")
    return ratio


def norm_table(args: argparse.Namespace) -> None:
    hidden, tokens = 64, 1024
    print(f"\n6a. The fused RMSNorm on a bf16 Llama (hidden {hidden}, MLP {4 * hidden}, 2 layers, 8 / 4 heads, "
          f"vocabulary 96), one forward + backward of {tokens} tokens in one process, no "
          "checkpointing\n")
    rows = {fused: run_ranks(_norm_bytes, 1, fused, hidden, tokens, timeout=600)[0] for fused in (False, True)}
    print(f"{'':<18} {'saved for backward':>19} {'live bytes at the peak':>23}")
    for fused, name in ((False, "model's own norms"), (True, "fused RMSNorms")):
        print(f"{name:<18} {rows[fused]['saved']:>17,} B {rows[fused]['peak']:>21,} B")
    less = {key: rows[False][key] - rows[True][key] for key in ("saved", "peak")}
    print(f"{'less by':<18} {less['saved']:>17,} B {less['peak']:>21,} B   (4 h bytes per token per norm: "
          f"{rows[True]['norms']} x {tokens} x {hidden} x 4 = {rows[True]['norms'] * tokens * hidden * 4:,} B)")

    print(f"\n6b. Part 2's model (hidden {args.hidden}, {args.layers} layers, heads of {args.head_dim}, MLP "
          f"{4 * args.hidden}, vocabulary {args.vocab}), FSDP2 over 2 ranks, full activation checkpointing, fp32: the "
          f"step's peak per rank at {args.seq} tokens, and the longest sequence within {args.cap_mib:g} MiB per rank "
          f"(multiples of {args.step}), measured and predicted by the planner\n")
    longest = against_planner(NORM_SETTINGS, args)
    print()
    growth(longest, *NORM_SETTINGS)


def feature_table(args: argparse.Namespace) -> None:
    chunks = args.heads // 2
    print(f"\n7. Part 2's model (hidden {args.hidden}, {args.layers} layers, {args.heads} / {args.kv_heads} heads of "
          f"{args.head_dim}, MLP {4 * args.hidden}, vocabulary {args.vocab}) as Llama and as Qwen2, Ulysses sp 2 on 2 "
          "ranks (FSDP2 sharding over them), full activation checkpointing, the chunked loss, tiled MLPs (tiles of "
          f"{FEATURE_BASE['mlp_tile_size']} tokens) and fused RMSNorms, fp32; head chunks: {chunks} (one query head "
          "per chunk on each rank); norm chunks: the fused "
          f"norm's backward within {NORM_CHUNK_BYTES:,} B a chunk (rms_norm.CHUNK_BYTES, set in the ranks and the "
          f"planner alike). The step's peak per rank at {args.seq} tokens, and the longest sequence within "
          f"{args.cap_mib:g} MiB per rank (multiples of {args.step}), measured and predicted by the planner\n")
    settings = feature_settings(chunks)
    if args.peak_op:
        print(f"{'setting':<38} {'alive at the peak':>18}  where")
        for name, setting in settings.items():
            r = train(setting, args.seq, args, where=True)
            print(f"{name:<38} {r['live'] / MiB:>14.2f} MiB  {r['at']}", flush=True)
        return
    longest = against_planner(settings, args, guess=True)
    print("\nthe planner's largest backward buffer of a rebuilt layer, at the measured longest sequence:")
    for name, setting in settings.items():
        print(f"  {name}: {largest_backward_buffer(longest[name][0], setting, args)}")
    print()
    for before, after, what in FEATURE_STEPS:
        growth(longest, before, after, what)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16, help="attention head size (small: CPU attention stays cheap)")
    p.add_argument("--heads", type=int, default=4, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--cap-mib", type=float, default=768.0)
    p.add_argument("--max-seq", type=int, default=32768)
    p.add_argument("--loss-vocabs", type=int, nargs="+", default=[32000, 128256])
    p.add_argument("--loss-tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--plain-limit-gib", type=float, default=8.0)
    p.add_argument("--loss-only", action="store_true")
    p.add_argument("--no-cap", action="store_true", help="skip part 3 (the longest sequence)")
    p.add_argument("--cap-only", action="store_true", help="part 3 only")
    p.add_argument("--norm-only", action="store_true", help="part 6 only (the fused RMSNorm)")
    p.add_argument("--features-only", action="store_true", help="part 7 only (head chunks, the chunked block, the "
                   "norm's chunked backward, under Ulysses sp 2)")
    p.add_argument("--peak-op", action="store_true", help="part 7: instead of the table, the tensors alive at each "
                   "setting's peak at --seq (LiveBytes) and the op that reached it")
    p.add_argument("--step", type=int, default=128, help="part 6: the longest sequence is a multiple of this")
    p.add_argument("--gpu", action="store_true", help="the GPU rows (scripts/gpu_check.sh)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.gpu:
        from long_context_gpu import gpu_rows

        gpu_rows([])
        return
    if args.cap_only:
        cap_table(args)
        return
    if args.norm_only:
        norm_table(args)
        return
    if args.features_only:
        feature_table(args)
        return
    loss_table(args)
    if args.loss_only:
        return
    step_table(args)
    if not args.no_cap:
        cap_table(args)
    norm_table(args)


if __name__ == "__main__":
    main()
