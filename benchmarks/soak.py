"""A soak under faults: train under ``ndparallel launch --max-restarts``, SIGKILL a random rank every so often (some
of the kills during a save), and check that the job ends with every loss of a run that was never interrupted.

    python benchmarks/soak.py [--steps 500] [--save-every 25] [--kill-every 50] [--save-kills 0.4] [--seed 0]
                              [--async-save] [--eval-every 5] [--workers 0]
                              [--nproc 4 --dp-replicate-size 2 --dp-shard-size 2] [--max-restarts 20]
                              [--keep-files] [--json-out FILE]

Linux only (it finds the ranks in /proc). Not a test: it runs for minutes and prints figures. Both runs are
`examples/resume.py` -- the README example's model and data (examples/nd_parallel.py), checkpoints every
`--save-every` steps and evaluating every `--eval-every` steps and before every save (an evaluation forward, as
training loops have), with `--workers` data-loader worker processes, resuming from the newest complete checkpoint on
every (re)start -- on the README's layout (HSDP, 2 replicas x 2 shards), launched the same way:

1. the reference: the whole run, nothing killed;
2. the soak: the same command, while this script reads the run's event log (`resume.py --event-log`: every step's
   exact loss, each save's begin and end, each attempt's start and resume) and kills ranks with SIGKILL. The kills
   follow a plan drawn from `--seed`: kill i falls at step T_i = T_{i-1} + a gap drawn uniformly from
   [kill_every/2, 3 kill_every/2]; about `--save-kills` of them are moved to a save step and land during the save
   (after the save began, at a random point of the first half of the time the saves of this run took until their
   staging directory was gone: for `--async-save` that includes the background write), the others at a random point
   of the step after T_i. The rank is drawn at random; its process is found by the environment the launch gave it
   (a tag of this run, `RANK` and the attempt `TORCHELASTIC_RESTART_COUNT`). A kill counts as "during a save" when a
   staging directory (`.checkpoint_<i>.partial`) existed both just before and just after it.

Printed: kills (and how many during a save, and where), restarts, the steps lost (completed steps run again after a
restart), the time each restart took (from the kill to the first step after the resume, split into: until torchrun
had stopped the other ranks, until the new ranks had started, until they had prepared the model, until they had loaded
the checkpoint, the first step), both runs' wall times, the comparison of every
logged loss with the reference's (bit for bit: the same layout on CPU reduces in the same order), the processes of
the run left after the launcher exited (orphans), every evaluation loss against the reference's, and whether every
checkpoint left on disk verifies (sizes and
CRC32s). The exit code is 0 only when all of these hold.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "resume.py"
TAG = "NDPARALLEL_SOAK_TAG"  # in the launcher's environment, so in every rank's: how this script finds its processes


# ---- the plan -------------------------------------------------------------------------------------------------------
@dataclass
class Kill:
    step: int  # a save kill: during the save after this step; else during the step after it
    during_save: bool
    rank: int
    fraction: float  # how far into the save (or the next step) the kill lands, as a fraction of its usual time
    # what happened:
    attempt: int | None = None
    pid: int | None = None
    time: float | None = None
    last_step: int | None = None  # the last step of the killed attempt (the main process's log, read afterwards)
    staging: bool = False  # a .partial staging directory existed just before and just after the kill
    in_save_call: bool = False  # the main process was inside the save_state call (its log: save-begin, no save-end)


def kill_plan(steps: int, save_every: int, kill_every: int, save_kills: float, nproc: int, limit: int,
              seed: int) -> list[Kill]:
    """Kills at steps T_i = T_{i-1} + uniform[kill_every/2, 3 kill_every/2], a fraction `save_kills` of them moved up
    to the next save step; at most `limit` of them (each costs one restart)."""
    rng = random.Random(seed)
    plan: list[Kill] = []
    step = 0
    while len(plan) < limit:
        step += rng.randint(max(1, kill_every // 2), max(1, 3 * kill_every // 2))
        during_save = rng.random() < save_kills
        if during_save:
            step = -(-step // save_every) * save_every
        elif step % save_every == 0:
            step -= 1  # after the step before a save step: the kill lands in the step, not in the save
        if plan and step <= plan[-1].step:  # the last kill was moved up to a save step at or past this one
            step = plan[-1].step + (save_every if during_save else 1)
        if step >= steps + (1 if during_save else 0):
            break
        plan.append(Kill(step, during_save, rng.randrange(nproc), rng.random()))
    return plan


# ---- what the run says --------------------------------------------------------------------------------------------
class EventLog:
    """Reads the JSON lines `resume.py --event-log` appends, as they come."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.rest = path, 0, b""
        self.events: list[dict[str, Any]] = []
        self.unreadable = 0  # lines that are not JSON (a line cut by a kill; none expected: one write per line)

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")
        new = []
        for line in lines:
            try:
                new.append(json.loads(line))
            except ValueError:
                self.unreadable += 1
        self.events += new
        return new


