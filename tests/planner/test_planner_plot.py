"""``ndparallel plan --plot FILE`` (`ndparallel.planner.plot`): what the figures draw is the planner's own numbers.

The bars are read back from the matplotlib Figure the module builds and compared with the terms ``plan --json``
reports for the same request, grouped here by hand; the --max-seq curves with `estimate` of Recipes built here by
hand. A missing matplotlib is simulated by refusing its import. CI installs matplotlib (the plot extra is in the test
extra); elsewhere the drawing tests are skipped without it.
"""

from __future__ import annotations

import builtins
import json
import os
import re
from pathlib import Path

import pytest

from ndparallel.cli import main
from ndparallel.planner import Recipe, Request, get_hardware, load_model, plan
from ndparallel.planner.footprint import estimate
from ndparallel.planner.longest import QUANTUM, longest

GiB = 2**30
ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
PLAN_8B = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--seq-len", "8192", "--global-batch-tokens", "131072",
           "--top", "4"]
ONE_GPU = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--gpus-per-node", "1", "--seq-len", "65536",
           "--global-batch-tokens", "65536"]  # fits one H100 only with the states in host memory


@pytest.fixture
def plot():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("CI must install the plot extra (bash scripts/install.sh --test installs it)")
        pytest.skip("matplotlib not installed: bash scripts/install.sh --plot")
    from ndparallel.planner import plot

    return plot


def _is_png(path: Path) -> bool:
    from matplotlib.image import imread

    return path.read_bytes()[:8] == PNG and min(imread(path).shape[:2]) > 100


def _expected_parts(terms: dict[str, float]) -> dict[str, float]:
    """The report's terms (``memory_bytes``) grouped as the bars should stack them, by hand."""
    def total(*names: str) -> float:
        return sum(terms.get(name, 0.0) for name in names)

    loss, buffers = total("loss_buffers"), total("head_grad", "layer_buffers", "recompute", "offload_staging")
    return {"parameters": total("params", "unsharded_params", "root_unsharded"),
            "gradients": total("grads", "grad_accumulation"), "optimizer": total("optimizer"),
            "activations": total("activations"), "loss": loss if loss >= buffers else 0.0,
            "backward buffers": buffers if buffers > loss else 0.0, "allocator reserve": total("fragmentation")}


def _request(argv: list[str]) -> Request:
    value = dict(zip(argv[1::2], argv[2::2]))
    return Request(load_model(value["--model"]), get_hardware(value["--gpu"]), 1,
                   int(value.get("--gpus-per-node", 8)), int(value["--seq-len"]), int(value["--global-batch-tokens"]))


