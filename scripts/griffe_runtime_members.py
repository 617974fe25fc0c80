"""A griffe extension for the API reference (mkdocs.yml loads it into mkdocstrings): class members that griffe's static
analysis sees only as the line of source that made them get the signature they have when the code runs.

- a property made by a call (``device = property(lambda self: ...)``, ``dp_shard_rank = _axis_property(...)``,
  ``fsdp_plugin = _setting(...)``) is shown as the property it is -- writable when it has a setter, with its getter's
  return annotation and the docstring it carries at run time -- instead of ``name = property(lambda self: ...)``;
- a second name of a method or property of the same class (``clear = free_memory``) is shown with that member's
  signature and says whose other name it is;
- an attribute set in ``__init__`` (``self.mesh = ParallelMesh(...)``) is shown without the expression it was
  computed from (a line over the constructor's locals, no default), typed by the class it was built from, if any.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

import griffe


def _runtime_class(cls: griffe.Class) -> type | None:
    """The class `cls` describes, imported from the sources griffe read (None if the import finds other ones)."""
    src = str(Path(cls.package.filepath).parent.parent)
    if cls.package.name not in sys.modules and src not in sys.path:
        sys.path.insert(0, src)
    module = importlib.import_module(cls.module.path)
    if Path(module.__file__ or "").resolve() != Path(cls.module.filepath).resolve():
        return None
    obj: Any = module
    for part in cls.path[len(cls.module.path) + 1:].split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


def _docstring(text: str, parent: griffe.Object, like: griffe.Docstring | None) -> griffe.Docstring:
    return griffe.Docstring(inspect.cleandoc(text), parent=parent, parser=like.parser if like else None,
                            parser_options=like.parser_options if like else None)


class RuntimeMembers(griffe.Extension):
    def on_class(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        if not cls.path.startswith("ndparallel."):
            return
        runtime = None
        for name, member in list(cls.members.items()):
            if member.is_alias or not member.is_attribute or member.value is None:
                continue
            value = member.value
            if "class-attribute" not in member.labels:  # set in a method: the expression is no default
                member.value = None
                if member.annotation is None and isinstance(value, griffe.ExprCall):
                    callee = value.function
                    try:
                        target = cls.modules_collection.get_member(callee.canonical_path) if hasattr(
                            callee, "canonical_path") else None
                    except Exception:  # noqa: BLE001 -- a name griffe cannot resolve: leave it untyped
                        target = None
                    if target is not None and target.is_class:
                        member.annotation = callee
                continue
            if isinstance(value, griffe.ExprName) and value.name in cls.members and value.name != name:
                original = cls.members[value.name]
                cls.set_member(name, self._other_name(name, original, member, cls))
                continue
            if isinstance(value, griffe.ExprCall):
                runtime = runtime or _runtime_class(cls)
                prop = runtime and inspect.getattr_static(runtime, name, None)
                if isinstance(prop, property):
                    self._as_property(member, prop, cls)

    @staticmethod
    def _as_property(member: griffe.Attribute, prop: property, cls: griffe.Class) -> None:
        member.value = None
        member.labels = {"property", "writable"} if prop.fset is not None else {"property"}
        if member.docstring is None and prop.__doc__:  # property(doc=...), else its getter's
            member.docstring = _docstring(prop.__doc__, member, cls.docstring)
        returns = inspect.signature(prop.fget).return_annotation if prop.fget else inspect.Signature.empty
        if member.annotation is None and returns not in (inspect.Signature.empty, "Any", Any):
            member.annotation = returns if isinstance(returns, str) else inspect.formatannotation(returns)

    @staticmethod
    def _other_name(name: str, original: griffe.Object, member: griffe.Attribute,
                    cls: griffe.Class) -> griffe.Object:
        doc = f"Another name of `{original.name}`."
        if original.docstring is not None:
            doc += "\n\n" + original.docstring.value
        common = {"lineno": member.lineno, "endlineno": member.endlineno}
        if original.is_function:
            other: griffe.Object = griffe.Function(
                name, **common, returns=original.returns,
                parameters=griffe.Parameters(*(griffe.Parameter(p.name, annotation=p.annotation, kind=p.kind,
                                                                default=p.default) for p in original.parameters)))
        else:
            other = griffe.Attribute(name, **common, annotation=original.annotation)
        other.labels = set(original.labels)
        other.docstring = _docstring(doc, other, original.docstring or cls.docstring)
        return other
