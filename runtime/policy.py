"""The policy backend seam: one Protocol, several engines.

A backend turns OpenAI-style ``messages`` + ``tools`` into one model action,
and reports exactly what the engine did: the prompt token ids it saw, the
sampled token ids and their log-probs. Those are stored verbatim and never
re-tokenized later (the learner trains on them).

Messages are OpenAI chat dicts (``role``, ``content``, ``tool_calls`` with
``function.arguments`` as a JSON string, ``tool_call_id``); tools are OpenAI
function specs (``{"type": "function", "function": {name, description, parameters}}``).

This module imports none of the engines; :mod:`whet.runtime.backends` builds the configured one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


@dataclass
class Generation:
    """One model action, as the engine produced it."""

    text: str  # the raw decoded completion (tool-call markup included)
    content: str  # text with tool-call blocks removed, stripped
    tool_calls: list[ToolCall] = field(default_factory=list)
    # tool-call blocks that could not be parsed: one message each, for a tool-error reply
    tool_call_errors: list[str] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # one per token id, from the engine
    finish_reason: str = "stop"  # stop | length | tool_calls
    adapter: str | None = None  # the adapter name that produced it (None = base weights)

    @property
    def usage(self) -> dict[str, int]:
        p, c = len(self.prompt_token_ids), len(self.token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def last_generation(stream: AsyncIterator[str | Generation]) -> Generation:
    """Drain a backend's stream and return its final Generation (for engines that only stream)."""
    result: Generation | None = None
    async for item in stream:
        if isinstance(item, Generation):
            result = item
    if result is None:
        raise RuntimeError("the backend's stream ended without a Generation")
    return result


@runtime_checkable
class PolicyBackend(Protocol):
    """What the agent needs from an engine."""

    model_name: str

    async def generate(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        params: SamplingParams,
        adapter: str | None = None,
    ) -> Generation: ...

    def stream(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        params: SamplingParams,
        adapter: str | None = None,
    ) -> AsyncIterator[str | Generation]:
        """Yields text deltas as the engine produces them, then exactly one final Generation."""
        ...

    async def load_adapter(self, name: str, path: str) -> None: ...

    async def unload_adapter(self, name: str) -> None: ...

    def adapters(self) -> list[str]: ...

    async def aclose(self) -> None: ...


class BackendChat:
    """The served model as a plain chat model (what the learner's LLM judge asks)."""

    def __init__(self, backend: PolicyBackend) -> None:
        self.backend = backend

    async def complete(self, messages: list[dict[str, Any]], *, temperature: float, max_tokens: int) -> str:
        params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature)
        return (await self.backend.generate(messages, [], params)).content


class PromptTooLong(ValueError):
    """The rendered prompt does not fit the model's context: the client's to fix (a 400)."""


class BackendError(Exception):
    """An engine failed in a way a person can act on (remote HTTP error, model that cannot load).

    ``status`` is the remote HTTP status when there was one.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        self.status, self.message = status, message
        super().__init__(f"{message} (HTTP {status})" if status is not None else message)
