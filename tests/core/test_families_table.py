"""Tier 1 (no processes): model families are known in one place, `ndparallel.models.families`.

No module of the package outside ``ndparallel/models/`` names a model type of the table (a string equal to one:
``model_type == "gpt_oss"``, ``{"deepseek_v3": ...}``) or a config field that shapes experts (the fields the table's
`Experts`, `Shared` and `RouterLoss` entries name: as a string, an attribute or a keyword argument). Docstrings and
comments may mention them; code asks the table. The scanner is checked on planted violations too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ndparallel.models import families
from ndparallel.models.families import FAMILIES, ROUTER_LOSS

PACKAGE = Path(families.__file__).resolve().parents[1]  # src/ndparallel
TABLE = PACKAGE / "models"


def model_types() -> set[str]:
    return set(FAMILIES)


def expert_fields() -> set[str]:
    """Every config field (and causal-LM attribute of the load-balancing loss) the table names for experts."""
    names = set(ROUTER_LOSS.attributes()) | {ROUTER_LOSS.switch}
    for entry in families.expert_entries():
        names |= {entry.count, entry.top_k, entry.width, entry.first_dense, entry.dense_listed, entry.sparse_step}
        if entry.shared is not None:
            names |= {entry.shared.count, entry.shared.width}
    return names - {None}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                     str):
                out.add(id(first.value))
    return out


def named_facts(source: str, types: set[str], fields: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each model type or expert field that `source` names in code."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if node.value in types:
                found.append((node.lineno, f"model type {node.value!r}"))
            elif node.value in fields:
                found.append((node.lineno, f"expert field {node.value!r}"))
        elif isinstance(node, ast.Attribute) and node.attr in fields:
            found.append((node.lineno, f"expert field .{node.attr}"))
        elif isinstance(node, ast.keyword) and node.arg in fields:
            found.append((node.value.lineno, f"expert field {node.arg}="))
    return sorted(found)


def test_the_scanner_finds_planted_violations():
    types, fields = model_types(), expert_fields()
    planted = '''
"""A docstring may say mixtral and num_local_experts."""
def count(config, model):
    """So may this one: gpt_oss."""
    # and a comment: deepseek_v3
    if config.model_type == "gpt_oss":
        return config.num_local_experts
    table = {"deepseek_v3": getattr(config, "n_routed_experts")}
    build(num_experts_per_tok=2)
    return f"{model.router_aux_loss_coef} olmoe"
'''
    assert named_facts(planted, types, fields) == [
        (6, "model type 'gpt_oss'"), (7, "expert field .num_local_experts"), (8, "expert field 'n_routed_experts'"),
        (8, "model type 'deepseek_v3'"), (9, "expert field num_experts_per_tok="),
        (10, "expert field .router_aux_loss_coef")]
    assert named_facts('"""mixtral, num_experts."""\nx = "llama-3.1-8b"\n', types, fields) == []


def test_the_fields_scanned_are_the_tables():
    assert {"llama", "mixtral", "gpt_oss", "deepseek_v3", "olmoe"} <= model_types()
    assert {"num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
            "first_k_dense_replace", "mlp_only_layers", "decoder_sparse_step", "n_shared_experts",
            "shared_expert_intermediate_size", "router_aux_loss_coef", "output_router_logits"} <= expert_fields()


def test_no_module_outside_the_table_names_a_model_type_or_an_expert_field():
    types, fields = model_types(), expert_fields()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if TABLE in path.parents:
            continue
        found += [f"{path.relative_to(PACKAGE)}:{line}: {what}"
                  for line, what in named_facts(path.read_text(), types, fields)]
    assert not found, "family facts outside ndparallel/models/families.py (ask the table): " + "; ".join(found)


def test_the_table_imports_neither_torch_nor_the_rest_of_the_package():
    """The planner reads it without torch, and every reader may import it: it imports nothing of ndparallel."""
    for path in TABLE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not node.level and (node.module or "").split(".")[0] not in ("torch", "ndparallel"), path
            elif isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] not in ("torch", "ndparallel") for a in node.names), path


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_entry_is_consistent(name):
    """A plan that replaces the model's own says why; a family with experts says how they route; a planned family's
    reason for not modelling tp is text."""
    entry = FAMILIES[name]
    assert (entry.replaces_own_plan is None) or entry.plan, name
    if entry.experts is not None:
        assert entry.experts.count and entry.experts.routing, name
    if entry.planned is not None and entry.planned.tp_not_modelled is not None:
        assert isinstance(entry.planned.tp_not_modelled, str) and entry.planned.tp_not_modelled
