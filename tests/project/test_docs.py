"""Every code block of README.md and docs/**/*.md (the documentation site's pages) runs as written.

Blocks are fenced with a language: ``python`` blocks run, ``bash`` blocks are commands (tests/project/
test_readme_commands.py runs them, each after its install in a fresh environment), ``text`` blocks are output,
synopses and listings. A python block says how to run it in an HTML comment on
the line before its fence, invisible on the rendered page::

    <!-- run: ranks=4 setup=training -->

``ranks``: forked gloo processes (tests/harness.py). ``setup``: one of `SETUPS`, code run first in the block's
namespace, standing for what the page assumes the reader already has (a model, a data set, ...); ``*_size=N`` keys
give the sizes of the prepared Accelerator of the ``prepared`` setup. Each block runs in a fresh directory.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness import run_ranks

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"(?:<!-- run: (?P<marker>[^>]*) -->\n)?^```(?P<lang>\S*)\n(?P<code>.*?)^```$", re.S | re.M)
LANGUAGES = ("python", "bash", "text", "yaml")

_DATA = '''
import torch
import torch.nn.functional as F
from tiny_models import VOCAB, TokenDataset
from tiny_models import build_model as _tiny_model

seq_len = 16
dataset = TokenDataset(32, seq_len, VOCAB, uneven_labels=True)  # rows of {"input_ids", "labels"}


def build_model():
    return _tiny_model("llama")


def build_moe_model():
    return _tiny_model("qwen3_moe")


class _Counter:  # "anything with state_dict() / load_state_dict()"
    count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


my_object = _Counter()
'''
_TRAINING = _DATA + '''
model = build_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=100)
dataloader = torch.utils.data.DataLoader(dataset, batch_size=2)
'''
_PREPARED = _TRAINING + '''
from ndparallel import Accelerator, ParallelismConfig

accelerator = Accelerator(parallelism_config=ParallelismConfig(**SIZES))
model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
model.train()
batch = next(iter(dataloader))
'''
_PRETRAINED = _DATA + '''
from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=-1),
                          fsdp_plugin=FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True))
'''
SETUPS = {
    "data": _DATA,  # build_model(), build_moe_model(), dataset, seq_len, my_object; torch and F imported
    "training": _TRAINING,  # + model, optimizer, scheduler, dataloader, not prepared
    "prepared": _PREPARED,  # + accelerator (sizes from the marker), all four prepared, model.train(), one batch
    "pretrained": _PRETRAINED,  # + a tiny model saved in path/to/local/model, an accelerator loading after sharding
}


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    code: str
    options: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks() -> list[Block]:
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text[: m.start("lang")].count("\n") + 1
            options = dict(item.split("=", 1) for item in (m["marker"] or "").split())
            out.append(Block(path, line, m["lang"], m["code"], options))
    return out


BLOCKS = _blocks()
PYTHON = [b for b in BLOCKS if b.lang == "python"]


def test_every_block_says_what_it_is():
    assert len(BLOCKS) > 10 and len(PYTHON) >= 9
    for block in BLOCKS:
        assert block.lang in LANGUAGES, f"{block.id}: fence the block as one of {LANGUAGES}, not {block.lang!r}"
        if block.lang == "python":
            assert block.options.get("setup") in SETUPS and block.options.get("ranks", "").isdigit(), (
                f"{block.id}: a python block needs <!-- run: ranks=N setup=one of {sorted(SETUPS)} --> before it")
        else:
            assert not block.options, f"{block.id}: only python blocks take run options"


def _run(code: str, setup: str, sizes: dict[str, int], where: str, cwd: str) -> bool:
    os.chdir(cwd)
    namespace: dict = {"__name__": "__doc_block__", "SIZES": sizes}
    exec(compile(setup, "<setup>", "exec"), namespace)
    exec(compile(code, where, "exec"), namespace)
    return True


def _save_tiny_pretrained(directory: Path) -> None:
    from tiny_models import build_model

    import torch

    torch.manual_seed(0)
    build_model("llama").save_pretrained(directory)


@pytest.mark.slow
@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_block_runs(block, tmp_path):
    options = block.options
    if options["setup"] == "pretrained":
        _save_tiny_pretrained(tmp_path / "path" / "to" / "local" / "model")
    sizes = {k: int(v) for k, v in options.items() if k.endswith("_size")}
    assert run_ranks(_run, int(options["ranks"]), block.code, SETUPS[options["setup"]], sizes,
                     str(block.path.relative_to(ROOT)) + f":{block.line}", str(tmp_path)) == [True] * int(
        options["ranks"])


@pytest.mark.slow
def test_the_readme_loop_runs_under_context_parallelism(tmp_path):
    """The headline loop with the layout changed to cp_size=2 (the README says it runs under any layout)."""
    block = PYTHON[0]
    assert block.path.name == "README.md" and "dp_replicate_size=2, dp_shard_size=2)" in block.code
    code = block.code.replace("dp_replicate_size=2, dp_shard_size=2)", "dp_shard_size=2, cp_size=2)")
    assert run_ranks(_run, 4, code, SETUPS["data"], {}, "README.md (cp)", str(tmp_path)) == [True] * 4
