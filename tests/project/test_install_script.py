"""scripts/install.sh where people run it: which interpreter it takes, and a distribution-managed Python (PEP 668).

The script runs for real with a stand-in interpreter on PATH that records how it was called and answers the script's
two probes (is this a distribution-managed Python? is a torch >= the floor installed?) as the test says; nothing is
installed.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

STAND_IN = """#!/bin/sh
echo "$(basename "$0") $*" >> "{log}"
if [ "$1" = "-" ]; then  # a probe read from standard input: the first asks whether the Python is managed
  cat > /dev/null
  if [ ! -e "{log}.probed" ]; then touch "{log}.probed"; exit {managed}; fi
  exit 1  # no torch installed
fi
exit 0
"""


def run_install(tmp_path: Path, names: list[str], managed: bool = False) -> tuple[subprocess.CompletedProcess, str]:
    """install.sh with only `names` (stand-in interpreters) and the tools it needs on PATH."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for name in names:
        path = bin_dir / name
        path.write_text(STAND_IN.format(log=log, managed=0 if managed else 1))
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    for tool in ("dirname", "basename", "cat", "touch"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    proc = subprocess.run(["/bin/bash", str(ROOT / "scripts" / "install.sh")], capture_output=True, text=True,
                          env=env, timeout=60)
    return proc, log.read_text() if log.exists() else ""


def test_python3_is_used_where_python_is_missing(tmp_path):
    proc, calls = run_install(tmp_path, ["python3"])
    assert proc.returncode == 0, proc.stderr
    assert "python3 -m pip install --quiet torch==2.13.0" in calls
    assert "python3 -m pip install --quiet --disable-pip-version-check -e .[hf]" in calls


def test_python_is_preferred_when_both_are_there(tmp_path):
    proc, calls = run_install(tmp_path, ["python", "python3"])
    assert proc.returncode == 0, proc.stderr
    assert calls.splitlines()[-1].startswith("python -m pip install"), calls
    assert "python3" not in calls


def test_no_python_at_all_is_named(tmp_path):
    proc, calls = run_install(tmp_path, [])
    assert proc.returncode == 127
    assert "neither python nor python3 is on PATH" in proc.stderr
    assert calls == ""


def test_a_distribution_managed_python_gets_the_virtual_environment_commands(tmp_path):
    proc, calls = run_install(tmp_path, ["python3"], managed=True)
    assert proc.returncode == 1
    assert "(PEP 668)" in proc.stderr
    assert "python3 -m venv ~/.venvs/ndparallel && . ~/.venvs/ndparallel/bin/activate" in proc.stderr
    assert "pip" not in calls  # refused before pip runs
