"""What a Hugging Face causal LM does to its logits between its LM head and its loss, read from its forward's source.

A causal LM's forward computes ``logits = self.lm_head(hidden_states[...])``, then ``self.loss_function(logits,
labels, ...)``. The chunked loss (`loss_head`) replaces both by one pass over chunks of tokens, so it must know every
step in between. `head_transforms` reads them from the source of the model class's ``forward`` (its syntax tree; the
model itself is only read, never run): the statements after the head's call and before the loss's that assign the
logits must be ``x = x * E``, ``x = x / E``, ``x = torch.tanh(x)`` or ``x = x.float()`` -- E an expression of
``self`` (the model: ``self.config.final_logit_softcapping``, ``self.logit_scale``), evaluated now to a number --
inside ``if C:`` blocks whose condition C is evaluated now too (``self.config.final_logit_softcapping is not
None``); any other use of the logits before the loss makes the model ineligible, with that statement as the reason.
Gemma's soft-capping, Cohere's ``logit_scale`` and Granite's ``logits_scaling`` read this way; a model whose source
cannot be read is ineligible.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import torch
from torch import nn

from .cross_entropy import Transform

_TRANSFORM_OPS = {ast.Mult: "mul", ast.Div: "div"}


class Ineligible(Exception):
    """The model's forward does something to its logits the chunked loss cannot reproduce (the message says what)."""


def head_transforms(model: nn.Module, head_name: str) -> tuple[Transform, ...]:
    """The elementwise steps `model`'s forward applies to ``self.<head_name>(...)``'s output before handing it to
    ``self.loss_function`` (module docstring); raises `Ineligible`."""
    forward = inspect.unwrap(type(model).forward)
    try:
        source = textwrap.dedent(inspect.getsource(forward))
    except (OSError, TypeError):
        raise Ineligible(f"the source of {type(model).__name__}.forward is not available") from None
    function = ast.parse(source).body[0]
    reader = _Reader(model, head_name)
    reader.block(function.body)
    if reader.logits is None:
        raise Ineligible(f"{type(model).__name__}.forward never calls self.{head_name}(...) into a variable")
    if not reader.done:
        raise Ineligible(f"{type(model).__name__}.forward does not pass self.{head_name}'s output to "
                         "self.loss_function")
    return tuple(reader.transforms)


class _Reader:
    def __init__(self, model: nn.Module, head_name: str) -> None:
        self.model, self.head_name = model, head_name
        self.logits: str | None = None  # the variable holding the head's output
        self.transforms: list[Transform] = []
        self.done = False  # the loss call was reached

    def block(self, statements: list[ast.stmt]) -> None:
        for statement in statements:
            if self.done:
                return
            self.statement(statement)

    def statement(self, node: ast.stmt) -> None:
        if self.logits is None:
            head = _head_call_target(node, self.head_name)
            if head is not None:
                self.logits = head
                return
            for child in _child_blocks(node):  # the head may be called inside a block
                self.block(child)
            return
        if _calls_loss(node):
            argument = _loss_logits_argument(node)
            if argument != self.logits:
                raise Ineligible(f"self.loss_function receives {argument!r}, not the head's output "
                                 f"{self.logits!r}: {_line(node)}")
            self.done = True
            return
        if isinstance(node, ast.If) and not _calls_loss_inside(node):
            condition = self._value(node.test, node)
            self.block(node.body if condition else node.orelse)
            return
        if isinstance(node, ast.If):  # e.g. ``if labels is not None: loss = self.loss_function(...)``
            if _uses(node.test, self.logits):
                raise Ineligible(f"the logits are read before the loss: {_line(node)}")
            self.block(node.body)
            return
        if not _uses(node, self.logits):
            return
        transform = self._transform(node)
        if transform is None:
            raise Ineligible(f"the logits are changed or read before the loss by: {_line(node)}")
        self.transforms.append(transform)

    def _transform(self, node: ast.stmt) -> Transform | None:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == self.logits):
            return None
        value, x = node.value, self.logits
        if isinstance(value, ast.BinOp) and type(value.op) in _TRANSFORM_OPS and _is_name(value.left, x) \
                and not _uses(value.right, x):
            return Transform(_TRANSFORM_OPS[type(value.op)], self._number(value.right, node))
        if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult) and _is_name(value.right, x) \
                and not _uses(value.left, x):
            return Transform("mul", self._number(value.left, node))
        if isinstance(value, ast.Call) and not value.keywords and len(value.args) == 1 and _is_name(value.args[0], x) \
                and ast.unparse(value.func) in ("torch.tanh", "torch.nn.functional.tanh", "F.tanh"):
            return Transform("tanh")
        if isinstance(value, ast.Call) and not value.args and not value.keywords \
                and isinstance(value.func, ast.Attribute) and _is_name(value.func.value, x) \
                and value.func.attr == "float":
            return Transform("float")
        return None

    def _value(self, expression: ast.expr, node: ast.stmt) -> Any:
        """`expression` evaluated with ``self`` the model (configs and attributes only; no locals)."""
        names = {n.id for n in ast.walk(expression) if isinstance(n, ast.Name)}
        if names - {"self", "torch", "None", "True", "False"}:
            raise Ineligible(f"a condition on the logits' path reads local variables {sorted(names - {'self'})}: "
                             f"{_line(node)}")
        try:
            return eval(compile(ast.Expression(expression), "<forward>", "eval"), {"torch": torch},  # noqa: S307
                        {"self": self.model})
        except Exception as exc:  # noqa: BLE001 - whatever it raises, the model is not one we can read
            raise Ineligible(f"cannot evaluate {ast.unparse(expression)!r} ({type(exc).__name__}: {exc})") from None

    def _number(self, expression: ast.expr, node: ast.stmt) -> float:
        value = self._value(expression, node)
        if torch.is_tensor(value) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise Ineligible(f"{ast.unparse(expression)!r} is not a number ({value!r}): {_line(node)}")
        return float(value)


def _head_call_target(node: ast.stmt, head_name: str) -> str | None:
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
            and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute) \
            and _is_name(node.value.func.value, "self") and node.value.func.attr == head_name:
        return node.targets[0].id
    return None


def _child_blocks(node: ast.stmt) -> list[list[ast.stmt]]:
    return [getattr(node, name) for name in ("body", "orelse", "finalbody") if isinstance(getattr(node, name, None),
                                                                                          list)]


def _is_loss_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_name(node.func.value, "self") \
        and node.func.attr == "loss_function"


def _calls_loss(node: ast.stmt) -> bool:
    return not isinstance(node, (ast.If, ast.For, ast.While, ast.With, ast.Try)) and any(
        _is_loss_call(n) for n in ast.walk(node))


def _calls_loss_inside(node: ast.stmt) -> bool:
    return any(_is_loss_call(n) for n in ast.walk(node))


def _loss_logits_argument(node: ast.stmt) -> str | None:
    call = next(n for n in ast.walk(node) if _is_loss_call(n))
    for keyword in call.keywords:
        if keyword.arg == "logits":
            return keyword.value.id if isinstance(keyword.value, ast.Name) else ast.unparse(keyword.value)
    if call.args:
        first = call.args[0]
        return first.id if isinstance(first, ast.Name) else ast.unparse(first)
    return None


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _uses(node: ast.AST, name: str) -> bool:
    return any(_is_name(n, name) for n in ast.walk(node))


def _line(node: ast.stmt) -> str:
    text = ast.unparse(node).splitlines()[0]
    return text if len(text) < 100 else text[:97] + "..."
