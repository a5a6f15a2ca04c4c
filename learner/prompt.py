"""The prompt a model sees: OpenAI messages + tools rendered through its chat template.

Both sides of the loop need the same rendering: the runtime to build the prompt
it generates from, the learner to build the *teacher* prompt of hindsight
distillation (the recorded prompt with a hint added) and, for the demo policy,
its training conversations. It lives here, below the runtime, so the learner
never imports the runtime.

:func:`render_chatml` is the fallback prompt for tokenizers without a chat
template. It follows Qwen2.5's template with one departure: when there is no
system message it writes no default system text (Qwen's says "You are Qwen...").
The tiny model's Jinja template (``whet.learner.templates.CHAT_TEMPLATE``)
renders exactly the same string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import mcp_types as types

from whet.config.jsontext import JsonTextError, parse_json

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
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


def call_opening(tokenizer: Any) -> int:
    """The token a reply that calls a tool opens with (the first of ``<tool_call>``)."""
    return tokenizer.encode(TOOL_CALL_OPEN, add_special_tokens=False)[0]


def prompt_text(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                *, add_generation_prompt: bool = True) -> str:
    """The prompt string for ``messages`` and ``tools``: the tokenizer's chat template, or ChatML.

    Raises ValueError when the template rejects the messages (e.g. roles that must alternate).
    """
    msgs = template_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        return render_chatml(msgs, tools, add_generation_prompt=add_generation_prompt)
    try:
        return tokenizer.apply_chat_template(
            msgs, tools=list(tools) if tools else None, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as exc:  # jinja raises its own error types, e.g. "roles must alternate"
        raise ValueError(f"the chat template rejected the messages: {exc}") from exc


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages reshaped for chat templates (the inputs are not mutated).

    Content ``None`` becomes ``""`` and a list of content parts becomes their joined
    text; ``tool_calls[].function.arguments`` JSON strings become dicts, because
    templates such as Qwen2.5's apply ``tojson`` to them.
    """
    out = []
    for message in messages:
        message = dict(message)
        message["content"] = content_text(message.get("content"))
        if message.get("tool_calls"):
            message["tool_calls"] = [_template_call(call) for call in message["tool_calls"]]
        out.append(message)
    return out


def content_text(content: Any) -> str:
    """Message content as text: a string, None, or a list of OpenAI content parts."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def user_texts(messages: Sequence[dict[str, Any]]) -> list[str]:
    """The user messages' texts, in order."""
    return [content_text(m.get("content")) for m in messages if m.get("role") == "user"]


