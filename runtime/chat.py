"""Mapping agent results onto the OpenAI chat wire format (bodies and SSE chunks)."""

from __future__ import annotations

import json
import time
from typing import Any

from whet.memory.tables import Turn
from whet.runtime.agent import AgentResult
from whet.runtime.policy import ToolCall
from whet.runtime.schemas import (
    ChatCompletion,
    Choice,
    ChoiceLogprobs,
    ResponseMessage,
    TokenLogprob,
    ToolCallWire,
    Usage,
)


def new_session_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages this request adds: the trailing run of user / tool messages."""
    start = len(messages)
    while start > 0 and messages[start - 1]["role"] in ("user", "tool"):
        start -= 1
    return messages[start:]


def choice_logprobs(turn: Turn, backend: Any) -> dict[str, Any]:
    """The answering turn's recorded log-probs in OpenAI's ``choices[].logprobs`` shape.

    Token text comes from the backend's tokenizer; an engine without one (a remote endpoint)
    names each token as ``token_id:N``, vLLM's own spelling.
    """
    tokenizer = getattr(backend, "tokenizer", None)
    content = []
    for token_id, logprob in zip(turn.response_token_ids, turn.response_logprobs, strict=False):
        text = tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"
        content.append(TokenLogprob(token=text, logprob=logprob, bytes=list(text.encode())))
    return ChoiceLogprobs(content=content).model_dump()


def completion_body(result: AgentResult, model: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    calls = [ToolCallWire.model_validate(c.to_openai()) for c in result.client_tool_calls]
    message = ResponseMessage(content=(result.content or None) if calls else result.content, tool_calls=calls or None)
    completion = ChatCompletion(
        id=result.turn.id,
        created=int(time.time()),
        model=model,
        system_fingerprint=result.turn.policy_version,
        choices=[Choice(message=message, finish_reason=result.finish_reason, logprobs=logprobs)],
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
    logprobs: dict[str, Any] | None = None,
    **extra: Any,
) -> str:
    body: dict[str, Any] = {"id": chunk_id, "object": "chat.completion.chunk", "created": created, "model": model}
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
    body["choices"] = [] if delta is None else [choice]
    body.update(extra)
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
