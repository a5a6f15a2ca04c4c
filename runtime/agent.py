"""The agent loop: context -> generate -> act through MCP -> record, until a final answer.

One chat request runs the loop for up to ``max_steps`` model actions. Every
action is recorded as a Turn with the engine's own token ids and log-probs;
a tool result closes its turn at once, and the final answer's turn stays
open until the user's next message or explicit feedback closes it.

The adapter is pinned when the request starts: the agent takes a lease from
the adapter router for the whole request (every step, streaming included), so
a swap that happens while the request runs does not change the adapter it
finishes on, and that adapter stays loaded until the request is over.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import structlog

from whet.config.settings import AgentConfig
from whet.learner.prompt import canonical_arguments, last_user_text, with_lessons
from whet.memory.experience import Experience
from whet.memory.index import LessonIndex
from whet.memory.tables import Turn, TurnCreate, new_turn_id
from whet.runtime.adapters import AdapterRouter
from whet.runtime.chat_format import TOOL_CALL_OPEN
from whet.runtime.policy import Generation, PolicyBackend, SamplingParams, ToolCall
from whet.runtime.tools import ToolInfo, ToolPool

log = structlog.get_logger()


@dataclass
class TurnRequest:
    user_id: str
    session_id: str
    messages: list[dict[str, Any]]  # OpenAI dicts, as the client sent them
    client_tools: list[dict[str, Any]]  # tools the client executes itself
    params: SamplingParams
    # the adapter pinned for the whole request (None = base weights); an agent with a router
    # sets it when the request starts, from the version live for the user then
    adapter: str | None = None
    request_id: str = field(default_factory=lambda: "req_" + uuid.uuid4().hex)
    # "auto": the model may call tools; "none": it answers in words and no call is acted on
    tool_choice: str = "auto"
    # the id of the turn that answers (the response id), drawn up front so a stream names it from its
    # first chunk; the intermediate tool steps get ids of their own
    answer_turn_id: str = field(default_factory=new_turn_id)


@dataclass
class AgentResult:
    turn: Turn  # the last recorded turn; its id is the response id
    content: str
    client_tool_calls: list[ToolCall]
    finish_reason: str
    usage: dict[str, int]
    messages: list[dict[str, Any]]  # the conversation as the model saw it, reply included


@dataclass
class Delta:
    text: str  # user-visible text; the deltas of one request join into AgentResult.content


class Agent:
    def __init__(
        self,
        backend: PolicyBackend,
        tools: ToolPool,
        experience: Experience,
        index: LessonIndex,
        config: AgentConfig,
        metrics: Any = None,
        adapters: AdapterRouter | None = None,
    ) -> None:
        self.backend = backend
        self.tools = tools
        self.experience = experience
        self.index = index
        self.config = config
        self.metrics = metrics
        self.adapters = adapters  # None: requests run on whatever ``request.adapter`` names
        self._tool_vectors: dict[str, np.ndarray] = {}  # "name: description" -> embedding

    async def run(self, request: TurnRequest) -> AgentResult:
        # closed on return, so the adapter lease ends with the request, not when the generator is collected
        async with aclosing(self.events(request)) as events:
            async for event in events:
                if isinstance(event, AgentResult):
                    return event
        raise RuntimeError("agent loop ended without a result")  # pragma: no cover

    async def events(self, request: TurnRequest) -> AsyncIterator[Delta | AgentResult]:
        """Text deltas of what the model says to the user, then one AgentResult.

        The adapter is pinned at the first iteration and held until the iterator ends,
        fails, is closed (``contextlib.aclosing``) or its task is cancelled.
        """
        with self._pinned(request):
            async with aclosing(self._steps(request)) as steps:
                async for event in steps:
                    yield event

    @contextmanager
    def _pinned(self, request: TurnRequest) -> Iterator[None]:
        if self.adapters is None:
            yield
            return
        with self.adapters.lease(request.user_id) as version:
            request.adapter = version
            yield

    async def _steps(self, request: TurnRequest) -> AsyncIterator[Delta | AgentResult]:
        messages = await self._context(request)
        tools = [] if request.tool_choice == "none" else await self._tool_specs(request, messages)
        client_names = {t["function"]["name"] for t in request.client_tools}
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        shown: list[str] = []  # every text delta the client saw: the reply is all of it, across steps
        for step in range(self.config.max_steps):
            generation = None
            earlier = len(shown)  # deltas of the steps before this one
            async for item in self._generate(messages, tools, request):
                if isinstance(item, Generation):
                    generation = item
                    continue
                if len(shown) == earlier and shown and not shown[-1][-1:].isspace() and not item[:1].isspace():
                    item = "\n\n" + item  # a new step's text starts a new paragraph
                shown.append(item)
                yield Delta(item)
            assert generation is not None
            for key, value in generation.usage.items():
                usage[key] += value
            calls, errors = generation.tool_calls, generation.tool_call_errors
            if request.tool_choice == "none":
                calls, errors = [], []  # markup the model wrote anyway is not acted on (nor shown)
            client_calls = [c for c in calls if c.name in client_names]
            final = (not calls and not errors) or bool(client_calls) or step == self.config.max_steps - 1
            turn_id = request.answer_turn_id if final else new_turn_id()
            turn = await self._record(request, turn_id, step, messages, tools, generation)
            content = "".join(shown).strip()
            if not calls and not errors:
                messages.append({"role": "assistant", "content": generation.content})
                finish = "stop" if generation.finish_reason == "tool_calls" else generation.finish_reason
                yield self._result(turn, content, [], finish, usage, messages)
                return
            server_calls = [c for c in calls if c.name not in client_names]
            if server_calls or errors:
                # run what the server can even when the client has calls of its own; nothing is dropped
                results = await self._act(server_calls, errors, request.user_id)
                messages.append(_assistant_message(generation.content, calls if client_calls else server_calls))
                messages.extend(results)
                await self.experience.close(turn.id, "tool_result", {"results": results})
            if client_calls:
                if not server_calls:
                    messages.append(_assistant_message(generation.content, client_calls))
                yield self._result(turn, content, client_calls, "tool_calls", usage, messages)
                return
        if not shown:
            shown.append(f"I stopped after {self.config.max_steps} tool steps without a final answer.")
            yield Delta(shown[0])
        yield self._result(turn, "".join(shown).strip(), [], "length", usage, messages)

    def _result(self, turn, content, calls, finish, usage, messages) -> AgentResult:
        return AgentResult(turn, content, calls, finish, dict(usage), messages)

    async def _context(self, request: TurnRequest) -> list[dict[str, Any]]:
        messages = await self._with_server_results(request.session_id, [dict(m) for m in request.messages])
        lessons = await self._lessons(request.user_id, last_user_text(messages))
        system = self.config.system_prompt
        if messages and messages[0]["role"] == "system":
            system = messages.pop(0)["content"] or ""
        return [{"role": "system", "content": with_lessons(system, lessons)}, *messages]

    async def _with_server_results(self, session_id: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Put back the MCP calls (and their results) of a step that also returned client calls.

        The client only ever saw its own calls; the model must see the whole step it took.
        """
        last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "assistant"), None)
        if last is None or not messages[last].get("tool_calls"):
            return messages
        client_ids = {c.get("id") for c in messages[last]["tool_calls"]}
        for turn in await self.experience.store.list_turns(session_id=session_id, limit=4):
            ids = {c["id"] for c in turn.tool_calls}
            if client_ids < ids and turn.next_state_kind == "tool_result":
                server_results = (turn.next_state or {}).get("results") or []
                messages[last] = {**messages[last], "tool_calls": list(turn.tool_calls)}
                messages[last + 1:last + 1] = server_results
                break
        return messages

    async def _lessons(self, user_id: str, query: str) -> list[str]:
        if self.config.lessons_k == 0 or not query or len(self.index) == 0:
            return []
        hits = await anyio.to_thread.run_sync(self.index.search, user_id, query, self.config.lessons_k)
        chosen, budget = [], self.config.lesson_token_budget
        for hit in hits:
            if hit.score < self.config.lessons_min_score:
                break  # best first: the rest are further still
            cost = _approx_tokens(hit.text)
            if cost > budget:
                break
            chosen.append(hit.text)
            budget -= cost
        return chosen

    async def _tool_specs(self, request: TurnRequest, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        infos = self.tools.tools()
        if len(infos) > self.config.tools_k:
            query = last_user_text(messages)
            infos = await anyio.to_thread.run_sync(self._relevant_tools, infos, query)
        return self.tools.openai_tools([i.name for i in infos]) + list(request.client_tools)

    def _relevant_tools(self, infos: list[ToolInfo], query: str) -> list[ToolInfo]:
        """Narrow a long tool list to the tools_k most similar to the request (runs in a worker thread)."""
        embedder = self.index.embedder
        texts = [f"{i.name}: {i.description}" for i in infos]
        missing = [t for t in texts if t not in self._tool_vectors]
        if missing:  # tool lists change rarely: embed each description once
            self._tool_vectors.update(zip(missing, embedder.embed(missing), strict=True))
        scores = np.stack([self._tool_vectors[t] for t in texts]) @ embedder.embed([query])[0]  # [n_tools]
        ranked = sorted(zip(scores.tolist(), range(len(infos)), strict=True), reverse=True)[: self.config.tools_k]
        return [infos[i] for _, i in ranked]

    async def _generate(self, messages, tools, request: TurnRequest) -> AsyncIterator[str | Generation]:
        """Stream user-visible text; hold back anything that may be tool-call markup."""
        held, silent = "", False
        async for item in self.backend.stream(messages, tools, request.params, request.adapter):
            if isinstance(item, Generation):
                if not silent and not item.tool_calls and not item.tool_call_errors and held:
                    yield held
                yield item
                return
            if silent:
                continue
            held += item
            if TOOL_CALL_OPEN in held:
                before = held.split(TOOL_CALL_OPEN, 1)[0]
                if before.strip():
                    yield before
                silent = True
                continue
            safe = _safe_prefix(held)
            if safe:
                yield safe
                held = held[len(safe):]

    async def _record(self, request, turn_id, step, messages, tools, generation: Generation) -> Turn:
        turn = await self.experience.record(
            TurnCreate(
                session_id=request.session_id,
                user_id=request.user_id,
                request_id=request.request_id,
                step=step,
                model=self.backend.model_name,
                policy_version=generation.adapter,
                prompt_messages=[dict(m) for m in messages],
                tool_names=[t["function"]["name"] for t in tools],
                prompt_token_ids=generation.prompt_token_ids,
                response_text=generation.text,
                response_token_ids=generation.token_ids,
                response_logprobs=generation.logprobs,
                tool_calls=[c.to_openai() for c in generation.tool_calls],
            ),
            turn_id,
        )
        if self.metrics is not None:
            self.metrics.turn_recorded(generation)
        return turn

    async def _act(self, calls: list[ToolCall], errors: list[str], user_id: str) -> list[dict[str, Any]]:
        """Run the tool calls concurrently for ``user_id``; every problem becomes a tool-error message."""
        results: list[dict[str, Any]] = [{}] * len(calls)

        async def one(i: int, call: ToolCall) -> None:
            result = await self.tools.call(call.name, call.arguments, user=user_id)
            if self.metrics is not None:
                self.metrics.tool_called(result.server or "unknown", result.is_error, call.name)
            content = f"error: {result.content}" if result.is_error else result.content
            results[i] = {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}

        async with anyio.create_task_group() as tg:
            for i, call in enumerate(calls):
                tg.start_soon(one, i, call)
        for n, error in enumerate(errors):
            results.append(
                {"role": "tool", "tool_call_id": f"call_invalid_{n}", "name": "invalid", "content": f"error: {error}"}
            )
        return results


def _assistant_message(content: str, calls: list[ToolCall]) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}


def _approx_tokens(text: str) -> int:
    return len(text) // 4 + 1


def _safe_prefix(text: str) -> str:
    """The part of ``text`` that cannot be the start of a tool-call tag."""
    cut = text.rfind("<")
    if cut == -1:
        return text
    tail = text[cut:]
    if TOOL_CALL_OPEN.startswith(tail):
        return text[:cut]
    return text


def conversation_hash(user_id: str, messages: list[dict[str, Any]]) -> str:
    """A stable hash of a conversation, robust to how a client re-serialises it.

    Used to find the session a plain OpenAI client's request continues: the
    history it sends equals the conversation as it stood after our last reply.
    """
    canon = []
    for m in messages:
        calls = [
            (c["function"]["name"], canonical_arguments(c["function"].get("arguments", "{}")))
            for c in (m.get("tool_calls") or [])
        ]
        role = "system" if m["role"] == "developer" else m["role"]
        canon.append([role, (m.get("content") or "").strip(), calls])
    blob = json.dumps([user_id, canon], ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()
