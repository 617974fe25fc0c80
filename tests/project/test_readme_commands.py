"""Every shell command the docs show runs after exactly the install the docs give for it, in a fresh environment.

Which blocks are commands: the fenced ``bash`` blocks of README.md, examples/README.md and docs/*.md (``text`` blocks
are output, synopses and listings; ``python`` blocks are tests/project/test_docs.py's). Each line of a block, less
its ``# comment``, is one or more commands joined by ``&&``, run from the repository root.

The install a command needs: an install command is one that starts with ``bash scripts/install.sh``; every other
command needs the nearest install command before it in its section of its document (before its ``&&``, on an earlier
line of its block, or in an earlier block of the section). An install holds to the end of the section it is written
in: up to the next heading of its section's level or higher (or to the end of the document, if written before the
first heading). A command with no install in force fails `test_every_command_declares_its_install`: put the install
in its block, or earlier in its section.

How they run: one virtual environment per distinct install command, all made side by side (``python -m venv``, no
system site packages, so a package the install does not bring is missing), with the CPU torch wheel that
scripts/install.sh pins (the CPU build from pip's configured sources: ``pip download``; never a CUDA build), then the
install command, in a copy of the repository (src, scripts, examples, pyproject.toml, README.md) so that nothing is
written into the checkout. Each command then runs there with the environment's ``bin`` first on PATH and no
PYTHONPATH. Each distinct (install, command) runs once.

What the test changes in a command (`SHORTEN`): a script that trains gets a small step count -- its step flag's
value replaced, or the flag appended when the command does not give it -- and its last line of output is checked.
What it does not run is listed in `NOT_RUN`, each with its reason, and reported as a skip.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
INSTALL = "bash scripts/install.sh"
# What the copy of the repository holds: what the install and the commands read.
PROJECT = ["src", "scripts", "examples", "pyproject.toml", "README.md"]

# A training script -> (its step flag, the small value the test gives it, what its output says at the end).
SHORTEN = {
    "examples/nd_parallel.py": ("--steps", "2", "done: 2 steps"),
    "examples/trainer_clm.py": ("--max_steps", "2", "'train_loss'"),  # the Trainer's summary
    "examples/sft.py": ("--max_steps", "2", "'train_loss'"),
}
# Commands not run here, each with why: (a regular expression over the command, the reason).
NOT_RUN = [
    (r"^python -m pytest$", "the test suite itself: .ci/run runs this command, after its install, verbatim"),
]


@dataclass(frozen=True)
class Command:
    doc: str  # the document's path from the repository root
    line: int
    text: str
    install: str | None  # the install command it needs (None: none before it)

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}:{self.text[:60]}"


def _commands(paths=DOCS, root=ROOT) -> list[Command]:
    out = []
    for path in paths:
        install, install_level, level, fence = None, 0, 0, None
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("```"):
                fence = line[3:].strip() if fence is None else None
                continue
            if fence is None:  # prose: a heading as high as the install's own ends its section, and the install
                if heading := re.match(r"(#+) ", line):
                    level = len(heading[1])
                    if level <= install_level:
                        install, install_level = None, 0
                continue
            line = line.split(" #")[0].strip()
            if fence != "bash" or not line or line.startswith("#"):
                continue
            for command in (c.strip() for c in line.split("&&")):
                if command.startswith(INSTALL):
                    install, install_level = command, level
                else:
                    out.append(Command(str(path.relative_to(root)), number, command, install))
    return out


COMMANDS = _commands()
# Each distinct (install, command) runs once: the first place it is shown stands for the others.
_FIRST: dict[tuple, Command] = {}
for _command in COMMANDS:
    _FIRST.setdefault((_command.install, _command.text), _command)
DISTINCT = list(_FIRST.values())


def _not_run(command: str) -> str | None:
    return next((reason for pattern, reason in NOT_RUN if re.search(pattern, command)), None)


def shortened(command: str) -> tuple[str, str | None]:
    """The command with a small step count for the script it trains, and the text its output ends with."""
    words = shlex.split(command)
    script = next((w for w in words if w in SHORTEN), None)
    if script is None:
        assert not any(w.startswith("examples/") and w.endswith(".py") for w in words), (
            f"{command!r} runs an example SHORTEN does not list: add its step flag there")
        return command, None
    flag, value, marker = SHORTEN[script]
    if flag in words:
        words[words.index(flag) + 1] = value
    else:
        words += [flag, value]  # after the script: its own arguments
    return shlex.join(words), marker


def test_every_command_declares_its_install():
    assert any(c.doc == "README.md" for c in COMMANDS) and any(c.doc == "examples/README.md" for c in COMMANDS)
    missing = [c.id for c in COMMANDS if c.install is None]
    assert not missing, (f"commands with no `{INSTALL} ...` in force (earlier in their section): {missing}; put the "
                         "install the command needs in its block")


def test_the_rules_read_the_docs_as_meant(tmp_path):
    """The extraction and the rewrite on a made-up document: each command gets the install in force before it."""
    doc = tmp_path / "doc.md"
    doc.write_text("```bash\npython a.py\n```\n## One\n```bash\nbash scripts/install.sh && examples/x  # note\n```\n"
                   "### One.one\n```text\nbash scripts/install.sh --fp8\n# not a heading\n```\n```bash\n# a comment\n"
                   "python b.py\n```\n## Two\n```bash\npython c.py\nbash scripts/install.sh --trainer\n"
                   "python examples/sft.py --output_dir o\n```\n")
    found = [(c.text, c.install, c.line) for c in _commands([doc], tmp_path)]
    assert found == [("python a.py", None, 2), ("examples/x", "bash scripts/install.sh", 6),
                     ("python b.py", "bash scripts/install.sh", 15), ("python c.py", None, 19),
                     ("python examples/sft.py --output_dir o", "bash scripts/install.sh --trainer", 21)]
    assert shortened("python examples/sft.py --output_dir o") == (
        "python examples/sft.py --output_dir o --max_steps 2", "'train_loss'")
    assert shortened("ndparallel launch --nproc-per-node 2 examples/nd_parallel.py --steps 100 --model qwen2") == (
        "ndparallel launch --nproc-per-node 2 examples/nd_parallel.py --steps 2 --model qwen2", "done: 2 steps")
    with pytest.raises(AssertionError, match="SHORTEN"):
        shortened("python examples/resume.py")


def test_what_is_not_run_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    skipped = [c for c in COMMANDS if _not_run(c.text)]
    for pattern, _ in NOT_RUN:
        assert any(re.search(pattern, c.text) for c in skipped), f"NOT_RUN's {pattern!r} matches no command: drop it"
    for command in skipped:
        assert f"{command.install} && {command.text}" in ci, f"{command.id}: not what .ci/run runs"


# ---- the fresh environments ------------------------------------------------------------------------------------------

def _torch_pin() -> str:
    match = re.search(r'"torch==([0-9.]+)"', (ROOT / "scripts" / "install.sh").read_text())
    assert match, "scripts/install.sh pins the torch it installs"
    return match[1]


def _clean_env(venv: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "NDPARALLEL_", "VIRTUAL_ENV", "CONDA_"))}
    env["PYTHONNOUSERSITE"] = "1"
    if venv is not None:
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(venv)
    return env


def _run(argv, cwd, env, timeout=900, shell=False) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, shell=shell)
    assert result.returncode == 0, f"{argv}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


class Environments:
    """A fresh virtual environment per install command. All are made when the first is asked for, side by side in
    threads (an install mostly waits on the package index and the disk), from one download of the torch wheel."""

    def __init__(self, base: Path, installs: list[str]):
        self.base, self.installs, self.made = base, list(dict.fromkeys(installs)), {}
        self.pool = ThreadPoolExecutor(max_workers=max(len(self.installs), 1))

    def __getitem__(self, install: str) -> Path:
        """The repository copy in which `install` ran, its environment in .venv."""
        if not self.made:
            wheel = self._torch_wheel()
            self.made = {i: self.pool.submit(self._make, i, self.base / f"env{n}", wheel)
                         for n, i in enumerate(self.installs)}
        return self.made[install].result()

    def _torch_wheel(self) -> Path:
        wheels = self.base / "wheels"
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
              "-d", str(wheels), f"torch=={_torch_pin()}"], self.base, _clean_env(None))
        (wheel,) = wheels.glob("torch-*.whl")
        if "+cpu" not in wheel.name:
            pytest.fail(f"pip's sources give {wheel.name}, not a CPU build of torch: put a CPU wheel where pip "
                        "finds it (PIP_FIND_LINKS) to run this test")
        return wheel

    @staticmethod
    def _make(install: str, where: Path, wheel: Path) -> Path:
        for name in PROJECT:
            source = ROOT / name
            if source.is_dir():
                shutil.copytree(source, where / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
            else:
                shutil.copy2(source, where / name)
        venv = where / ".venv"
        _run([sys.executable, "-m", "venv", str(venv)], where, _clean_env(None))
        # PIP_COMPILE=0: no bytecode for every installed module (half of installing torch); what runs compiles its own
        env = {**_clean_env(venv), "PIP_COMPILE": "0"}
        _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)], where, env)
        _run(install, where, env, shell=True)
        return where


@pytest.fixture(scope="module")
def environments(request, tmp_path_factory):
    """The environments of the commands this session runs (a -k selection makes only those it needs)."""
    selected = [item.callspec.params["command"] for item in request.session.items
                if item.originalname == "test_command_runs_after_its_install"]
    made = Environments(tmp_path_factory.mktemp("fresh"), [c.install for c in selected if not _not_run(c.text)])
    yield made
    made.pool.shutdown(cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("command", DISTINCT, ids=[c.id for c in DISTINCT])
def test_command_runs_after_its_install(command, environments):
    if reason := _not_run(command.text):
        pytest.skip(f"{command.text!r} not run here: {reason}")
    assert command.install is not None, f"{command.id}: no install declared (test_every_command_declares_its_install)"
    text, marker = shortened(command.text)
    where = environments[command.install]
    result = subprocess.run(text, shell=True, cwd=where, env=_clean_env(where / ".venv"), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, (f"{command.id}: `{text}` after `{command.install}` exited {result.returncode}\n"
                                    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    if marker is not None:
        assert marker in result.stdout, f"{command.id}: no {marker!r} in its output\n{result.stdout[-3000:]}"
