"""Hermes/Qwen tool-call markup: parsing model output.

Models in the Qwen2.5 family (and Hermes-style fine-tunes) call tools by writing
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in their
completion. :func:`parse_tool_calls` turns a raw completion into content +
calls + one error per block it could not read, so a bad block becomes a tool
error the model can see instead of being lost.

Prompt rendering lives in :mod:`whet.learner.prompt` (the learner needs it too).
"""

from __future__ import annotations

import json
import secrets

from whet.config.jsontext import JsonTextError, parse_json
from whet.learner.prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN  # noqa: F401 (re-exported)
from whet.runtime.policy import ToolCall

_FIX = 'write {"name": "<tool>", "arguments": {...}} between <tool_call> and </tool_call>'


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall], list[str]]:
    """Split a raw completion into ``(content, calls, errors)``.

    ``content`` is ``text`` with every ``<tool_call>...</tool_call>`` block (and an
    unterminated trailing one) removed, stripped; it never contains ``<tool_call>``. ``calls`` are the blocks that
    parsed, in order, each with a fresh ``call_<hex>`` id. ``errors`` holds one
    message per block that did not parse (invalid JSON, no name, arguments not
    an object, no closing tag), naming the block's number and the fix.
    """
    pieces: list[str] = []
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos, number = 0, 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) != -1:
        number += 1
        pieces.append(text[pos:start])
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        if end == -1:
            errors.append(f"tool call {number}: <tool_call> was never closed with </tool_call>; {_FIX}")
            pos = len(text)
            break
        call, error = _parse_block(text[body_start:end])
        if call is not None:
            calls.append(call)
        else:
            errors.append(f"tool call {number}: {error}; {_FIX}")
        pos = end + len(TOOL_CALL_CLOSE)
    pieces.append(text[pos:])
    return _join(pieces).strip(), calls, errors


def _join(pieces: list[str]) -> str:
    """The text around the blocks, with a space where cutting a block out would join the halves of an
    opening tag (``<tool_`` + block + ``call>``) into a new one: content never holds markup that reads
    as a call."""
    out = ""
    for piece in pieces:
        seam = out[-len(TOOL_CALL_OPEN) + 1 :] + piece[: len(TOOL_CALL_OPEN) - 1]
        out += (" " if TOOL_CALL_OPEN in seam else "") + piece
    return out


def _parse_block(body: str) -> tuple[ToolCall | None, str]:
    try:
        data = parse_json(body)
    except JsonTextError as exc:
        return None, f"invalid JSON ({exc})"
    if not isinstance(data, dict):
        return None, f"expected a JSON object, got {type(data).__name__}"
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, 'missing "name" (a non-empty string)'
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models double-encode; accept a string holding an object
        try:
            arguments = parse_json(arguments) if arguments.strip() else {}
        except JsonTextError:
            pass
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None, f'"arguments" of {name!r} must be a JSON object, got {type(arguments).__name__}'
    try:  # a \ud800 escape without its pair is valid JSON but no text: no client or MCP server could take it
        json.dumps([name, arguments], ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return None, "a string holds a lone surrogate (a \\ud800-\\udfff escape without its pair)"
    return ToolCall(id=new_call_id(), name=name.strip(), arguments=arguments), ""
