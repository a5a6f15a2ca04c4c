"""Arithmetic and unit conversion as MCP tools.

Expressions are read by a small Pratt parser over our own tokens and evaluated as
they are parsed: nothing reaches eval/exec, no attribute or string syntax exists,
and the only names are those in FUNCTIONS and CONSTANTS. Guards bound what one
call can cost: expression length, nesting depth, and the size of every integer
result, which is checked *before* a power is computed (so ``9**9**9`` is refused
in microseconds instead of being attempted).

Calculator conventions, where they differ from Python: ``^`` is a power like
``**``; ``log`` is base 10 (``ln`` is natural); ``round`` rounds halves away from
zero; ``%`` after a number with no operand following is a percentage
(``15%`` is 0.15, ``15% of 80`` is 12), and between two operands it is modulo.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal, localcontext
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field

from whet.servers import units

MAX_EXPRESSION_CHARS = 1000
MAX_DEPTH = 64
MAX_INT_DIGITS = 1000
_MAX_INT_BITS = math.floor(MAX_INT_DIGITS * math.log2(10))  # every integer under this has <= 1000 digits

Number = int | float


class CalcError(ValueError):
    """The expression cannot be evaluated; the message names the problem and, where it can, the fix."""


@dataclass(frozen=True)
class _Token:
    kind: str  # "num", "name", "op" or "end"
    text: str
    position: int  # 1-based, for messages


_TOKEN = re.compile(
    r"(?P<num>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)"
    r"|(?P<name>[A-Za-z_][A-Za-z_0-9]*)"
    r"|(?P<op>\*\*|//|[-+*/%^(),×÷−])"
)
_OP_SPELLINGS = {"×": "*", "÷": "/", "−": "-", "^": "**"}
_BAD_CHARACTER_HINTS = {
    ".": "attribute access is not supported",
    "'": "strings are not supported",
    '"': "strings are not supported",
    "[": "indexing and lists are not supported",
    "=": "assignments and comparisons are not supported",
}


def _tokenize(expression: str) -> list[_Token]:
    tokens: list[_Token] = []
    position = 0
    while position < len(expression):
        if expression[position].isspace():
            position += 1
            continue
        match = _TOKEN.match(expression, position)
        if match is None:
            char = expression[position]
            hint = _BAD_CHARACTER_HINTS.get(char, "only numbers, operators, parentheses and known names work")
            raise CalcError(f"Unexpected character {char!r} at position {position + 1}: {hint}.")
        kind = match.lastgroup or "op"
        text = _OP_SPELLINGS.get(match.group(), match.group())
        tokens.append(_Token(kind, text, position + 1))
        position = match.end()
    tokens.append(_Token("end", "", len(expression) + 1))
    return tokens


def _checked(value: object) -> Number:
    """Refuse results that are complex, not finite, or integers past MAX_INT_DIGITS."""
    if isinstance(value, complex):
        raise CalcError("The result is not a real number (e.g. a fractional power of a negative number).")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("The result is too large (or not a number) for a floating-point value.")
    if isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
        raise CalcError(f"The result has more than {MAX_INT_DIGITS} digits; that is beyond this calculator.")
    assert isinstance(value, int | float)
    return value


def _power(base: Number, exponent: Number) -> Number:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * math.log2(abs(base)) > _MAX_INT_BITS:
            raise CalcError(f"{base}**{exponent} has more than {MAX_INT_DIGITS} digits; that is too large.")
    return _checked(base**exponent)


def _divide(left: Number, right: Number) -> Number:
    # Keep exact integers exact when the division is even (10/2 is 5, not 5.0, and 10**999/10
    # does not overflow a float on the way).
    if isinstance(left, int) and isinstance(right, int) and right != 0 and left % right == 0:
        return left // right
    return left / right


def _round(value: Number, digits: Number = 0) -> Number:
    """Round halves away from zero, as a person expects (Python's round would give round(2.5) == 2)."""
    if not isinstance(digits, int) or not -100 <= digits <= 100:
        raise CalcError("round(x, digits) needs a whole number of digits between -100 and 100.")
    with localcontext() as context:
        context.prec = MAX_INT_DIGITS + 400  # room for any finite float or allowed integer
        rounded = Decimal(repr(value)).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP)
    return int(rounded) if digits <= 0 else float(rounded)


