"""What ``ndparallel launch`` runs in each rank before the training script: tie the rank's life to its launcher's,
then run the script exactly as ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) would.

torchrun starts every worker in a session of its own, so when the launcher itself is killed -- ``kill -9``, an
out-of-memory killer, a scheduler -- nothing reaches its workers, and they would train on as orphans, holding their
devices. Here each rank asks Linux to SIGKILL it when its parent dies (``prctl(PR_SET_PDEATHSIG)``, set before the
script starts and checked against the race with an early death); elsewhere (macOS, other POSIX systems) a daemon
thread checks every second that the launcher is still its parent, and kills the rank otherwise. On Windows nothing is
done (no parent-death signal, and ``os.kill(pid, 0)`` there is not a probe).

torchrun runs this file by path (``python -u .../ndparallel/launch/worker.py [-m] TARGET ARGS``), so it imports nothing but
the standard library before the script, and the script sees the ``sys.argv``, ``sys.path[0]`` and ``__main__`` it
would see if Python ran it directly.
"""

import os
import sys

# Run as a file, this file's directory (the ndparallel package) heads sys.path and would shadow the script's imports
# (its config.py, data.py...): the script's directory takes its place below, as `python SCRIPT` would have it.
if __name__ == "__main__" and sys.path and os.path.realpath(sys.path[0]) == os.path.dirname(os.path.realpath(__file__)):
    del sys.path[0]

import runpy
import signal
import threading
import time

LAUNCHER_PID_ENV = "NDPARALLEL_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def alive(pid: int) -> bool:
    """Whether process `pid` exists (always True on Windows, where signal 0 is no probe but CTRL_C_EVENT)."""
    if sys.platform == "win32":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_launcher() -> str:
    """Arrange for this process to be killed when the launcher (``$NDPARALLEL_LAUNCHER_PID``) dies; return how."""
    raw = os.environ.get(LAUNCHER_PID_ENV, "")
    if not raw.isdigit() or sys.platform == "win32":
        return "none"
    launcher = int(raw)
    parent = os.getppid()
    if parent != launcher and not alive(launcher):
        _stop()  # the launcher died before this rank got here
    if sys.platform.startswith("linux") and parent == launcher:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
                if os.getppid() != launcher:  # it died between getppid() and prctl()
                    _stop()
                return "pdeathsig"
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent or not alive(launcher):
                _stop()

    threading.Thread(target=watch, name="ndparallel-launcher-watch", daemon=True).start()
    return "watch"


def main(argv: list) -> None:
    die_with_launcher()
    try:
        _run(argv)
    finally:
        # Whatever the script was (ndparallel's Accelerator, stock Accelerate, the Trainer, plain torch) and however
        # it ended, a gloo process group it left behind is released at exit while the interpreter is whole
        # (`ndparallel.runtime.release_at_exit`); torch is imported here only if the script imported it.
        if "torch.distributed" in sys.modules:
            from ndparallel.runtime import release_at_exit

            release_at_exit()


def _run(argv: list) -> None:
    if argv[:1] == ["-m"]:
        if len(argv) < 2:
            sys.exit("ndparallel worker: -m needs a module name")
        sys.argv = argv[1:]
        sys.path.insert(0, os.getcwd())  # as `python -m`
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        if not argv:
            sys.exit("ndparallel worker: no script given")
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python SCRIPT`
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
