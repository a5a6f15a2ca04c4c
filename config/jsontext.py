"""JSON from text whet did not write (a model's tool call, a user's MCP server file)."""

from __future__ import annotations

import json
from typing import Any


class JsonTextError(ValueError):
    """The text is not JSON whet can read; the message says where or why, for a person (or a model)."""


def parse_json(text: str) -> Any:
    """``json.loads`` whose every failure is a :class:`JsonTextError`: besides syntax errors,
    ``json`` raises RecursionError on deep nesting and a bare ValueError on an integer past the
    interpreter's digit limit, and neither may escape as a crash."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise JsonTextError(f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise JsonTextError("nested too deeply") from None
    except ValueError as exc:
        raise JsonTextError(str(exc).split(";")[0]) from None