def _log(value: Number, base: Number = 10) -> float:
    return math.log(value, base)


# name -> (function, fewest arguments, most arguments or None for any number)
FUNCTIONS: dict[str, tuple[Callable[..., Number], int, int | None]] = {
    "sqrt": (math.sqrt, 1, 1),
    "abs": (abs, 1, 1),
    "round": (_round, 1, 2),
    "min": (min, 1, None),
    "max": (max, 1, None),
    "log": (_log, 1, 2),
    "ln": (math.log, 1, 1),
    "log2": (math.log2, 1, 1),
    "exp": (math.exp, 1, 1),
    "floor": (math.floor, 1, 1),
    "ceil": (math.ceil, 1, 1),
    "sin": (math.sin, 1, 1),
    "cos": (math.cos, 1, 1),
    "tan": (math.tan, 1, 1),
    "asin": (math.asin, 1, 1),
    "acos": (math.acos, 1, 1),
    "atan": (math.atan, 1, 1),
    "degrees": (math.degrees, 1, 1),
    "radians": (math.radians, 1, 1),
}
CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e, "tau": math.tau}

_PREFIX_POWER = 30
_INFIX_POWER = {"+": 10, "-": 10, "*": 20, "/": 20, "//": 20, "%": 20, "**": 40}


class _Parser:
    """Pratt parser that evaluates as it goes; one instance reads one expression."""

    def __init__(self, expression: str) -> None:
        self.tokens = _tokenize(expression)
        self.index = 0
        self.depth = 0

    def parse(self) -> Number:
        value = self.expression(0)
        self.expect_end()
        return value

    def peek(self) -> _Token:
        return self.tokens[self.index]

    def advance(self) -> _Token:
        token = self.tokens[self.index]
        self.index += 1
        return token

    def expect_end(self) -> None:
        token = self.peek()
        if token.kind != "end":
            raise CalcError(
                f"Unexpected {token.text!r} at position {token.position}: an operator is missing "
                "(write 2*pi, not 2pi) or a parenthesis is unbalanced."
            )

    def expression(self, right_power: int) -> Number:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CalcError(f"The expression nests deeper than {MAX_DEPTH} levels.")
        left = self.prefix(self.advance())
        while right_power < self.infix_power(self.peek()):
            left = self.infix(self.advance(), left)
        self.depth -= 1
        return left

    @staticmethod
    def infix_power(token: _Token) -> int:
        return _INFIX_POWER.get(token.text, 0) if token.kind == "op" else 0

    def prefix(self, token: _Token) -> Number:
        if token.kind == "num":
            return _checked(float(token.text) if any(c in token.text for c in ".eE") else int(token.text))
        if token.kind == "name":
            return self.name(token)
        if token.text in ("-", "+"):
            operand = self.expression(_PREFIX_POWER)
            return -operand if token.text == "-" else operand
        if token.text == "(":
            value = self.expression(0)
            self.expect(")", token)
            return value
        found = "the end of the expression" if token.kind == "end" else repr(token.text)
        raise CalcError(f"Expected a number, name or '(' at position {token.position}, found {found}.")

    def expect(self, text: str, opener: _Token) -> None:
        token = self.advance()
        if token.text != text or token.kind != "op":
            where = f"'{opener.text}' at position {opener.position}"
            raise CalcError(f"The {where} is never closed with '{text}'.")

    def infix(self, token: _Token, left: Number) -> Number:
        try:
            return self.operate(token, left)
        except ZeroDivisionError:
            where = f"'{token.text}' at position {token.position}"
            raise CalcError(f"Division by zero (the {where}).") from None
        except OverflowError:
            where = f"'{token.text}' at position {token.position}"
            raise CalcError(f"The result of {where} is too large.") from None

    def operate(self, token: _Token, left: Number) -> Number:
        op = token.text
        if op == "%" and not self.starts_operand(self.peek()):
            return self.percent(left)
        # Powers are right-associative: 2**3**2 is 2**9.
        right = self.expression(_INFIX_POWER[op] - (1 if op == "**" else 0))
        return _apply(op, left, right)

    @staticmethod
    def starts_operand(token: _Token) -> bool:
        return (token.kind == "num" or token.text == "(" or token.kind == "name") and token.text != "of"

    def percent(self, left: Number) -> Number:
        share = _divide(left, 100)
        if self.peek().kind == "name" and self.peek().text == "of":
            self.advance()
            return _checked(share * self.expression(_INFIX_POWER["*"]))
        return share

    def name(self, token: _Token) -> Number:
        if self.peek().text == "(":
            return self.call(token)
        if token.text in CONSTANTS:
            return CONSTANTS[token.text]
        if token.text in FUNCTIONS:
            raise CalcError(f"{token.text} is a function: write {token.text}(...).")
        raise CalcError(
            f"Unknown name {token.text!r} at position {token.position}. "
            f"Known constants: {', '.join(CONSTANTS)}; functions: {', '.join(FUNCTIONS)}."
        )

    def call(self, token: _Token) -> Number:
        if token.text not in FUNCTIONS:
            kind = "a constant, not a function" if token.text in CONSTANTS else "not a known function"
            known = ", ".join(FUNCTIONS)
            raise CalcError(f"{token.text!r} at position {token.position} is {kind}. Functions: {known}.")
        opener = self.advance()
        args: list[Number] = []
        if self.peek().text != ")":
            args.append(self.expression(0))
            while self.peek().text == ",":
                self.advance()
                args.append(self.expression(0))
        self.expect(")", opener)
        return _call(token.text, args)


