"""Mapping agent results onto the OpenAI chat wire format (bodies and SSE chunks)."""

from __future__ import annotations

import json
import time
from typing import Any

from whet.runtime.agent import AgentResult
from whet.runtime.policy import ToolCall


def new_session_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages this request adds: the trailing run of user / tool messages."""
    start = len(messages)
    while start > 0 and messages[start - 1]["role"] in ("user", "tool"):
        start -= 1
    return messages[start:]


def completion_body(result: AgentResult, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": result.content}
    if result.client_tool_calls:
        message["tool_calls"] = [c.to_openai() for c in result.client_tool_calls]
        message["content"] = result.content or None
    return {
        "id": result.turn.id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": result.turn.policy_version,
        "choices": [{"index": 0, "message": message, "finish_reason": result.finish_reason, "logprobs": None}],
        "usage": result.usage,
    }


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
