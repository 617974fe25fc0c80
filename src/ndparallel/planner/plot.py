"""``ndparallel plan --plot FILE``: the plan as a picture, drawn with matplotlib (the ``plot`` extra).

Two figures, each from the planner's own objects -- nothing here computes a byte:

- `plan_figure`: one bar per row the table shows, the GPU's predicted peak stacked by what holds it
  (`footprint.peak_parts`: the bars add up to the peak), beside it a hatched bar of the host memory the row's
  offloading takes (`offload.host_bytes`: not GPU memory), and a line at the GPU's budget.
- `max_seq_figure`: for the longest row of ``--max-seq``, the predicted peak against the sequence length with the
  setting found, without each of its features in turn and plain FSDP2 + AC (`longest.curves`), the budget, and
  below it the host memory per GPU against the host's share.

matplotlib is imported inside the functions (the planner runs without it); `check` says how to install it, and the
command calls it before searching. Figures are built on the Agg canvas, never through pyplot: no window, no global
state.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .footprint import PEAK_PARTS, peak_parts
from .hardware import GiB
from .longest import Longest, curve_lengths, curves
from .offload import host_bytes
from .report import row_cells
from .search import Plan, Request, Row

if TYPE_CHECKING:
    from matplotlib.figure import Figure

INSTALL = "pip install 'ndparallel[plot]' (in a checkout: bash scripts/install.sh --plot)"
# Legend text and colour of each part of the peak (`footprint.PEAK_PARTS`), and of the host's bar.
LEGEND = {"parameters": "parameters (shards, gathered copies)", "gradients": "gradients",
          "optimizer": "optimizer state", "activations": "activations saved for backward",
          "loss": "loss working set", "backward buffers": "backward: FSDP2 buffers, rebuilt layer",
          "allocator reserve": "allocator reserve"}
COLORS = {"parameters": "tab:blue", "gradients": "tab:orange", "optimizer": "tab:green", "activations": "tab:red",
          "loss": "tab:purple", "backward buffers": "tab:brown", "allocator reserve": "tab:gray"}
HOST = "offloaded to host memory (not GPU memory)"
BUDGET = "budget per GPU"


def check(path: str | Path) -> None:
    """Raise ImportError naming the install when matplotlib is missing, ValueError when it cannot write `path`'s
    format (its suffix); the command calls this before any search."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as exc:
        raise ImportError(f"--plot needs matplotlib, which is not installed: {INSTALL}") from exc
    formats = FigureCanvasBase.get_supported_filetypes()
    if Path(path).suffix.lstrip(".").lower() not in formats:
        raise ValueError(f"--plot {path}: name a file ending in one of {', '.join('.' + f for f in sorted(formats))}")


def _figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _row_label(index: int, row: Row) -> str:
    """A row as the table names it: its number, layout (one axis a line), micro-batch x accumulation, AC, mem."""
    number, layout, micro, ac, mem = row_cells(index, row)[:5]
    return f"#{number}\n" + layout.replace(",", "\n") + f"\n{micro}\nAC {ac}, {mem}"


def plan_figure(plan: Plan, top: int) -> Figure:
    """The top `top` rows of `plan` (those the table shows): bars of GiB per GPU, stacked by `PEAK_PARTS` (parts
    that are 0 on every row left out of the legend), the host's bar beside where a row offloads, the budget line."""
    rows, request = plan.rows[:top], plan.request
    parts = [peak_parts(row.memory) for row in rows]
    host = [host_bytes(row.memory) / GiB for row in rows]
    figure = _figure(min(40.0, max(8.0, 1.0 + 1.4 * len(rows))), 6.5)
    ax = figure.add_subplot()
    width, shift = (0.4, 0.21) if any(host) else (0.6, 0.0)
    gpu_x, bottom = [i - shift for i in range(len(rows))], [0.0] * len(rows)
    for part in PEAK_PARTS:
        heights = [p[part] / GiB for p in parts]
        if any(heights):
            ax.bar(gpu_x, heights, width, bottom=bottom, label=LEGEND[part], color=COLORS[part])
            bottom = [b + h for b, h in zip(bottom, heights)]
    values = [(x, row.memory.peak / GiB, "" if row.fits else " (does not fit)") for x, row in zip(gpu_x, rows)]
    values += [(x + 2 * shift, held, "") for x, held in zip(gpu_x, host) if held]
    for x, value, note in values:
        ax.annotate(f"{value:.1f}{note}", (x, value), ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                    textcoords="offset points", bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
    if any(host):
        share = request.host_budget_bytes
        ax.bar([x + 2 * shift for x in gpu_x], host, width, label=HOST + ("" if share is None else
               f", of {share / GiB:.1f} GiB per GPU"), facecolor="white", edgecolor="0.3", hatch="///")
    budget = request.budget_bytes / GiB
    ax.axhline(budget, color="black", linestyle="--", linewidth=1.2, label=f"{BUDGET}: {budget:.1f} GiB")
    ax.set_xticks(range(len(rows)), [_row_label(i + 1, row) for i, row in enumerate(rows)], fontsize=8)
    ax.set_ylim(0, 1.12 * max([budget, *bottom, *host]))
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"{request.model.name} on {request.world} x {request.hardware.name}, seq {request.seq_len:,}, "
                 f"{request.global_batch_tokens:,} tokens per step, {request.mixed_precision}\npredicted memory per "
                 f"GPU of the top {len(rows)} layouts (peak: torch.cuda.max_memory_reserved)", fontsize=10)
    figure.legend(fontsize=8, loc="outside lower center", ncols=2)
    return figure