def _apply(op: str, left: Number, right: Number) -> Number:
    match op:
        case "**":
            return _power(left, right)
        case "+":
            value = left + right
        case "-":
            value = left - right
        case "*":
            value = left * right
        case "/":
            value = _divide(left, right)
        case "//":
            value = left // right
        case _:
            value = left % right
    return _checked(value)


def _call(name: str, args: list[Number]) -> Number:
    function, fewest, most = FUNCTIONS[name]
    if len(args) < fewest or (most is not None and len(args) > most):
        wanted = f"{fewest}+" if most is None else f"{fewest}" if fewest == most else f"{fewest}-{most}"
        raise CalcError(f"{name}() takes {wanted} argument(s), got {len(args)}.")
    try:
        return _checked(function(*args))
    except CalcError:
        raise
    except (ValueError, ZeroDivisionError) as exc:
        shown = ", ".join(format_number(a) for a in args)
        raise CalcError(f"{name}({shown}) is undefined ({exc}).") from None
    except OverflowError:
        raise CalcError(f"The result of {name}() is too large.") from None


def evaluate(expression: str) -> Number:
    """The value of `expression`; raises CalcError with a message naming what was wrong."""
    if not expression.strip():
        raise CalcError("The expression is empty; write something like 2 * (3 + 4).")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"The expression is longer than {MAX_EXPRESSION_CHARS} characters.")
    return _Parser(expression).parse()


