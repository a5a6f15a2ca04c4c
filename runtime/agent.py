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

import dataclasses
import hashlib
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import anyio
import numpy as np
import structlog

from whet.config.settings import AgentConfig
from whet.learner.prompt import canonical_arguments, last_user_text, prompt_with_lessons
from whet.memory.experience import Experience
from whet.memory.index import LessonIndex, recall
from whet.memory.tables import Approval, Turn, TurnCreate, new_turn_id, utcnow
from whet.runtime.adapters import AdapterRouter
from whet.runtime.approvals import ApprovalPolicy, approval_call, outcome, unrun_result
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
    # False: the request said ``store: false``; its turns are kept for the session, never learned from
    learn: bool = True


@dataclass
class AgentResult:
    turn: Turn  # the last recorded turn; its id is the response id
    content: str
    client_tool_calls: list[ToolCall]  # for the client to run; a held step's is the whet_approval call
    finish_reason: str
    usage: dict[str, int]
    messages: list[dict[str, Any]]  # the conversation as the model saw it, reply included
    approval: Approval | None = None  # set when the step waits for a person's decision
    tip: str | None = None  # the session tip recorded with the turn (:func:`reply_tip`), if it was


@dataclass
class _Run:
    """Where one request's loop stands; a held step saves it and its decision resumes from it."""

    messages: list[dict[str, Any]]  # as the model sees them
    tools: list[dict[str, Any]]
    usage: dict[str, int]
    shown: list[str]  # every text delta the client saw: the reply is all of it, across steps


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
        approvals: ApprovalPolicy | None = None,
    ) -> None:
        self.backend = backend
        self.tools = tools
        self.experience = experience
        self.index = index
        self.config = config
        self.metrics = metrics
        self.adapters = adapters  # None: requests run on whatever ``request.adapter`` names
        self.approvals = approvals or ApprovalPolicy()
        self._tool_vectors: dict[str, np.ndarray] = {}  # "name: description" -> embedding

    async def run(self, request: TurnRequest, approval: Approval | None = None) -> AgentResult:
        # closed on return, so the adapter lease ends with the request, not when the generator is collected
        async with aclosing(self.events(request, approval)) as events:
            async for event in events:
                if isinstance(event, AgentResult):
                    return event
        raise RuntimeError("agent loop ended without a result")  # pragma: no cover

    async def events(
        self, request: TurnRequest, approval: Approval | None = None
    ) -> AsyncIterator[Delta | AgentResult]:
        """Text deltas of what the model says to the user, then one AgentResult.

        With a decided ``approval`` (and ``request`` from :func:`resumed_request`), the request
        that approval held goes on from its held step: the calls run (approved) or the model
        reads that they were rejected, and the loop continues.

        The adapter is pinned at the first iteration and held until the iterator ends,
        fails, is closed (``contextlib.aclosing``) or its task is cancelled.
        """
        with self._pinned(request):
            steps_of = self._steps(request) if approval is None else self._resumed(request, approval)
            async with aclosing(steps_of) as steps:
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
        run = _Run(messages, tools, {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}, [])
        async with aclosing(self._loop(request, run, 0, None)) as steps:
            async for event in steps:
                yield event

    async def _loop(
        self, request: TurnRequest, run: _Run, first: int, turn: Turn | None
    ) -> AsyncIterator[Delta | AgentResult]:
        """Model steps from ``first`` on, until a final answer, calls for the client, a held step or the limit."""
        messages, shown = run.messages, run.shown
        client_names = {t["function"]["name"] for t in request.client_tools}
        for step in range(first, self.config.max_steps):
            generation = None
            earlier = len(shown)  # deltas of the steps before this one
            async for item in self._generate(messages, run.tools, request):
                if isinstance(item, Generation):
                    generation = item
                    continue
                if len(shown) == earlier and shown and not shown[-1][-1:].isspace() and not item[:1].isspace():
                    item = "\n\n" + item  # a new step's text starts a new paragraph
                shown.append(item)
                yield Delta(item)
            assert generation is not None
            for key, value in generation.usage.items():
                run.usage[key] += value
            calls, errors = generation.tool_calls, generation.tool_call_errors
            if request.tool_choice == "none":
                calls, errors = [], []  # markup the model wrote anyway is not acted on (nor shown)
            client_calls = [c for c in calls if c.name in client_names]
            held = [c for c in calls if c.name not in client_names and self._needs_approval(c)]
            final = (not calls and not errors) or bool(client_calls or held) or step == self.config.max_steps - 1
            turn_id = request.answer_turn_id if final else new_turn_id()
            content = "".join(shown).strip()
            # a plain answer, or calls all for the client: the reply the client gets is known now, so the
            # session's tip is written with the turn (one transaction, not two); anything else, after
            tip = None
            if final and not held and (not calls and not errors or len(client_calls) == len(calls) and not errors):
                tip = reply_tip(request, content, client_calls)
            turn = await self._record(request, turn_id, step, messages, run.tools, generation, tip)
            if not calls and not errors:
                messages.append({"role": "assistant", "content": generation.content})
                finish = "stop" if generation.finish_reason == "tool_calls" else generation.finish_reason
                yield self._result(turn, content, [], finish, run.usage, messages, tip=tip)
                return
            if held:  # none of the step's calls runs before a person decides
                approval = await self._hold(request, run, turn, step, generation.content, calls, errors, held)
                yield self._result(turn, content, [approval_call(approval)], "tool_calls", run.usage, messages,
                                   approval)  # fmt: skip
                return
            result = await self._act_step(request, run, turn, generation.content, calls, errors)
            if result is not None:
                yield dataclasses.replace(result, tip=tip)
                return
        if not shown:
            shown.append(f"I stopped after {self.config.max_steps} tool steps without a final answer.")
            yield Delta(shown[0])
        assert turn is not None
        yield self._result(turn, "".join(shown).strip(), [], "length", run.usage, messages)

    async def _act_step(
        self, request: TurnRequest, run: _Run, turn: Turn, content: str, calls: list[ToolCall], errors: list[str],
        approval: Approval | None = None,
    ) -> AgentResult | None:  # fmt: skip
        """Run a step's server calls and close its turn; an AgentResult when the client has calls to run."""
        client_names = {t["function"]["name"] for t in request.client_tools}
        client_calls = [c for c in calls if c.name in client_names]
        server_calls = [c for c in calls if c.name not in client_names]
        if server_calls or errors:
            # run what the server can even when the client has calls of its own; nothing is dropped
            unrun = {}
            if approval is not None and approval.status != "approved":
                unrun = {c["id"]: unrun_result(approval) for c in approval.calls}
            results = await self._act(server_calls, errors, request.user_id, unrun)
            run.messages.append(_assistant_message(content, calls if client_calls else server_calls))
            run.messages.extend(results)
            next_state: dict[str, Any] = {"results": results}
            if approval is not None:
                next_state["approval"] = outcome(approval)
            await self.experience.close(turn.id, "tool_result", next_state)
        if not client_calls:
            return None
        if not server_calls:
            run.messages.append(_assistant_message(content, client_calls))
        content = "".join(run.shown).strip()
        return self._result(turn, content, client_calls, "tool_calls", run.usage, run.messages)

    async def _hold(
        self, request: TurnRequest, run: _Run, turn: Turn, step: int, content: str, calls: list[ToolCall],
        errors: list[str], held: list[ToolCall],
    ) -> Approval:  # fmt: skip
        """Store the step as an approval, with all the request needs to go on from it once decided."""
        resume = {
            "step": step, "content": content, "calls": [c.to_openai() for c in calls], "errors": list(errors),
            "messages": run.messages, "tools": run.tools, "usage": run.usage, "shown": run.shown,
            "client_messages": request.messages, "client_tools": request.client_tools,
            "params": dataclasses.asdict(request.params), "tool_choice": request.tool_choice,
            "learn": request.learn,
        }  # fmt: skip
        now = utcnow()
        approval = Approval(
            turn_id=turn.id, session_id=request.session_id, user_id=request.user_id, request_id=request.request_id,
            calls=[c.to_openai() for c in held], resume=resume, created_at=now,
            expires_at=now + timedelta(seconds=self.approvals.timeout),
        )  # fmt: skip
        approval = await self.experience.store.add_approval(approval)
        log.info("approval.pending", approval=approval.id, tools=[c.name for c in held], turn=turn.id)
        return approval

    async def _resumed(self, request: TurnRequest, approval: Approval) -> AsyncIterator[Delta | AgentResult]:
        state = approval.resume
        run = _Run(state["messages"], state["tools"], dict(state["usage"]), list(state["shown"]))
        turn = await self.experience.store.get_turn(approval.turn_id)
        if turn is None:
            raise LookupError(f"the turn approval {approval.id} held is gone (its user was forgotten)")
        calls = [ToolCall(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                 for c in state["calls"]]  # fmt: skip
        result = await self._act_step(request, run, turn, state["content"], calls, state["errors"], approval)
        if result is not None:
            yield result
            return
        async with aclosing(self._loop(request, run, state["step"] + 1, turn)) as steps:
            async for event in steps:
                yield event

    def _needs_approval(self, call: ToolCall) -> bool:
        return self.approvals.needs(self.tools.info(call.name))

    def _result(self, turn, content, calls, finish, usage, messages, approval=None, tip=None) -> AgentResult:
        return AgentResult(turn, content, calls, finish, dict(usage), messages, approval, tip)

    async def _context(self, request: TurnRequest) -> list[dict[str, Any]]:
        messages = await self._with_server_results(request.session_id, [dict(m) for m in request.messages])
        lessons = await self._lessons(request.user_id, last_user_text(messages))
        return prompt_with_lessons(messages, lessons, self.config.system_prompt)

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
        return await recall(self.index, self.config, user_id, query)

    async def _tool_specs(self, request: TurnRequest, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if starting := await self.tools.settle():
            log.warning("mcp.tools.still_starting", servers=starting, note="answering with the tools that are ready")
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

    async def _record(self, request, turn_id, step, messages, tools, generation: Generation, tip=None) -> Turn:
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
            learn=request.learn,
            tip_hash=tip,
        )
        if self.metrics is not None:
            self.metrics.turn_recorded(generation)
        return turn

    async def _act(
        self, calls: list[ToolCall], errors: list[str], user_id: str, unrun: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """Run the tool calls concurrently for ``user_id``; every problem becomes a tool-error message.

        A call whose id is in ``unrun`` does not run: that text is its result (a rejected approval).
        """
        results: list[dict[str, Any]] = [{}] * len(calls)

        async def one(i: int, call: ToolCall) -> None:
            if unrun and call.id in unrun:
                results[i] = {"role": "tool", "tool_call_id": call.id, "name": call.name,
                              "content": unrun[call.id]}  # fmt: skip
                return
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


def resumed_request(approval: Approval) -> TurnRequest:
    """The request ``approval`` held, ready to go on (a new answer turn, the same request id)."""
    state = approval.resume
    params = SamplingParams(**{**state["params"], "stop": tuple(state["params"]["stop"])})
    return TurnRequest(approval.user_id, approval.session_id, state["client_messages"], state["client_tools"],
                       params, request_id=approval.request_id, tool_choice=state["tool_choice"],
                       learn=state.get("learn", True))  # fmt: skip


def _assistant_message(content: str, calls: list[ToolCall]) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}


def _safe_prefix(text: str) -> str:
    """The part of ``text`` that cannot be the start of a tool-call tag."""
    cut = text.rfind("<")
    if cut == -1:
        return text
    tail = text[cut:]
    if TOOL_CALL_OPEN.startswith(tail):
        return text[:cut]
    return text


def reply_tip(request: TurnRequest, content: str, client_calls: list[ToolCall]) -> str:
    """The session's tip once ``request`` is answered with ``content`` and ``client_calls``: the hash
    of the conversation as the client will send it back, which finds this session again."""
    reply: dict[str, Any] = {"role": "assistant", "content": content}
    if client_calls:
        reply["tool_calls"] = [c.to_openai() for c in client_calls]
    return conversation_hash(request.user_id, [*request.messages, reply])


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
