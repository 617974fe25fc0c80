"""Which transformers and Trainers the Hugging Face Trainer integration takes over, and what it refuses
(`ndparallel.integrations.trainer_versions`; `ndparallel.integrations.guard`).

The version policy (older than the floor refused; newer than tested run, with one warning on the main process); hooked
methods that are gone or changed, that a Trainer subclass bypasses, or that another library replaced after ndparallel
attached, each refused by name; a plain Accelerate ``Accelerator`` refused under a launch with sizes. The runs are
test_trainer.py's (its helpers).
"""

from __future__ import annotations

import contextlib

import pytest

from harness import run_ranks
from ndparallel.launch.worker import attach_integrations
from test_trainer import GLOBAL_BATCH, assert_same_run, layout_env, reference, train_job


def stock_accelerator(_: int) -> str:
    attach_integrations()
    from accelerate import Accelerator

    try:
        Accelerator(cpu=True)
    except RuntimeError as exc:
        return str(exc)
    return "built"


def test_a_plain_accelerate_accelerator_is_refused_when_the_launch_has_sizes():
    """Never silently something else: under `ndparallel launch --cp-size 2`, accelerate's Accelerator would train
    plain data parallelism; every rank refuses it, before any collective, saying what to do."""
    for message in run_ranks(stock_accelerator, 2, 0, env=layout_env(cp=2), timeout=120):
        assert message.startswith("ndparallel launch was asked for cp(2), but this script builds accelerate's "
                                  "Accelerator"), message
        assert "from ndparallel import Accelerator" in message


def test_older_transformers_are_refused_newer_ones_warned_about():
    """The version policy: older than the floor is refused with it; a patch or pre-release of a tested minor is
    tested; a newer minor (or major) than the newest tested gives a warning that names the tested range."""
    from ndparallel.integrations.trainer import TESTED_TRANSFORMERS, check_version

    oldest, newest = TESTED_TRANSFORMERS
    for version in ("5.15.1", "5.15.99", "4.57.0"):
        with pytest.raises(RuntimeError, match=rf"needs transformers >= {oldest} \(tested: {oldest} to {newest}\), "
                                               rf"but transformers {version} is installed"):
            check_version(version)
    for version in ("5.16.0", "5.16.1", "5.20.2", "5.24.0", "5.25.0", "5.25.3", "5.25.0rc1"):
        assert check_version(version) is None, version
    for version in ("5.26.0", "5.26.0.dev0", "6.0.0"):
        warning = check_version(version)
        assert warning is not None and f"transformers {version} is newer than any" in warning
        assert f"({oldest} to {newest})" in warning and "pip install 'transformers<5.26'" in warning


def test_the_integration_module_still_gives_the_names_its_parts_define():
    """`ndparallel.integrations.trainer`'s docstring: the public names of trainer_accelerator, trainer_sequence and
    trainer_checkpoints (which that module held before they were split off) import from it, as the same objects."""
    import ast
    import importlib
    import inspect

    import ndparallel.integrations.trainer as integration

    for part in ("trainer_accelerator", "trainer_sequence", "trainer_checkpoints"):
        module = importlib.import_module(f"ndparallel.integrations.{part}")
        tree = ast.parse(inspect.getsource(module))
        defined = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
        defined += [target.id for node in tree.body if isinstance(node, ast.Assign) for target in node.targets
                    if isinstance(target, ast.Name)]
        defined += [node.target.id for node in tree.body if isinstance(node, ast.AnnAssign)]
        public = [name for name in defined if not name.startswith("_")]
        assert public, part
        assert [name for name in public if getattr(integration, name, None) is not getattr(module, name)] == [], part


def _fake_transformers_trainer(**methods):
    """A stand-in for ``transformers.trainer`` whose Trainer has the hooked methods with the expected parameters,
    but where `methods` says otherwise (None: the method is gone)."""
    import types

    from ndparallel.integrations.trainer import HOOKS
    from ndparallel.integrations.trainer_versions import EXPECTED_PARAMETERS

    assert HOOKS.keys() == EXPECTED_PARAMETERS.keys()  # every replaced method is checked, and only those

    def stand_in(parameters):
        namespace: dict = {}
        exec(f"def method({', '.join(parameters)}): return 'original'", namespace)  # noqa: S102
        return namespace["method"]

    body = {name: stand_in(expected) for name, expected in EXPECTED_PARAMETERS.items()}
    body["__init__"] = lambda self, args: setattr(self, "args", args)
    for name, parameters in methods.items():
        if parameters is None:
            del body[name]
        else:
            body[name] = stand_in(parameters)
    module = types.ModuleType("transformers.trainer")
    module.Trainer = type("Trainer", (), body)
    module.Accelerator = object
    module.skip_first_batches = stand_in(("dataloader", "num_batches"))
    return module


