"""Hermes/Qwen tool-call markup: parsing model output.

Models in the Qwen2.5 family (and Hermes-style fine-tunes) call tools by writing
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in their
completion. :func:`parse_tool_calls` turns a raw completion into content +
calls + one error per block it could not read, so a bad block becomes a tool
error the model can see instead of being lost.

Prompt rendering lives in :mod:`whet.learner.prompt` (the learner needs it too).
"""

from __future__ import annotations

import secrets

from whet.learner.prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, split_tool_calls  # noqa: F401 (re-exported)
from whet.runtime.policy import ToolCall


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall], list[str]]:
    """Split a raw completion into ``(content, calls, errors)`` (:func:`whet.learner.prompt.split_tool_calls`),
    each call with a fresh ``call_<hex>`` id."""
    content, calls, errors = split_tool_calls(text)
    return content, [ToolCall(id=new_call_id(), name=name, arguments=arguments) for name, arguments in calls], errors