@pytest.mark.parametrize("argv", [PLAN_8B, ONE_GPU], ids=["8-gpus", "one-gpu-offloaded"])
def test_the_bars_are_the_terms_the_report_prints(plot, capsys, tmp_path, argv):
    path = tmp_path / "out" / "plan.png"
    assert main(argv + ["--json", "--plot", str(path)]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert _is_png(path) and f"wrote {path}" in out.err
    rows = report["rows"]

    figure = plot.plan_figure(plan(_request(argv)), len(rows))
    ax = figure.axes[0]
    bars = {container.get_label(): list(container) for container in ax.containers}
    host = bars.pop(next((label for label in bars if label.startswith(plot.HOST)), None), None)
    by_part = {part: bars.pop(plot.LEGEND[part], None) for part in plot.LEGEND}
    assert not bars, f"bars of no known part: {list(bars)}"
    tops = [0.0] * len(rows)
    for part, patches in by_part.items():  # stacked in the legend's order, each the report's terms
        want = [_expected_parts(row["memory_bytes"])[part] / GiB for row in rows]
        if patches is None:
            assert not any(want), part
            continue
        assert [p.get_height() for p in patches] == pytest.approx(want, rel=1e-12, abs=1e-12), part
        assert [p.get_y() for p in patches] == pytest.approx(tops, rel=1e-12, abs=1e-12), part
        tops = [t + h for t, h in zip(tops, want)]
    assert tops == pytest.approx([row["memory_bytes"]["peak"] / GiB for row in rows], rel=1e-12)
    held = [row["host_bytes"] / GiB for row in rows]
    if any(held):  # beside the GPU's bar, from 0: not stacked on it
        assert [p.get_height() for p in host] == pytest.approx(held, rel=1e-12)
        assert all(p.get_y() == 0 and p.get_hatch() for p in host)
    else:
        assert host is None
    assert argv is PLAN_8B or any(held)
    budget = [line for line in ax.get_lines() if line.get_label().startswith(plot.BUDGET)]
    assert len(budget) == 1 and list(budget[0].get_ydata()) == [report["request"]["budget_bytes"] / GiB] * 2
    labels = [tick.get_text() for tick in ax.get_xticklabels()]
    for i, (label, row) in enumerate(zip(labels, rows)):  # named as the table names the row
        assert label.startswith(f"#{i + 1}\n") and label.split("\n")[1:-2] == row["name"].split(",")
        assert f"{row['micro_batch']} x {row['gradient_accumulation_steps']}" in label


def test_the_max_seq_curves_are_the_planners_estimates(plot, capsys, tmp_path):
    path = tmp_path / "max_seq.svg"
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--max-seq", "--plot", str(path)]) == 0
    assert "wrote" in capsys.readouterr().err and path.read_text().lstrip().startswith("<?xml")

    request = Request(load_model("llama-3.1-8b"), get_hardware("h100"), 1, 8, 1024, 1024)
    row = longest(request)[0]
    assert row.offload_params and row.head_chunks and row.tokens["all"] > row.tokens["plain"] > 0  # every curve below
    assert row.cp_strategy == "ring"  # cp=8: the ring's curve, and the all-gather's beside it
    step = QUANTUM * 2 * row.layout.cp * row.layout.sp
    lengths = [step, 8 * step, row.tokens["plain"], row.tokens["all"], row.tokens["all"] + step]
    gpu, host = plot.max_seq_figure(row, request, lengths).axes
    lines = {line.get_label(): line for line in gpu.get_lines()}

    def recipe(seq: int, plain: bool = False, **off: bool | str) -> Recipe:  # SETTINGS by hand
        on = {"chunked_loss": False} if plain else {"chunked_loss": True, "tiled_mlp": True, "offload": True,
                                                     "fused_norms": True, "offload_params": True, "head_chunks": True,
                                                     "cp_strategy": "ring"}
        return Recipe(seq, 1, 1, "bf16", True, "adamw", False, **{**on, **off})

    curves = {"every feature": {}, "without chunked loss (C)": {"chunked_loss": False},
              "without tiled MLP (T)": {"tiled_mlp": False}, "without fused RMSNorm (N)": {"fused_norms": False},
              "without head-chunked Ulysses (H)": {"head_chunks": False},
              "without activation offload (O)": {"offload": False},
              "without FSDP2's CPU offload (P)": {"offload_params": False},
              "with the all-gather cp attention": {"cp_strategy": "allgather"}, "plain FSDP2 + AC": None}
    for label, off in curves.items():
        memories = [estimate(request.model, row.layout, recipe(seq, off is None, **(off or {})),
                             request.hardware.fragmentation)
                    for seq in lengths]
        assert list(lines[label].get_xdata()) == lengths
        assert list(lines[label].get_ydata()) == pytest.approx([m.peak / GiB for m in memories], rel=1e-12), label
    every, plain = lines["every feature"].get_ydata(), lines["plain FSDP2 + AC"].get_ydata()
    assert every[3] == pytest.approx(row.memory["all"].peak / GiB, rel=1e-12)  # the search's own at its longest
    assert plain[2] == pytest.approx(row.memory["plain"].peak / GiB, rel=1e-12)
    budget = request.budget_bytes / GiB
    assert plain[2] <= budget < plain[3] and every[3] <= budget
    assert list(lines[f"{plot.BUDGET}: {budget:.1f} GiB"].get_ydata()) == [budget] * 2
    shares = [line for line in host.get_lines() if line.get_label().startswith("host memory per GPU")]
    assert len(shares) == 1 and shares[0].get_ydata()[0] == request.host_budget_bytes / GiB
    held = {line.get_label(): line.get_ydata() for line in host.get_lines()}
    # One step longer: the GPU, not the host (the offloaded layer inputs held at their bytes in the library's host
    # pool leave the 8-GPU row room on the host; the attention's and the norms' backward buffers bind first).
    assert every[-1] > budget and held["every feature"][-1] * GiB <= request.host_budget_bytes
    assert "plain FSDP2 + AC" not in held  # nothing in host memory


@pytest.mark.parametrize("extra", [[], ["--max-seq"]], ids=["plan", "max-seq"])
def test_without_matplotlib_plot_fails_before_the_search_naming_the_install(monkeypatch, capsys, tmp_path, extra):
    import ndparallel.planner
    import ndparallel.planner.longest

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    def searched(*args, **kwargs):
        raise AssertionError("searched before checking --plot")

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    monkeypatch.setattr(ndparallel.planner, "plan", searched)
    monkeypatch.setattr(ndparallel.planner.longest, "longest", searched)
    assert main(PLAN_8B + extra + ["--plot", str(tmp_path / "plan.png")]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "pip install 'ndparallel[plot]'" in err
    assert not (tmp_path / "plan.png").exists()


def test_a_format_matplotlib_cannot_write_is_refused_before_the_search(plot, monkeypatch, capsys, tmp_path):
    import ndparallel.planner

    monkeypatch.setattr(ndparallel.planner, "plan", lambda *a, **k: pytest.fail("searched before checking --plot"))
    assert main(PLAN_8B + ["--plot", str(tmp_path / "plan.xyz")]) == 2
    assert re.search(r"--plot .*plan\.xyz: name a file ending in one of .*\.png", capsys.readouterr().err)


def test_the_docs_images_are_what_their_commands_draw(plot, capsys, tmp_path):
    """Each image docs/planner.md shows is named by a command on the page that writes it, and that command, run
    now, draws the same pixels (with the pinned matplotlib: another version may draw text otherwise)."""
    import matplotlib
    from matplotlib.image import imread

    pinned = re.search(r'"matplotlib==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())[1]
    page = (ROOT / "docs" / "planner.md").read_text()
    shown = re.findall(r"!\[[^\]]*\]\((images/[^)]+\.png)\)", page)
    commands = dict((m[3], m[1]) for m in re.finditer(r"^\$ ndparallel (plan .*--plot (docs/(images/\S+\.png)).*)$",
                                                      page, re.M))
    assert len(shown) >= 2 and set(shown) <= set(commands), (shown, commands)
    assert "images/max_seq_llama8b.png" in (ROOT / "docs" / "long_context.md").read_text()
    if matplotlib.__version__ != pinned:
        pytest.skip(f"matplotlib {matplotlib.__version__}, the images were drawn with {pinned}")
    for image in shown:
        argv = commands[image].split()
        out = tmp_path / Path(image).name
        argv[argv.index("--plot") + 1] = str(out)
        assert main(argv) == 0
        capsys.readouterr()
        committed, drawn = imread(ROOT / "docs" / image), imread(out)
        assert committed.shape == drawn.shape and (committed == drawn).all(), (
            f"docs/{image} is not what `ndparallel {commands[image]}` draws now: run it again")
