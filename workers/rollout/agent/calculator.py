"""The built-in calculator tool: exact, bounded arithmetic on a parsed expression, never ``eval``.

::

    calc = Calculator()
    calc.call(expression="2 * (3 + 4) - 10 / 4")      # "11.5"
    calc.call(expression="__import__('os')")          # ValueError: function calls are not allowed; ...
    evaluate("2 ** 0.5")                               # 1.4142135623730951 (the number, unformatted)

The expression is parsed with ``ast.parse(mode="eval")`` and only these nodes
are walked: int and float literals, the binary operators ``+ - * / // % **``,
unary ``+`` and ``-``, and parentheses (which leave no node). Anything else
(names, calls, attributes, subscripts, comparisons, strings, ...) is refused
with a ValueError before anything is computed; the ToolBox turns that into an
error observation for the model.

Guards: the expression is at most ``max_expression_chars`` long; an exponent
is at most ``max_exponent`` in magnitude and a power whose result would pass
``max_abs_value`` is refused before it is computed; every intermediate value
must stay finite and within ``max_abs_value``; a division or modulo by zero
says so. Integers stay exact; results are printed as integers when they are
whole (``6 / 3`` gives ``2``) and otherwise with 10 significant digits
(``1 / 3`` gives ``0.3333333333``).
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Callable

from workers.rollout.agent.tool import Tool

__all__ = ["Calculator", "evaluate", "format_number"]

_BINARY: dict[type, tuple[str, Callable]] = {
    ast.Add: ("+", operator.add), ast.Sub: ("-", operator.sub), ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv), ast.FloorDiv: ("//", operator.floordiv), ast.Mod: ("%", operator.mod),
    ast.Pow: ("**", operator.pow),
}
_UNARY: dict[type, tuple[str, Callable]] = {ast.UAdd: ("+", operator.pos), ast.USub: ("-", operator.neg)}
_OPERATOR_SYMBOLS = {
    ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^", ast.LShift: "<<", ast.RShift: ">>", ast.MatMult: "@",
    ast.Not: "not", ast.Invert: "~",
}
_REFUSED = {
    ast.Name: "names are not allowed", ast.Call: "function calls are not allowed",
    ast.Attribute: "attribute access is not allowed", ast.Subscript: "subscripts are not allowed",
    ast.Compare: "comparisons are not allowed", ast.BoolOp: "'and' / 'or' are not allowed",
    ast.Lambda: "lambdas are not allowed", ast.IfExp: "conditional expressions are not allowed",
    ast.Tuple: "tuples (a ',' outside a number) are not allowed", ast.List: "lists are not allowed",
    ast.Dict: "dicts are not allowed", ast.Set: "sets are not allowed", ast.JoinedStr: "strings are not allowed",
    ast.NamedExpr: "assignments are not allowed", ast.Starred: "'*' unpacking is not allowed",
}
ALLOWED = "numbers, + - * / // % ** and parentheses"


def _refuse(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"names are not allowed ({node.id!r})"
    if isinstance(node, ast.Constant):
        return f"only int and float numbers are allowed, got {type(node.value).__name__} {node.value!r}"
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        symbol = _OPERATOR_SYMBOLS.get(type(node.op), type(node.op).__name__)
        return f"operator {symbol!r} is not allowed"
    for kind, message in _REFUSED.items():
        if isinstance(node, kind):
            return message
    return f"{type(node).__name__} expressions are not allowed"


def _check_tree(node: ast.AST) -> None:
    """Refuse any node outside the arithmetic subset, before anything is computed."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        _check_tree(node.left)
        _check_tree(node.right)
        return
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        _check_tree(node.operand)
        return
    raise ValueError(f"{_refuse(node)}; the calculator takes {ALLOWED}")


def format_number(value: int | float) -> str:
    """An int as is; a whole float (below 1e16) as an int; any other float with 10 significant digits."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return format(value, ".10g")


def evaluate(expression: str, max_expression_chars: int = 200, max_exponent: int = 1000,
             max_abs_value: int = 10**30) -> int | float:
    """The value of an arithmetic ``expression`` (see the module docstring); ValueError for anything refused."""
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be a string, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise ValueError(f"the expression is empty; the calculator takes {ALLOWED}")
    if len(text) > max_expression_chars:
        raise ValueError(f"the expression is {len(text)} characters long; the limit is {max_expression_chars}")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError) as exc:
        reason = exc.msg if isinstance(exc, SyntaxError) else str(exc)
        raise ValueError(f"not an arithmetic expression ({reason}); the calculator takes {ALLOWED}") from None
    except (RecursionError, MemoryError):
        raise ValueError("the expression is nested too deeply") from None
    try:
        _check_tree(tree.body)
        return _Evaluator(max_exponent, max_abs_value).value(tree.body)
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None


class _Evaluator:
    def __init__(self, max_exponent: int, max_abs_value: int) -> None:
        self.max_exponent = max_exponent
        self.max_abs_value = max_abs_value

    def checked(self, value: int | float) -> int | float:
        if isinstance(value, complex):
            raise ValueError("the result is not a real number")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"a value is too large (the limit is {self.max_abs_value:.0e} in magnitude)")
        if abs(value) > self.max_abs_value:
            raise ValueError(f"a value is too large (the limit is {self.max_abs_value:.0e} in magnitude)")
        return value

    def value(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant):
            return self.checked(node.value)
        if isinstance(node, ast.UnaryOp):
            return self.checked(_UNARY[type(node.op)][1](self.value(node.operand)))
        assert isinstance(node, ast.BinOp)
        left, right = self.value(node.left), self.value(node.right)
        symbol, function = _BINARY[type(node.op)]
        if symbol == "**":
            self.check_power(left, right)
        try:
            return self.checked(function(left, right))
        except ZeroDivisionError:
            raise ValueError(f"division by zero (in {format_number(left)} {symbol} {format_number(right)})") from None
        except OverflowError:
            raise ValueError(f"a value is too large (the limit is {self.max_abs_value:.0e} in magnitude)") from None

    def check_power(self, base: int | float, exponent: int | float) -> None:
        if abs(exponent) > self.max_exponent:
            raise ValueError(f"the exponent {format_number(exponent)} is too large (the limit is "
                             f"{self.max_exponent} in magnitude)")
        if base < 0 and isinstance(exponent, float) and not exponent.is_integer():
            raise ValueError(f"a negative number to a fractional power (({format_number(base)}) ** "
                             f"{format_number(exponent)}) is not a real number")
        if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > math.log10(self.max_abs_value):
            raise ValueError(f"{format_number(base)} ** {format_number(exponent)} is too large (the limit is "
                             f"{self.max_abs_value:.0e} in magnitude)")


class Calculator(Tool):
    """Arithmetic on one expression string (``evaluate``), its result printed by ``format_number``."""

    name = "calculator"
    description = "Evaluate an arithmetic expression with numbers, + - * / // % ** and parentheses."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "for example (12 + 3) * 4 / 5"}},
        "required": ["expression"],
        "additionalProperties": False,
    }
    timeout_s = 2.0
    max_expression_chars = 200
    max_exponent = 1000
    max_abs_value = 10**30

    def call(self, expression: str) -> str:
        return format_number(evaluate(expression, self.max_expression_chars, self.max_exponent, self.max_abs_value))
