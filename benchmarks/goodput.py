"""Goodput under failures: live fault tolerance against restarting from a checkpoint, the same run side by side
(docs/failures.md).

    python benchmarks/goodput.py [--steps 60] [--kills 13,26,39] [--checkpoint-every 10] [--step-seconds 0.5]

The run: tests/scripts/fault_tolerant_train.py (a small MLP, AdamW, 2 x 2 ranks: dp_replicate 2 x dp_shard 2, on
the CPU), `--steps` optimizer steps of `--step-seconds` each. Four launches:

- fault tolerant (``--fault-tolerant``), with no kill and with a SIGKILL of one rank of replica group 1 at each of
  `--kills` (the k-th kill on the group's k-th start); torchrun restarts that group, it heals from group 0, which
  keeps stepping meanwhile;
- checkpoint and restart (``--max-restarts``, save_state every `--checkpoint-every` steps, load_state on start), with
  no kill and with the same kills (of the job's last rank); torchrun restarts every rank, which redo the steps since
  the last checkpoint.

Printed: the wall time of each launch, the optimizer steps the run ended with, how many groups' batches went into
its updates (out of 2 per step: a group that is down or healing contributes none) and those per second (the goodput),
the wall time lost per kill (the killed launch's time less the clean one's, over the kills) and the ratio of the two
ways' lost time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "fault_tolerant_train.py"


def launch(out: Path, fault_tolerant: bool, args: argparse.Namespace, kills: list[int]) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NDPARALLEL_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.setdefault("RUST_LOG", "warn")
    mode = (["--fault-tolerant", "--quorum-timeout", "30", "--ft-timeout", "20"] if fault_tolerant
            else ["--max-restarts", str(len(kills))])
    script_args = ["--steps", str(args.steps), "--step-seconds", str(args.step_seconds),
                   *(["--checkpoint-every", str(args.checkpoint_every)] if not fault_tolerant else []),
                   *(a for k in kills for a in ("--kill-at", str(k)))]
    command = [sys.executable, "-m", "ndparallel", "launch", "--cpu", *mode, "--dp-replicate-size", "2",
               "--dp-shard-size", "2", "--nproc-per-node", "4", str(SCRIPT), str(out), *script_args]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    seconds = time.monotonic() - start
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return seconds


def contributions(out: Path, fault_tolerant: bool, steps: int) -> tuple[int, int]:
    """(optimizer steps the run ended with, groups' batches in its updates)."""
    if not fault_tolerant:  # every update averages both groups' batches; steps redone after a restart count once
        done = int((out / "steps_replica0_rank0.txt").read_text())
        return done, 2 * done
    logs = [[json.loads(line) for line in p.read_text().splitlines()] for p in sorted((out / "log").glob("*.jsonl"))]
    committed = {r["step"] for recs in logs for r in recs if r["committed"]}
    batches = sum(r["committed"] and r["participating"] for recs in logs for r in recs)
    return len(committed), batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kills", default="13,26,39", help="steps at which a rank is killed, comma-separated")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.5)
    args = parser.parse_args()
    kills = [int(k) for k in args.kills.split(",") if k]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fault_tolerant in (("fault tolerant", True), ("checkpoint + restart", False)):
            times = {}
            for label, these in (("clean", []), ("killed", kills)):
                out = Path(tmp) / f"{fault_tolerant}-{label}"
                out.mkdir()
                times[label] = launch(out, fault_tolerant, args, these)
                rows[(name, label)] = (times[label], *contributions(out, fault_tolerant, args.steps))
            rows[(name, "lost")] = (times["killed"] - times["clean"]) / max(len(kills), 1)
    print(f"{args.steps} steps of {args.step_seconds} s, 2 groups x 2 ranks (CPU), kills at steps {kills}, "
          f"checkpoints every {args.checkpoint_every} steps (restart way)")
    print(f"{'':22} {'run':7} {'wall s':>7} {'steps':>6} {'batches':>8} {'batches/s':>10}")
    for name in ("fault tolerant", "checkpoint + restart"):
        for label in ("clean", "killed"):
            wall, steps, batches = rows[(name, label)]
            print(f"{name:22} {label:7} {wall:7.1f} {steps:6d} {batches:5d}/{2 * args.steps} {batches / wall:10.2f}")
    ft, ck = rows[("fault tolerant", "lost")], rows[("checkpoint + restart", "lost")]
    print(f"wall time lost per kill: fault tolerant {ft:.1f} s, checkpoint + restart {ck:.1f} s "
          f"(ratio {ft / ck:.2f})" if ck > 0 else f"wall time lost per kill: {ft:.1f} s vs {ck:.1f} s")


if __name__ == "__main__":
    main()
