"""Hermes/Qwen tool-call markup: parsing model output and rendering ChatML prompts.

Models in the Qwen2.5 family (and Hermes-style fine-tunes) call tools by writing
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in their
completion. :func:`parse_tool_calls` turns a raw completion into content +
calls + one error per block it could not read, so a bad block becomes a tool
error the model can see instead of being lost.

:func:`render_chatml` is the fallback prompt for tokenizers without a chat
template. It follows Qwen2.5's template with one departure: when there is no
system message it writes no default system text (Qwen's says "You are Qwen...").
The demo model's Jinja template (``whet.learner.demo_model.CHAT_TEMPLATE``)
renders exactly the same string.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any

from whet.runtime.policy import ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
_FIX = 'write {"name": "<tool>", "arguments": {...}} between <tool_call> and </tool_call>'


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall], list[str]]:
    """Split a raw completion into ``(content, calls, errors)``.

    ``content`` is ``text`` with every ``<tool_call>...</tool_call>`` block (and an
    unterminated trailing one) removed, stripped. ``calls`` are the blocks that
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
    return "".join(pieces).strip(), calls, errors


def _parse_block(body: str) -> tuple[ToolCall | None, str]:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
    if not isinstance(data, dict):
        return None, f"expected a JSON object, got {type(data).__name__}"
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, 'missing "name" (a non-empty string)'
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models double-encode; accept a string holding an object
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None, f'"arguments" of {name!r} must be a JSON object, got {type(arguments).__name__}'
    return ToolCall(id=new_call_id(), name=name.strip(), arguments=arguments), ""


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages reshaped for chat templates (the inputs are not mutated).

    Content ``None`` becomes ``""`` and a list of content parts becomes their joined
    text; ``tool_calls[].function.arguments`` JSON strings become dicts, because
    templates such as Qwen2.5's apply ``tojson`` to them.
    """
    out = []
    for message in messages:
        message = dict(message)
        message["content"] = _content_text(message.get("content"))
        if message.get("tool_calls"):
            message["tool_calls"] = [_template_call(call) for call in message["tool_calls"]]
        out.append(message)
    return out


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function", call))
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # keep the raw string: the template shows what the model wrote
    return {**call, "function": function}


def render_chatml(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """The Qwen2.5-style ChatML prompt for ``messages`` and ``tools`` (OpenAI shapes)."""
    msgs = template_messages(messages)
    parts: list[str] = []
    system_first = bool(msgs) and msgs[0]["role"] == "system"
    if tools:
        head = msgs[0]["content"] + "\n\n" if system_first else ""
        listed = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
        parts.append(f"{IM_START}system\n{head}{TOOLS_PREAMBLE}{listed}{TOOLS_POSTAMBLE}{IM_END}\n")
    elif system_first:
        parts.append(f"{IM_START}system\n{msgs[0]['content']}{IM_END}\n")
    for i, message in enumerate(msgs):
        role = message["role"]
        if role == "system" and i == 0:
            continue
        if role == "tool":
            opens = i == 0 or msgs[i - 1]["role"] != "tool"
            closes = i == len(msgs) - 1 or msgs[i + 1]["role"] != "tool"
            parts.append(
                (f"{IM_START}user" if opens else "")
                + f"\n<tool_response>\n{message['content']}\n</tool_response>"
                + (f"{IM_END}\n" if closes else "")
            )
        elif role == "assistant" and message.get("tool_calls"):
            parts.append(_render_assistant_calls(message))
        else:
            parts.append(f"{IM_START}{role}\n{message['content']}{IM_END}\n")
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


def _render_assistant_calls(message: dict[str, Any]) -> str:
    out = f"{IM_START}assistant"
    if message["content"]:
        out += "\n" + message["content"]
    for call in message["tool_calls"]:
        function = call["function"]
        arguments = json.dumps(function.get("arguments", {}), ensure_ascii=False)
        body = f'{{"name": "{function["name"]}", "arguments": {arguments}}}'
        out += f"\n{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"
    return out + f"{IM_END}\n"
