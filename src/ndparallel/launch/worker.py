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

When the launch asked for sizes (``NDPARALLEL_<SIZE>`` set), the script's Hugging Face Trainer is taken over by
`ndparallel.integrations` and a plain Accelerate ``Accelerator`` is refused: `after_import` arranges that when the
script imports ``transformers.trainer`` or ``accelerate.accelerator``, without importing anything before then.
"""

import os
import sys

# Run as a file, this file's directory (the ndparallel package) heads sys.path and would shadow the script's imports
# (its config.py, data.py...): the script's directory takes its place below, as `python SCRIPT` would have it.
if __name__ == "__main__" and sys.path and os.path.realpath(sys.path[0]) == os.path.dirname(os.path.realpath(__file__)):
    del sys.path[0]

import importlib
import importlib.abc
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


class _PostImportHooks(importlib.abc.MetaPathFinder):
    """Runs callbacks on a module right after its first import (`after_import`). One instance on ``sys.meta_path``
    (recognised by ``ndparallel_post_import``: this file is loaded both as a script and as ``ndparallel.launch.worker``)."""

    ndparallel_post_import = True

    def __init__(self) -> None:
        self.hooks: dict = {}  # module name -> ["package.module:function", ...], until the module is imported

    def add(self, name: str, target: str) -> None:
        if target not in self.hooks.setdefault(name, []):
            self.hooks[name].append(target)

    def find_spec(self, name, path, target=None):  # noqa: ANN001 -- importlib's protocol
        if name not in self.hooks:
            return None
        for finder in sys.meta_path:  # whoever would have found it: only its loader is wrapped
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HookedLoader(spec.loader, self)
                return spec
        return None


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader, hooks: _PostImportHooks) -> None:  # noqa: ANN001
        self.loader, self.post_import = loader, hooks

    def __getattr__(self, name: str):  # get_filename, get_source, is_package...: the real loader's
        return getattr(self.loader, name)

    def create_module(self, spec):  # noqa: ANN001
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:  # noqa: ANN001
        self.loader.exec_module(module)
        # Read the targets only now: one may have been added while the module was executing (by an import it made).
        for target in self.post_import.hooks.pop(module.__name__, []):
            _call(target, module)


def _call(target: str, module) -> None:  # noqa: ANN001
    where, _, function = target.partition(":")
    getattr(importlib.import_module(where), function)(module)


def after_import(name: str, target: str) -> None:
    """Call `target` (``"package.module:function"``, imported only then) with module `name` once `name` is imported
    -- at once if it already is. Each target runs once per module. A module still executing its import (one of its
    own imports got here) is not imported yet: the target runs when it is."""
    module = sys.modules.get(name)
    if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
        _call(target, module)
        return
    hooks = next((f for f in sys.meta_path if getattr(f, "ndparallel_post_import", False)), None)
    if hooks is None:
        hooks = _PostImportHooks()
        sys.meta_path.insert(0, hooks)
    hooks.add(name, target)


def launch_sizes() -> dict:
    """The sizes ``ndparallel launch`` passed (``NDPARALLEL_<FIELD>_SIZE`` set by the launcher), {} without."""
    sizes = {}
    for key, value in os.environ.items():
        if key.startswith("NDPARALLEL_") and key.endswith("_SIZE") and value.strip().lstrip("-").isdigit():
            sizes[key[len("NDPARALLEL_"):].lower()] = int(value)
    return sizes


INTEGRATION_HOOKS = ("transformers.trainer", "accelerate.accelerator")  # see ndparallel.integrations
# The Axolotl modules whose functions `ndparallel.integrations.axolotl` replaces, or that import one by name
AXOLOTL_HOOKS = ("axolotl.utils.config", "axolotl.utils.distributed", "axolotl.monkeypatch.accelerate.parallelism_config",
                 "axolotl.train", "axolotl.cli.config", "axolotl.loaders.model", "axolotl.core.builders.base")


def attach_integrations() -> None:
    """Attach `ndparallel.integrations` as the script imports what they concern: the Trainer's and Accelerate's when
    the launch has sizes; Axolotl's always (an Axolotl config brings its own sizes: the integration reads them and
    attaches the Trainer's)."""
    names = AXOLOTL_HOOKS
    if any(size != 1 for size in launch_sizes().values()):
        names = INTEGRATION_HOOKS + names
    for name in names:
        after_import(name, "ndparallel.integrations:on_import")


# = ndparallel.distributed.runtime.HEARTBEAT_ENV (this file imports no ndparallel)
HEARTBEAT_DIR_ENV = "NDPARALLEL_HEARTBEAT_DIR"
STACK_SIGNAL = signal.SIGUSR1 if hasattr(signal, "SIGUSR1") else None
_stack_file = None  # kept open: faulthandler writes into it from a signal handler


def stacks_on_request() -> None:
    """Under ``ndparallel launch --stall-timeout``: on `STACK_SIGNAL`, write every thread's Python stack to
    ``<heartbeat dir>/stack_<RANK>.txt`` (faulthandler: from the signal handler itself, so even a rank blocked inside
    a native collective answers). The launcher reads it to tell a rank stuck in its own code from ranks that only
    wait for it (`ndparallel.launch.supervision.StallWatch`)."""
    global _stack_file
    directory = os.environ.get(HEARTBEAT_DIR_ENV)
    if not directory or STACK_SIGNAL is None:
        return
    import faulthandler

    try:
        _stack_file = open(os.path.join(directory, f"stack_{os.environ.get('RANK', '0')}.txt"), "w")  # noqa: SIM115
    except OSError:
        return
    faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True, chain=False)


def main(argv: list) -> None:
    die_with_launcher()
    attach_integrations()
    stacks_on_request()
    try:
        _run(argv)
    finally:
        # Whatever the script was (ndparallel's Accelerator, stock Accelerate, the Trainer, plain torch) and however
        # it ended, a gloo process group it left behind is released at exit while the interpreter is whole
        # (`ndparallel.distributed.runtime.release_at_exit`); torch is imported here only if the script imported it.
        if "torch.distributed" in sys.modules:
            from ndparallel.distributed.runtime import release_at_exit  # absolute: this file runs by path

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
