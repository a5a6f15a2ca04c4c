"""JSON from text whet did not write (a model's tool call, a user's MCP server file)."""

from __future__ import annotations

import json
import math
from typing import Any


class JsonTextError(ValueError):
    """The text is not JSON whet can read; the message says where or why, for a person (or a model)."""


def parse_json(text: str) -> Any:
    """``json.loads`` whose every failure is a :class:`JsonTextError`: besides syntax errors,
    ``json`` raises RecursionError on deep nesting and a bare ValueError on an integer past the
    interpreter's digit limit, and neither may escape as a crash. Unlike ``json.loads`` it reads
    only standard JSON: ``NaN``, ``Infinity`` and numbers too large for a float (``1e999``) are
    refused, because what is read goes back out as JSON (to API clients, to MCP servers) and as
    timeouts, where they break strict readers or mean nothing."""
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise JsonTextError(f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise JsonTextError("nested too deeply") from None
    except JsonTextError:
        raise
    except ValueError as exc:
        raise JsonTextError(str(exc).split(";")[0]) from None


def _no_constant(name: str) -> Any:
    raise JsonTextError(f"{name} is not JSON (write a number or null)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonTextError(f"the number {text[:40]} is too large")
    return value