def _tokens(value: float, _position: object = None) -> str:
    for size, unit in ((2**20, "M"), (2**10, "k")):
        if value >= size:
            return f"{value / size:g}{unit}"
    return f"{value:g}"


def max_seq_figure(row: Longest, request: Request, lengths: list[int] | None = None) -> Figure:
    """`row`'s curves (`longest.curves`) at `lengths` (default `longest.curve_lengths`): the GPU's predicted peak
    against the sequence with the budget line above, the host memory per GPU with its share below; a vertical line
    at each longest sequence found."""
    from matplotlib.ticker import FuncFormatter

    lengths = lengths or curve_lengths(row)
    drawn = curves(row, request, lengths)
    figure = _figure(10.0, 7.5)
    gpu, host = figure.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    for i, (label, memories) in enumerate(drawn.items()):
        style = {"color": f"C{i}", "linestyle": "-" if i == 0 else ("--" if i < len(drawn) - 1 else ":"),
                 "linewidth": 2.2 if i == 0 else 1.4, "label": label}
        gpu.plot(lengths, [memory.peak / GiB for memory in memories], marker=".", **style)
        held = [host_bytes(memory) / GiB for memory in memories]
        if any(held):
            host.plot(lengths, held, marker=".", **style)
    budget, share = request.budget_bytes / GiB, request.host_budget_bytes
    gpu.axhline(budget, color="black", linestyle="--", linewidth=1.2, label=f"{BUDGET}: {budget:.1f} GiB")
    if share is not None:
        line = host.axhline(share / GiB, color="black", linestyle="--", linewidth=1.2,
                            label=f"host memory per GPU: {share / GiB:.1f} GiB")
        host.legend(handles=[line], fontsize=8, loc="upper left")  # the curves: the legend above
        host.set_ylim(0, 1.6 * share / GiB)
    for name, color in (("all", "C0"), ("plain", f"C{len(drawn) - 1}")):
        if row.tokens[name]:
            for ax in (gpu, host):
                ax.axvline(row.tokens[name], color=color, linewidth=0.8, alpha=0.6)
            gpu.annotate(f"longest: {row.tokens[name]:,}", (row.tokens[name], 1.5 * budget), rotation=90,
                         ha="right", va="top", fontsize=8, color=color)
    gpu.set_xscale("log", base=2)
    host.xaxis.set_major_formatter(FuncFormatter(_tokens))
    gpu.set_ylim(0, 1.6 * budget)
    gpu.set_ylabel("predicted peak, GiB per GPU")
    host.set_ylabel("host memory, GiB per GPU")
    host.set_xlabel("tokens per sequence (one sequence per data-parallel rank)")
    gpu.set_title(f"{request.model.name} on {request.world} x {request.hardware.name}, {row.layout.name}, "
                  f"{request.mixed_precision}: memory against the sequence, with and without each feature",
                  fontsize=10)
    gpu.legend(fontsize=8, loc="upper left")
    return figure


def save(figure: Figure, path: str | Path) -> Path:
    """Write `figure` to `path` (its format by the suffix), making its folder; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path