def format_number(value: Number, significant: int = 15) -> str:
    """Integers exactly; floats to `significant` digits, dropping float noise (0.1+0.2 shows as 0.3)."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 10**significant:
        return str(int(value))
    return format(value, f".{significant}g")


def _tidy(value: Number, significant: int = 15) -> Number:
    if isinstance(value, int):
        return value
    if value.is_integer() and abs(value) < 10**significant:
        return int(value)
    return float(format(value, f".{significant}g"))


class Calculation(BaseModel):
    expression: str
    result: int | float = Field(description="The value; floats are rounded to 15 significant digits.")
    text: str = Field(description="The result as a person would write it.")


class Conversion(BaseModel):
    value: float
    from_unit: str = Field(description="Canonical symbol of the source unit.")
    to_unit: str = Field(description="Canonical symbol of the target unit.")
    dimension: str
    result: float = Field(description="The converted value, rounded to 12 significant digits.")
    text: str


class UnitCatalogue(BaseModel):
    dimensions: dict[str, list[str]] = Field(description="Canonical unit symbols by dimension.")
    note: str


_READ_ONLY = ToolAnnotations(
    readOnlyHint=True, destructiveHint=False, idempotentHint=True, openWorldHint=False
)


def build_server() -> MCPServer:
    """An MCP server with the tools calculate, convert and list_units."""
    server = MCPServer(
        "whet-calc",
        instructions="Exact arithmetic and unit conversion. Use it instead of doing arithmetic in your head.",
    )

    @server.tool(title="Calculate", annotations=_READ_ONLY)
    def calculate(
        expression: Annotated[
            str, Field(description="An arithmetic expression, e.g. '(3 + 4) * 2', 'sqrt(2)', '15% of 80'.")
        ],
    ) -> Calculation:
        """Evaluate an arithmetic expression exactly.

        Operators: + - * / // (floor division) % (modulo, or percent after a number: '15% of 80', '200 * 5%')
        ** or ^ (power), unary minus, parentheses. Functions: sqrt abs round(x, digits) min max
        log(x, base=10) ln log2 exp floor ceil sin cos tan asin acos atan (radians) degrees radians.
        Constants: pi e tau. Integers are exact up to 1000 digits.
        """
        try:
            value = evaluate(expression)
        except CalcError as exc:
            raise ToolError(f"Cannot evaluate {expression!r}: {exc}") from None
        return Calculation(expression=expression, result=_tidy(value), text=format_number(value))

    @server.tool(title="Convert units", annotations=_READ_ONLY)
    def convert(
        value: Annotated[float, Field(description="The amount to convert.", allow_inf_nan=False)],
        from_unit: Annotated[str, Field(description="Unit of the value, e.g. 'km', 'miles', '°F', 'GiB'.")],
        to_unit: Annotated[str, Field(description="Unit to express the value in, of the same dimension.")],
    ) -> Conversion:
        """Convert a value between units of length, mass, volume, temperature, time, speed or data size.

        Accepts symbols, names and plurals (km, kilometre, kilometers, mi, miles, lb, lbs, kg, °C, celsius,
        F, K, l, gal, cup, min, h, days, MB, MiB, Mbit) and speeds as length/time ('km/h', 'miles per hour').
        US customary volumes are the default (gal, pt, cup); 'imp gal' and 'imp pt' are imperial.
        """
        try:
            source, target = units.find_unit(from_unit), units.find_unit(to_unit)
            converted = units.convert(value, source, target)
        except units.UnitError as exc:
            raise ToolError(str(exc)) from None
        result = float(format(converted, ".12g"))
        text = f"{format_number(value, 12)} {source.symbol} = {format_number(result, 12)} {target.symbol}"
        return Conversion(
            value=value,
            from_unit=source.symbol,
            to_unit=target.symbol,
            dimension=source.dimension,
            result=result,
            text=text,
        )

    @server.tool(title="List units", annotations=_READ_ONLY)
    def list_units() -> UnitCatalogue:
        """List the units convert understands, by dimension (symbols; names and plurals work too)."""
        return UnitCatalogue(
            dimensions=units.units_by_dimension(),
            note="Names, plurals and common spellings are accepted too; speeds may be written length/time.",
        )

    return server


if __name__ == "__main__":
    build_server().run("stdio")
