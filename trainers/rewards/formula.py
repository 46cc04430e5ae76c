"""The ``multi`` grader's formula (``calculate_output``): numbers, the sub-graders' names, + - * /, and
``min``/``max``/``abs`` calls. One checker for the API (``service/graders/shapes.py``, at job creation) and
the worker (``trainers.rewards.graders``, before grading), so both accept exactly the same formulas.

Standard library only: the service imports this module (and ``trainers.registry``) and nothing else of
``trainers``, per DESIGN.md's import rules, without loading torch.

>>> tree = parse_formula("0.5 * a + max(b, 0.2) / 2", ["a", "b"])
>>> eval_formula(tree, {"a": 1.0, "b": 0.0})
0.6
>>> parse_formula("a ** 2", ["a"])
Traceback (most recent call last):
...
trainers.rewards.formula.FormulaError: calculate_output may only use + - * /
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping, Sequence

__all__ = ["FUNCTIONS", "FormulaError", "eval_formula", "parse_formula"]

FUNCTIONS: dict[str, Callable[..., float]] = {"min": min, "max": max, "abs": abs}
_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class FormulaError(ValueError):
    """The formula is not one ``eval_formula`` may run; the message says why."""


def parse_formula(formula: str, names: Sequence[str]) -> ast.Expression:
    """Parse ``formula`` over the grader ``names``; raise ``FormulaError`` on anything else."""
    try:
        tree = ast.parse(formula, mode="eval")
    except SyntaxError as exc:
        raise FormulaError(f"calculate_output is not a valid formula: {exc.msg}") from exc
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if not (isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS) or node.keywords:
                raise FormulaError("calculate_output may only call min, max and abs")
            if not node.args:
                raise FormulaError("min, max and abs need arguments")
        elif isinstance(node, ast.Name):
            is_function = id(node) in called
            if not is_function and node.id not in names:
                raise FormulaError(f"calculate_output uses {node.id!r}, which is not a grader name")
        elif isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, int | float):
                raise FormulaError("calculate_output may only contain numbers")
        elif isinstance(node, ast.BinOp):
            if type(node.op) not in _BINARY:
                raise FormulaError("calculate_output may only use + - * /")
        elif isinstance(node, ast.UnaryOp):
            if type(node.op) not in _UNARY:
                raise FormulaError("calculate_output may only use + - * /")
        elif not isinstance(node, ast.Expression | ast.Load | ast.operator | ast.unaryop):
            raise FormulaError(f"calculate_output may not contain {type(node).__name__}")
    return tree


def eval_formula(tree: ast.Expression, values: Mapping[str, float]) -> float:
    """Evaluate a formula checked by ``parse_formula``; a division by zero is NaN."""

    def ev(node: ast.expr) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return float(node.value)
        if isinstance(node, ast.Name):
            return values[node.id]
        if isinstance(node, ast.BinOp):
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                return math.nan
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp):
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            return float(FUNCTIONS[node.func.id](*[ev(arg) for arg in node.args]))
        raise AssertionError(f"unchecked formula node {type(node).__name__}")

    return ev(tree.body)
