"""Mapping agent results onto the OpenAI chat wire format (bodies and SSE chunks)."""

from __future__ import annotations

import json
import time
from typing import Any

from whet.runtime.agent import AgentResult
from whet.runtime.policy import ToolCall
from whet.runtime.schemas import ChatCompletion, Choice, ResponseMessage, ToolCallWire, Usage


def new_session_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages this request adds: the trailing run of user / tool messages."""
    start = len(messages)
    while start > 0 and messages[start - 1]["role"] in ("user", "tool"):
        start -= 1
    return messages[start:]


def completion_body(result: AgentResult, model: str) -> dict[str, Any]:
    calls = [ToolCallWire.model_validate(c.to_openai()) for c in result.client_tool_calls]
    message = ResponseMessage(content=(result.content or None) if calls else result.content, tool_calls=calls or None)
    completion = ChatCompletion(
        id=result.turn.id,
        created=int(time.time()),
        model=model,
        system_fingerprint=result.turn.policy_version,
        choices=[Choice(message=message, finish_reason=result.finish_reason)],
        usage=Usage(**result.usage),
    )
    return completion.model_dump()


def stream_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"index": i, **call.to_openai()} for i, call in enumerate(calls)]


def sse_chunk(
    chunk_id: str,
    created: int,
    model: str,
    delta: dict[str, Any] | None,
    finish_reason: str | None,
    **extra: Any,
) -> str:
    body: dict[str, Any] = {"id": chunk_id, "object": "chat.completion.chunk", "created": created, "model": model}
    body["choices"] = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
    body.update(extra)
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