def test_a_hook_that_is_gone_or_changed_is_refused_by_name_when_a_layout_is_asked_for():
    """Capability, not version number: where a hooked method is gone or takes other parameters, nothing is replaced,
    and a Trainer asked for a layout is refused naming each; without a layout it runs as transformers made it."""
    import types

    from ndparallel import ParallelismConfig
    from ndparallel.integrations.trainer import hook_problems, install

    assert hook_problems(_fake_transformers_trainer()) == []
    module = _fake_transformers_trainer(_get_num_items_in_batch=None, _wrap_model=("self", "model", "training"))
    assert hook_problems(module) == [
        "Trainer._get_num_items_in_batch is gone",
        "Trainer._wrap_model takes (self, model, training), where the integration was written for "
        "(self, model, training, dataloader)"]
    install(module)
    assert module.Trainer.save_model(None, None, False) == "original"  # nothing replaced
    with pytest.raises(RuntimeError, match=r"cannot take over this Trainer \(transformers .*\): Trainer\."
                                           r"_get_num_items_in_batch is gone; Trainer\._wrap_model takes"):
        module.Trainer(types.SimpleNamespace(parallelism_config=ParallelismConfig(cp_size=2))
                       ).create_accelerator_and_postprocess()
    plain = module.Trainer(types.SimpleNamespace(parallelism_config=None))
    assert plain.create_accelerator_and_postprocess() == "original"


def test_a_trainer_subclass_that_bypasses_a_hook_is_refused_by_name():
    """TRL's trainers, Axolotl's and users' subclasses: an override that calls the Trainer's own keeps the hook (TRL's
    GRPOTrainer._load_optimizer_and_scheduler does); one that does not would silently bypass it, and is refused."""
    import transformers.trainer as module

    from ndparallel.integrations.trainer import check_support

    attach_integrations()

    class KeepsTheHook(module.Trainer):
        def save_model(self, output_dir=None, _internal_call=False):
            return super().save_model(output_dir, _internal_call)

    class Bypasses(KeepsTheHook):
        def _load_optimizer_and_scheduler(self, checkpoint):
            return None

    assert check_support(object.__new__(KeepsTheHook), module) is None
    with pytest.raises(RuntimeError, match=r"test_trainer_support\..*Bypasses\._load_optimizer_and_scheduler "
                                           r"overrides it without calling the Trainer's own"):
        check_support(object.__new__(Bypasses), module)


def test_a_hook_another_library_replaced_on_the_trainer_is_refused_by_name(monkeypatch):
    """A library that assigns its own method to ``Trainer`` after ndparallel attached (Axolotl's ``patch_prepare_cp``
    empties ``_prepare_context_parallel_inputs``) would silently take the layout's step away: refused, naming it."""
    import transformers.trainer as module

    from ndparallel.integrations.trainer import check_support

    attach_integrations()
    assert check_support(object.__new__(module.Trainer), module) is None

    def _prepare_context_parallel_inputs(self, model, inputs):
        return contextlib.nullcontext, inputs

    monkeypatch.setattr(module.Trainer, "_prepare_context_parallel_inputs", _prepare_context_parallel_inputs)
    with pytest.raises(RuntimeError, match=r"Trainer\._prepare_context_parallel_inputs was replaced after ndparallel "
                                           r"attached \(by test_trainer_support\..*_prepare_context_parallel_inputs\)"):
        check_support(object.__new__(module.Trainer), module)


def newer_transformers_than_tested(output_dir: str) -> dict:
    """A Trainer run under a transformers that says it is newer than any tested: the warnings each rank gave."""
    import warnings

    import transformers

    transformers.__version__ = "5.99.0"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = train_job(output_dir, {"per_device": GLOBAL_BATCH // 2})
    out["warnings"] = [str(w.message) for w in caught if "is newer than any" in str(w.message)]
    return out


@pytest.mark.slow
def test_a_newer_transformers_than_tested_runs_with_one_warning_on_the_main_process(tmp_path, tmp_path_factory):
    results = run_ranks(newer_transformers_than_tested, 2, str(tmp_path), env=layout_env(dp_shard=2), timeout=600)
    assert [len(result["warnings"]) for result in results] == [1, 0]
    assert "transformers 5.99.0 is newer than any" in results[0]["warnings"][0]
    assert_same_run(results, reference(tmp_path_factory))