def by_attempt(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per attempt: its start and resume times, the step it resumed at, its steps and their times, its saves."""
    attempts: dict[int, dict[str, Any]] = {}
    for e in events:
        a = attempts.setdefault(e["attempt"], {"steps": {}, "saves": []})
        if e["event"] in ("start", "prepared", "end"):
            a[e["event"]] = e["time"]
        elif e["event"] == "resumed":
            a["resumed"], a["resumed_step"], a["checkpoint"] = e["time"], e["step"], e["checkpoint"]
        elif e["event"] == "step":
            a["steps"][e["step"]] = (e["time"], e["loss"])
        elif e["event"] == "eval":
            a.setdefault("evals", {})[e["step"]] = e["loss"]
        elif e["event"] == "save-begin":
            a["saves"].append({"step": e["step"], "begin": e["time"]})
        elif e["event"] == "save-end" and a["saves"]:
            a["saves"][-1]["end"] = e["time"]
    return attempts


def processes(tag: str) -> dict[int, dict[str, str]]:
    """Every process of this run (launcher and ranks) still alive: pid -> the variables of its environment that
    matter here. Zombies and other users' processes are not readable, hence not listed."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        env = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        if env.get(TAG.encode()) == tag.encode():
            found[int(entry)] = {k: env.get(k.encode(), b"").decode()
                                 for k in ("RANK", "TORCHELASTIC_RESTART_COUNT")}
    return found


def rank_pids(tag: str, attempt: int) -> dict[int, int]:
    """rank -> pid of this attempt's ranks (the worker processes torchrun started: they have RANK)."""
    return {int(v["RANK"]): pid for pid, v in processes(tag).items()
            if v["RANK"] and v["TORCHELASTIC_RESTART_COUNT"] == str(attempt)}


def staging_dirs(checkpoints: Path) -> list[str]:
    try:
        return sorted(p.name for p in checkpoints.iterdir() if p.name.endswith(".partial"))
    except FileNotFoundError:
        return []


# ---- one run ------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    name: str
    returncode: int | None
    wall_s: float
    events: list[dict[str, Any]]
    kills: list[Kill] = field(default_factory=list)
    orphans: dict[int, dict[str, str]] = field(default_factory=dict)
    hung: str | None = None
    checkpoints: Path | None = None
    unreadable_lines: int = 0
    launcher_out: str = ""


def launch(args: argparse.Namespace, directory: Path, plan: list[Kill]) -> Run:
    """Run examples/resume.py under `ndparallel launch`; carry out the kills of `plan` meanwhile."""
    directory.mkdir(parents=True)
    log_path = directory / "events.jsonl"
    checkpoints = directory / "project" / "checkpoints"
    cmd = [sys.executable, "-m", "ndparallel.cli", "launch", "--nproc-per-node", str(args.nproc),
           "--dp-replicate-size", str(args.dp_replicate_size), "--dp-shard-size", str(args.dp_shard_size),
           "--max-restarts", str(args.max_restarts), str(EXAMPLE), "--project-dir", str(directory / "project"),
           "--steps", str(args.steps), "--checkpoint-every", str(args.save_every), "--keep", str(args.keep),
           "--event-log", str(log_path), "--eval-every", str(args.eval_every), "--workers", str(args.workers),
           *(["--async-save"] if args.async_save else [])]
    tag = uuid.uuid4().hex
    env = {**os.environ, TAG: tag}
    log = EventLog(log_path)
    todo = list(plan)
    done: list[Kill] = []
    save_times: list[float] = []  # from save-begin until its staging directory was seen gone
    open_save: dict[str, Any] | None = None  # the save under way: its step, attempt, begin time
    attempt, last_step, last_event = 0, 0, time.time()
    step_times: list[float] = []  # between consecutive steps without a save or restart between them
    prev_step_time: float | None = None
    kill_at: float | None = None  # when the next kill is due, once its moment has come
    pids: dict[int, int] = {}  # rank -> pid in the current attempt
    print(f"[{directory.name}] {' '.join(cmd)}", flush=True)
    started = time.time()
    with open(directory / "launcher.out", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        hung = None
        try:
            while proc.poll() is None:
                now = time.time()
                for e in log.poll():
                    last_event = now
                    if e["attempt"] > attempt:
                        attempt, last_step, open_save = e["attempt"], 0, None
                        print(f"[{directory.name}] attempt {attempt} started", flush=True)
                    if e["event"] == "step":
                        if last_step and e["step"] == last_step + 1 and prev_step_time is not None:
                            step_times.append(e["time"] - prev_step_time)
                        last_step, prev_step_time = e["step"], e["time"]
                        if e["step"] % 50 == 0:
                            print(f"[{directory.name}] step {e['step']} (attempt {attempt})", flush=True)
                    elif e["event"] == "resumed":  # every rank has started (prepare is collective): find them now
                        last_step, prev_step_time = e["step"], None
                        pids = rank_pids(tag, attempt)
                    elif e["event"] == "save-begin":
                        open_save = {"step": e["step"], "attempt": e["attempt"], "begin": e["time"], "ended": False}
                        prev_step_time = None
                    elif e["event"] == "save-end" and open_save is not None:
                        open_save["ended"] = True
                if open_save is not None and open_save["ended"] and not staging_dirs(checkpoints):
                    save_times.append(time.time() - open_save["begin"])
                    open_save = None
                if todo and kill_at is None and _due(todo[0], attempt, last_step, open_save, done) is not None:
                    usual = (statistics.median(save_times[1:] or save_times) if todo[0].during_save and save_times
                             else 0.3 if todo[0].during_save
                             else statistics.median(step_times[-20:]) if step_times else 0.1)
                    # A save kill lands in the first half of a usual save (seen from here, the save looks longer than
                    # it is: this process reads the log and the directory late on a loaded machine).
                    kill_at = now + todo[0].fraction * usual * (0.5 if todo[0].during_save else 1.0)
                if kill_at is not None and now >= kill_at:
                    kill, kill_at = todo.pop(0), None
                    _kill(kill, pids, attempt, last_step, open_save, checkpoints)
                    if kill.pid is not None:
                        done.append(kill)
                        where = "during a save" if kill.staging else \
                            "after the save had committed" if kill.during_save else "mid-step"
                        print(f"[{directory.name}] killed rank {kill.rank} (pid {kill.pid}) after step "
                              f"{kill.last_step} or so, {where}", flush=True)
                if now - last_event > args.hang_timeout:
                    hung = f"no event for {args.hang_timeout:.0f} s (attempt {attempt}, last step {last_step})"
                    break
                time.sleep(0.005)
        finally:
            if proc.poll() is None:  # hung, or this script was interrupted: stop the launcher, its ranks die with it
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    wall = time.time() - started
    log.poll()
    orphans = _orphans(tag)
    return Run(directory.name, None if hung else proc.returncode, wall, log.events, done, orphans, hung, checkpoints,
               log.unreadable, (directory / "launcher.out").read_text(errors="replace"))


def stopped_at(launcher_out: str, kill: Kill) -> float | None:
    """When torchrun reported the killed rank failed -- after it had stopped the others -- from its log line
    ``E1126 13:43:05.584000 ... failed (exitcode: -9) local_rank: 1 (pid: 21684)`` (None if not found)."""
    match = re.search(rf"^[EW](\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+) .*failed \(exitcode: -9\).*\(pid: {kill.pid}\)",
                      launcher_out, re.MULTILINE)
    if match is None or kill.time is None:
        return None
    month, day, hour, minute, second = match.groups()
    when = datetime.datetime.fromtimestamp(kill.time).replace(month=int(month), day=int(day), hour=int(hour),
                                                              minute=int(minute), second=0, microsecond=0)
    return when.timestamp() + float(second)


def _due(kill: Kill, attempt: int, last_step: int, open_save: dict[str, Any] | None, done: list[Kill]) -> Kill | None:
    """`kill` if its moment has come: in an attempt after the last kill's, at its step (a save kill: once the save
    of its step began)."""
    if done and attempt <= done[-1].attempt:
        return None  # the ranks of the killed attempt are still going down
    if kill.during_save:
        return kill if open_save is not None and open_save["step"] >= kill.step and open_save["attempt"] == attempt \
            else None
    return kill if last_step >= kill.step else None


def _kill(kill: Kill, pids: dict[int, int], attempt: int, last_step: int, open_save: dict[str, Any] | None,
          checkpoints: Path) -> None:
    if kill.rank not in pids:
        return  # the attempt is ending anyway (the launch finished, or a rank failed on its own)
    before = staging_dirs(checkpoints)
    try:
        os.kill(pids[kill.rank], signal.SIGKILL)
    except ProcessLookupError:
        return  # it had just ended
    kill.time = time.time()
    after = staging_dirs(checkpoints)
    kill.attempt, kill.pid, kill.last_step = attempt, pids[kill.rank], last_step
    kill.staging = bool(set(before) & set(after))
    kill.in_save_call = open_save is not None and not open_save["ended"]


def _orphans(tag: str, wait_s: float = 10.0) -> dict[int, dict[str, str]]:
    """The run's processes still alive `wait_s` after its launcher exited (then killed, by pid)."""
    deadline = time.time() + wait_s
    while (left := processes(tag)) and time.time() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def verify_checkpoints(checkpoints: Path) -> tuple[list[str], list[str]]:
    """The complete checkpoints left (each checked: sizes and CRC32s of every file) and the problems found."""
    from ndparallel.checkpoint.manifest import read_metadata
    from ndparallel.checkpoint.project import complete_checkpoints
    from ndparallel.checkpoint.storage import CheckpointError, verify_files

    names, problems = [], []
    for path in complete_checkpoints(checkpoints):
        names.append(path.name)
        try:
            verify_files(path, read_metadata(path)["files"])
        except CheckpointError as exc:
            problems.append(str(exc))
    return names, problems


# ---- the report ----------------------------------------------------------------------------------------------------
def report(args: argparse.Namespace, reference: Run, soak: Run) -> bool:
    ref = by_attempt(reference.events)
    runs = by_attempt(soak.events)
    expected = {s: loss for a in ref.values() for s, (_, loss) in a["steps"].items()}
    ok = True

    def check(good: bool, line: str) -> None:
        nonlocal ok
        ok &= good
        print(f"  [{'ok' if good else 'FAIL'}] {line}")

    print(f"\nsoak: {args.steps} steps, checkpoints every {args.save_every} steps "
          f"({'save_state(async_save=True)' if args.async_save else 'blocking save_state'}), "
          f"evaluations every {args.eval_every} steps, {args.workers} loader worker(s), "
          f"{args.nproc} ranks (dp_replicate {args.dp_replicate_size} x dp_shard {args.dp_shard_size}), "
          f"--max-restarts {args.max_restarts}, a kill about every {args.kill_every} steps, seed {args.seed}")
    check(reference.returncode == 0 and len(ref) == 1,
          f"reference: exit code {reference.returncode}, {len(ref)} attempt(s), {len(expected)} steps, "
          f"{reference.wall_s:.1f} s")
    check(soak.returncode == 0 and soak.hung is None,
          f"soak: exit code {soak.returncode}{', ' + soak.hung if soak.hung else ''}, {soak.wall_s:.1f} s "
          f"({soak.wall_s - reference.wall_s:+.1f} s, x{soak.wall_s / reference.wall_s:.2f} the reference's)")

    # Kills and restarts. What the main process had logged by the moment of each kill, from its log (this script may
    # have read the log a little late, on a loaded machine): the last step it completed, whether it was in save_state.
    for k in soak.kills:
        killed = runs.get(k.attempt, {"steps": {}, "saves": []})
        k.last_step = max(killed["steps"], default=killed.get("resumed_step", 0))
        k.in_save_call = any(s["begin"] <= k.time < s.get("end", float("inf")) for s in killed["saves"])
    in_save = [k for k in soak.kills if k.staging]
    restarts = len(runs) - 1
    late = [k.last_step for k in soak.kills if k.during_save and not k.staging]
    print(f"  kills: {len(soak.kills)} ({len(in_save)} during a save: after steps "
          f"{[k.last_step for k in in_save]}, {sum(k.in_save_call for k in in_save)} of them inside the save_state "
          f"call{', the others during the background write' if args.async_save else ''}; "
          + (f"meant for a save but after it had committed: after steps {late}; " if late else "")
          + f"mid-step after steps {[k.last_step for k in soak.kills if not k.staging and not k.during_save]}); "
          f"ranks killed {[k.rank for k in soak.kills]}")
    check(restarts == len(soak.kills), f"restarts: {restarts} (one per kill)")
    lost, rows = 0, []
    for k in soak.kills:
        after = runs.get(k.attempt + 1)
        # The first step after the resume; or, if the killed attempt had finished training (a kill after the last
        # save committed), the end of the attempt that found nothing left to do.
        if after is not None and "resumed" in after and not after["steps"] and "end" in after \
                and after["resumed_step"] == args.steps:
            first = after["end"]
        elif after is not None and "resumed" in after and after["steps"]:
            first = after["steps"][min(after["steps"])][0]
        else:
            check(False, f"the kill after step {k.last_step} (attempt {k.attempt}) was not followed by an attempt "
                         "that resumed and trained")
            continue
        lost_here = k.last_step - after["resumed_step"]
        lost += lost_here
        stopped = stopped_at(soak.launcher_out, k)
        rows.append((k, after, lost_here, first - k.time, None if stopped is None else stopped - k.time,
                     after["start"] - (k.time if stopped is None else stopped), after["prepared"] - after["start"],
                     after["resumed"] - after["prepared"], first - after["resumed"]))
    restart_s = [r[3] for r in rows]
    if rows:
        print(f"  {'kill':>4} {'rank':>4} {'after step':>10} {'in save':>7} {'resumed at':>10} {'lost':>4} "
              f"{'restart s':>9} {'= stop':>6} {'+ start':>7} {'+ prepare':>9} {'+ load':>6} {'+ 1st step':>10}")
        for i, (k, after, lost_here, total, stop, start, prepare, load, first_step) in enumerate(rows):
            print(f"  {i + 1:4d} {k.rank:4d} {k.last_step:10d} {'yes' if k.staging else 'no':>7} "
                  f"{after['resumed_step']:10d} {lost_here:4d} {total:9.1f} "
                  f"{'-' if stop is None else f'{stop:.1f}':>6} "
                  f"{start:7.1f} {prepare:9.1f} {load:6.2f} {first_step:10.2f}")
        print("  restart s: from the kill to the first step after the resume (or the end, when nothing was left to "
              "train) = stop: until torchrun reported the rank failed, having stopped the others (from its log) + "
              "start: until the new ranks had imported torch and transformers and made their Accelerator + prepare: "
              "building and preparing the model + load: load_state + the first step")
        print(f"  lost steps: {lost} in all (completed steps run again after the restarts); time restarting: "
              f"{sum(restart_s):.1f} s in all, {statistics.mean(restart_s):.1f} s per restart (median "
              f"{statistics.median(restart_s):.1f} s, max {max(restart_s):.1f} s), from the kill to the first step "
              "after the resume")
    all_steps = sum(len(a["steps"]) for a in runs.values())
    check(all_steps == args.steps + lost, f"steps run: {all_steps} = {args.steps} + {lost} lost")
    # A kill during a save leaves the previous checkpoint the newest complete one, unless every rank had written its
    # files before it (then rank 0 may still commit the save: its staging directory outlived the kill by a moment).
    committed = [k.last_step for k, after, *_ in rows if k.staging and after["resumed_step"] >= k.last_step]
    if committed:
        print(f"  the saves of steps {committed} were still committed by the ranks left after the kill")

    # Losses: every value logged, first runs and re-runs alike, against the reference.
    logged = [(s, a, loss) for a, run in sorted(runs.items()) for s, (_, loss) in run["steps"].items()]
    last = {s: loss for s, _, loss in logged}  # the last value logged for each step
    missing = sorted(set(expected) - set(last))
    differ = [(s, a, loss, expected.get(s)) for s, a, loss in logged if loss != expected.get(s)]
    differ_last = [s for s in sorted(last) if last[s] != expected.get(s)]
    check(len(expected) == args.steps and not missing and not differ_last,
          f"losses: the last value logged for each of the {len(last)} steps equals the reference's bit for bit"
          + (f"; missing steps {missing[:10]}" if missing else "")
          + (f"; {len(differ_last)} differ, first at step {differ_last[0]}" if differ_last else ""))
    check(not differ, f"losses: all {len(logged)} values logged (re-run steps too) equal the reference's"
          + (f"; {len(differ)} differ: " + ", ".join(f"step {s} attempt {a}: {x!r} vs {y!r}"
                                                        for s, a, x, y in differ[:5]) if differ else ""))
    if args.eval_every:  # the evaluations between steps (and before every save) change nothing, and match too
        expected_evals = {s: loss for a in ref.values() for s, loss in a.get("evals", {}).items()}
        evals = [(s, a, loss) for a, run in sorted(runs.items()) for s, loss in run.get("evals", {}).items()]
        differ_evals = [(s, a, x, expected_evals.get(s)) for s, a, x in evals if x != expected_evals.get(s)]
        check(bool(expected_evals) and not differ_evals,
              f"evaluations: all {len(evals)} evaluation losses logged equal the reference's ({len(expected_evals)} "
              "evaluations in the reference)" + (f"; {len(differ_evals)} differ: " + ", ".join(
                  f"step {s} attempt {a}: {x!r} vs {y!r}" for s, a, x, y in differ_evals[:5]) if differ_evals else ""))
    check(soak.unreadable_lines == 0, f"event log: {soak.unreadable_lines} unreadable line(s)")

    # Orphans and the checkpoints left.
    check(not soak.orphans and not reference.orphans,
          "orphans: no process of either run left once its launcher exited"
          + (f"; left: {soak.orphans or reference.orphans}" if soak.orphans or reference.orphans else ""))
    names, problems = verify_checkpoints(soak.checkpoints)
    leftovers = sorted(p.name for p in soak.checkpoints.iterdir() if p.name.startswith("."))
    check(not problems and bool(names), f"checkpoints left: {names} verify (sizes, CRC32s)"
          + (f"; {problems}" if problems else "") + (f"; also {leftovers}" if leftovers else ""))
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=500, help="optimizer steps")
    p.add_argument("--save-every", type=int, default=25, help="a checkpoint every this many steps")
    p.add_argument("--kill-every", type=int, default=50, help="a kill about every this many steps")
    p.add_argument("--save-kills", type=float, default=0.4, help="the fraction of kills that land during a save")
    p.add_argument("--seed", type=int, default=0, help="draws the kills: steps, ranks, where in the step or save")
    p.add_argument("--async-save", action="store_true", help="save_state(async_save=True): background checkpoints")
    p.add_argument("--eval-every", type=int, default=5,
                   help="an evaluation forward every this many steps and before every save (0: none)")
    p.add_argument("--workers", type=int, default=0, help="data-loader worker processes of the training loop")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--dp-replicate-size", type=int, default=2)
    p.add_argument("--dp-shard-size", type=int, default=2)
    p.add_argument("--max-restarts", type=int, default=20, help="also the most kills the plan holds")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept (total_limit)")
    p.add_argument("--hang-timeout", type=float, default=600.0,
                   help="seconds without an event of the run before it is declared hung")
    p.add_argument("--dir", type=Path, default=None, help="where the runs write (default: a temporary directory)")
    p.add_argument("--keep-files", action="store_true",
                   help="keep the runs' directories (checkpoints, event logs, launcher output); default: delete them")
    p.add_argument("--json-out", type=Path, default=None, help="write the events and kills here")
    args = p.parse_args(argv)
    if not sys.platform.startswith("linux"):
        sys.exit("benchmarks/soak.py finds the ranks' processes in /proc: Linux only")
    plan = kill_plan(args.steps, args.save_every, args.kill_every, args.save_kills, args.nproc, args.max_restarts,
                     args.seed)
    print(f"kill plan (seed {args.seed}): " + ", ".join(
        f"{'save ' if k.during_save else ''}{k.step}: rank {k.rank}" for k in plan), flush=True)
    directory = Path(tempfile.mkdtemp(prefix="ndparallel-soak-", dir=args.dir))
    try:
        reference = launch(args, directory / "reference", [])
        soak = launch(args, directory / "soak", plan)
        ok = report(args, reference, soak)
        if not ok:
            for run in (reference, soak):
                print(f"--- {run.name}: the launcher's output, last lines ---")
                print("\n".join((directory / run.name / "launcher.out").read_text().splitlines()[-60:]))
        if args.json_out is not None:
            args.json_out.write_text(json.dumps({
                "args": {k: str(v) for k, v in vars(args).items()},
                "kills": [k.__dict__ for k in soak.kills],
                "reference_events": reference.events, "soak_events": soak.events,
                "wall_s": {"reference": reference.wall_s, "soak": soak.wall_s}}))
    finally:
        if args.keep_files:
            print(f"the runs' files: {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
