"""ScriptedBackend: the in-memory twin of the real engines, for tests.

It plays back replies written in advance (or computed by a function of the
request), parses their tool calls the way the real engines do, and reports a
deterministic byte-level "tokenization": prompt ids are the UTF-8 bytes of the
ChatML prompt (:func:`render_chatml`), completion ids the UTF-8 bytes of the
reply, and every log-prob is :data:`SCRIPTED_LOGPROB`. Sampling params are
recorded but do not change the reply.
"""

from __future__ import annotations

import asyncio
import copy
import re
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from whet.learner.prompt import render_chatml
from whet.runtime.chat_format import parse_tool_calls
from whet.runtime.policy import Generation, SamplingParams

SCRIPTED_LOGPROB = -1.0  # log-prob reported for every scripted token
Reply = Callable[[list[dict[str, Any]], list[dict[str, Any]]], str]


@dataclass
class ScriptedCall:
    """One request as the backend received it (deep copies)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    params: SamplingParams
    adapter: str | None


class ByteTokenizer:
    """The scripted "tokenizer": a token id is one UTF-8 byte."""

    def decode(self, ids: Sequence[int], **_: Any) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class ScriptedBackend:
    """Replies from a list (in order) or from ``replies(messages, tools)``.

    Raises ``RuntimeError`` when a list runs out and ``ValueError`` for an
    adapter that was not loaded, as the real engines do.
    """

    def __init__(self, replies: Sequence[str] | Reply, model_name: str = "scripted") -> None:
        self.model_name = model_name
        self.tokenizer = ByteTokenizer()
        self.calls: list[ScriptedCall] = []
        self.loaded: set[str] = set()
        self._replies = replies if callable(replies) else list(replies)

    def _next_reply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
        if callable(self._replies):
            return self._replies(messages, tools)
        index = len(self.calls) - 1
        if index >= len(self._replies):
            raise RuntimeError(
                f"ScriptedBackend ran out of replies: call {index + 1} but only "
                f"{len(self._replies)} scripted; add more replies to the test"
            )
        return self._replies[index]

    def _generate(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        params: SamplingParams,
        adapter: str | None,
    ) -> Generation:
        if adapter is not None and adapter not in self.loaded:
            raise ValueError(f"adapter {adapter!r} is not loaded (loaded: {sorted(self.loaded)})")
        self.calls.append(ScriptedCall(copy.deepcopy(messages), copy.deepcopy(tools), params, adapter))
        text = self._next_reply(messages, tools)
        content, calls, errors = parse_tool_calls(text)
        token_ids = list(text.encode("utf-8"))
        return Generation(
            text=text,
            content=content,
            tool_calls=calls,
            tool_call_errors=errors,
            prompt_token_ids=list(render_chatml(messages, tools).encode("utf-8")),
            token_ids=token_ids,
            logprobs=[SCRIPTED_LOGPROB] * len(token_ids),
            finish_reason="tool_calls" if calls else "stop",
            adapter=adapter,
        )

    async def generate(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        params: SamplingParams,
        adapter: str | None = None,
    ) -> Generation:
        return self._generate(messages, tools, params, adapter)

    async def stream(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        params: SamplingParams,
        adapter: str | None = None,
    ) -> AsyncIterator[str | Generation]:
        """Yields the raw reply (tool-call markup included) in word-sized deltas, then the Generation."""
        generation = self._generate(messages, tools, params, adapter)
        for delta in re.findall(r"\s*\S+\s*|\s+", generation.text):
            await asyncio.sleep(0)  # hand the loop back between deltas, like a real engine
            yield delta
        yield generation

    async def load_adapter(self, name: str, path: str) -> None:
        self.loaded.add(name)

    async def unload_adapter(self, name: str) -> None:
        self.loaded.discard(name)

    def adapters(self) -> list[str]:
        return sorted(self.loaded)

    async def aclose(self) -> None:
        return None