def last_user_text(messages: Sequence[dict[str, Any]]) -> str:
    """The text of the last user message ("" when there is none)."""
    return next((content_text(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")


def canonical_arguments(arguments: str | dict[str, Any]) -> str:
    """Tool-call arguments as sorted JSON, however they were serialised; an unparseable string as is."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def parse_arguments(arguments: Any) -> dict[str, Any] | str:
    """The call's arguments as a dict, or why they are not a JSON object."""
    if arguments is None:
        return {}
    if isinstance(arguments, str | bytes):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return f"not valid JSON ({exc.msg} at column {exc.colno}); send a JSON object"
    if isinstance(arguments, Mapping):
        return dict(arguments)
    return f"must be a JSON object, got {type(arguments).__name__}"


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
                + f"\n{TOOL_RESPONSE_OPEN}\n{message['content']}\n{TOOL_RESPONSE_CLOSE}"
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
        name = json.dumps(function["name"], ensure_ascii=False)  # a quote or control character in a name stays JSON
        body = f'{{"name": {name}, "arguments": {arguments}}}'
        out += f"\n{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"
    return out + f"{IM_END}\n"


LESSONS_HEADER = "\n\nLessons from earlier conversations with this user:\n"


def with_lessons(system: str, lessons: Sequence[str]) -> str:
    """The system prompt with retrieved lessons added, one per line (as the agent sends them)."""
    return system + LESSONS_HEADER + "\n".join(f"- {t}" for t in lessons) if lessons else system


def shown_lessons(messages: Sequence[dict[str, Any]]) -> str:
    """The lessons ``messages``' system prompt shows (:func:`with_lessons`), as one text; empty when none."""
    if not messages or messages[0].get("role") != "system":
        return ""
    parts = content_text(messages[0].get("content")).split(LESSONS_HEADER, 1)
    return parts[1] if len(parts) == 2 else ""


def prompt_with_lessons(messages: Sequence[dict[str, Any]], lessons: Sequence[str],
                        default_system: str) -> list[dict[str, Any]]:  # fmt: skip
    """``messages`` as the model is sent them: their own system prompt (``default_system`` when they have
    none) with ``lessons`` added, then the rest."""
    rest = list(messages)
    system = default_system
    if rest and rest[0].get("role") == "system":
        system = rest.pop(0).get("content") or ""
    return [{"role": "system", "content": with_lessons(system, lessons)}, *rest]


def relessoned(tokenizer: Any, messages: Sequence[dict[str, Any]], prompt_ids: Sequence[int],
               lessons: Sequence[str]) -> tuple[list[dict[str, Any]], list[int]] | None:  # fmt: skip
    """A recorded prompt (``messages`` as the agent sent them, and their ``prompt_ids``) with its
    lessons replaced by ``lessons``: the prompt the agent would build for the same request now.

    The recorded ids are decoded, the system prompt's text swapped, and the whole encoded again
    (tool schemas stay as recorded; the turn does not keep them). Returns None when that cannot be
    done faithfully: no system message, ids that do not survive decoding and encoding again (another
    tokenizer's merges), or a system text not found in them; the caller keeps the recorded prompt.
    """
    if not messages or messages[0].get("role") != "system":
        return None
    old = content_text(messages[0].get("content"))
    if not old:  # nothing to find it by
        return None
    base = old.split(LESSONS_HEADER, 1)[0]
    new = with_lessons(base, lessons)
    if new == old:
        return list(messages), list(prompt_ids)
    text = tokenizer.decode(list(prompt_ids))
    at = text.find(old)
    if at < 0 or tokenizer.encode(text, add_special_tokens=False) != list(prompt_ids):
        return None
    ids = tokenizer.encode(text[:at] + new + text[at + len(old):], add_special_tokens=False)
    return [{**messages[0], "content": new}, *messages[1:]], ids


HINT_TEMPLATE = "\n\n[hint] {hint}"  # how a hint joins the user's message in the teacher's context


def with_hint(messages: Sequence[dict[str, Any]], hint: str) -> list[dict[str, Any]] | None:
    """``messages`` with ``hint`` added to the last user message (None when there is none)."""
    out = [dict(m) for m in messages]
    for message in reversed(out):
        if message.get("role") == "user":
            message["content"] = content_text(message.get("content")) + HINT_TEMPLATE.format(hint=hint)
            return out
    return None


def hinted_prompt_ids(
    tokenizer: Any, messages: Sequence[dict[str, Any]], prompt_ids: Sequence[int], hint: str
) -> list[int] | None:
    """The teacher's prompt for hindsight distillation, as token ids: the recorded prompt with
    ``hint`` added to the last user message.

    Only the tail from the last user message on is tokenized here; everything before it is
    the engine's own recorded ids (tool schemas included, which the turn does not keep).
    Returns None when the tail cannot be lined up with the recorded ids (another template,
    a tokenizer that merges across the boundary), and the caller skips distillation.
    """
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    hinted = with_hint(messages, hint)
    if last_user is None or hinted is None:
        return None
    head = prompt_text(tokenizer, messages[:last_user], None, add_generation_prompt=False)
    full = prompt_text(tokenizer, messages, None)
    taught = prompt_text(tokenizer, hinted, None)
    if not (full.startswith(head) and taught.startswith(head)):
        return None
    tail = tokenizer.encode(full[len(head):], add_special_tokens=False)
    if not tail or list(prompt_ids[-len(tail):]) != tail:
        return None
    return list(prompt_ids[: len(prompt_ids) - len(tail)]) + tokenizer.encode(taught[len(head):], add_special_tokens=False)


def render_tool_result(result: types.CallToolResult, limit: int = 16_000) -> str:
    """A tool result as the model reads it: text blocks joined (structured content as JSON when there is no text), cut to ``limit`` chars."""
    texts, others = [], []
    for block in result.content:
        if isinstance(block, types.TextContent):
            texts.append(block.text)
        elif isinstance(block, types.EmbeddedResource) and hasattr(block.resource, "text"):
            texts.append(block.resource.text)
        elif isinstance(block, types.ImageContent | types.AudioContent):
            others.append(f"[{block.type} {block.mime_type} omitted]")
        elif isinstance(block, types.ResourceLink):
            others.append(f"[resource {block.uri}]")
        elif isinstance(block, types.EmbeddedResource):
            others.append(f"[binary resource {block.resource.uri} omitted]")
    if not texts and result.structured_content is not None:
        texts.append(json.dumps(result.structured_content, ensure_ascii=False))
    text = "\n".join(texts + others)
    if len(text) > limit:
        text = f"{text[:limit]}\n[truncated {len(text) - limit} chars]"
    return text


def openai_tool_spec(name: str, description: str, input_schema: dict[str, Any]) -> dict[str, Any]:
    """An MCP tool as an OpenAI function spec (what chat templates render)."""
    parameters = dict(input_schema)
    parameters.setdefault("type", "object")
    if parameters["type"] == "object":
        parameters.setdefault("properties", {})
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


# -- reading calls back out of a completion ------------------------------------------------------

_CALL_FIX = 'write {"name": "<tool>", "arguments": {...}} between <tool_call> and </tool_call>'


def split_tool_calls(text: str) -> tuple[str, list[tuple[str, dict[str, Any]]], list[str]]:
    """Split a raw completion into ``(content, calls, errors)``.

    ``content`` is ``text`` with every ``<tool_call>...</tool_call>`` block (and an
    unterminated trailing one) removed, stripped; it never contains ``<tool_call>``. ``calls`` are the blocks that
    parsed, in order, as (name, arguments). ``errors`` holds one
    message per block that did not parse (invalid JSON, no name, arguments not
    an object, no closing tag), naming the block's number and the fix.
    """
    pieces: list[str] = []
    calls: list[tuple[str, dict[str, Any]]] = []
    errors: list[str] = []
    pos, number = 0, 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) != -1:
        number += 1
        pieces.append(text[pos:start])
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        if end == -1:
            errors.append(f"tool call {number}: <tool_call> was never closed with </tool_call>; {_CALL_FIX}")
            pos = len(text)
            break
        call, error = _parse_block(text[body_start:end])
        if call is not None:
            calls.append(call)
        else:
            errors.append(f"tool call {number}: {error}; {_CALL_FIX}")
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


def _parse_block(body: str) -> tuple[tuple[str, dict[str, Any]] | None, str]:
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
    return (name.strip(), arguments), ""
