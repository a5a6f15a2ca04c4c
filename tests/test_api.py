"""The HTTP API in-process: ASGI transport, SQLite in tmp_path, MemoryBus, scripted or tiny model."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from whet.config.settings import AgentConfig, load_config
from whet.memory.index import HashingEmbedder
from whet.memory.store import StoreFull, StoreUnavailable
from whet.runtime.app import create_app
from whet.runtime.scripted import ScriptedBackend
from whet.runtime.tools import ToolPool
from whet.servers import calc, clock, notes

pytestmark = pytest.mark.anyio

CALC_CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "17*23"}}</tool_call>'


def make_config(tmp_path: Path, **overrides: Any):
    base = {"data_dir": str(tmp_path), "memory": {"embedder": "hashing"}, "model": {"id": "scripted"}}
    for key, value in overrides.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return load_config(overrides=base)


def bundled_tools(tmp_path: Path) -> ToolPool:
    servers = {
        "calc": calc.build_server(),
        "clock": clock.build_server(),
        "notes": notes.build_server(tmp_path / "notes.db", forget_tool=True),  # as the stdio server
    }
    return ToolPool([], in_memory=servers)


@asynccontextmanager
async def serve(tmp_path: Path, backend, **config_overrides: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    config = make_config(tmp_path, **config_overrides)
    app = create_app(config, backend=backend, tools=bundled_tools(tmp_path), embedder=HashingEmbedder())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://whet") as client:
            yield client, app.state.resources


def chat_body(*contents: str, **extra: Any) -> dict[str, Any]:
    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    return {"model": "scripted", "messages": messages, **extra}


async def test_a_turn_calls_a_bundled_mcp_tool_and_records_every_action(tmp_path):
    backend = ScriptedBackend([CALC_CALL, "17 times 23 is 391."])
    async with serve(tmp_path, backend) as (client, res):
        response = await client.post("/v1/chat/completions", json=chat_body("what is 17*23?"))
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["message"]["content"] == "17 times 23 is 391."
        assert body["id"] == response.headers["x-whet-turn"]
        # the second model call saw the tool's real answer
        tool_messages = [m for m in backend.calls[1].messages if m["role"] == "tool"]
        assert tool_messages and "391" in tool_messages[0]["content"]
        turns = await res.store.list_turns(session_id=response.headers["x-whet-session"])
        assert [t.step for t in reversed(turns)] == [0, 1]
        tool_turn, final_turn = turns[1], turns[0]
        assert tool_turn.next_state_kind == "tool_result" and tool_turn.closed_at is not None
        assert "391" in json.dumps(tool_turn.next_state)
        assert final_turn.id == body["id"] and final_turn.closed_at is None
        for turn in turns:
            assert turn.prompt_token_ids and turn.response_token_ids
            assert len(turn.response_logprobs) == len(turn.response_token_ids)
        assert tool_turn.tool_calls[0]["function"]["name"] == "calculate"


async def test_streaming_yields_incremental_chunks_and_done(tmp_path):
    backend = ScriptedBackend([CALC_CALL, "The answer is 391, computed with the calculator."])
    async with serve(tmp_path, backend) as (client, _):
        async with client.stream("POST", "/v1/chat/completions", json=chat_body("17*23?", stream=True)) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    texts = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert len([t for t in texts if t]) >= 3  # real increments, not one blob
    assert "".join(t or "" for t in texts) == "The answer is 391, computed with the calculator."
    assert "<tool_call>" not in "".join(t or "" for t in texts)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert len({c["id"] for c in chunks}) == 1


async def test_feedback_closes_the_open_turn_and_is_accepted_later_too(tmp_path):
    async with serve(tmp_path, ScriptedBackend(["Hello!", "Again."])) as (client, res):
        first = (await client.post("/v1/chat/completions", json=chat_body("hi"))).json()
        ack = await client.post("/v1/feedback", json={"turn_id": first["id"], "thumbs": "up", "text": "nice"})
        assert ack.status_code == 201, ack.text
        assert ack.json()["closed_turn"] is True and ack.json()["score"] == 1.0
        turn = (await client.get(f"/v1/turns/{first['id']}")).json()
        assert turn["next_state_kind"] == "feedback"
        # later feedback on an already-closed turn is still stored, and does not re-close it
        again = await client.post("/v1/feedback", json={"turn_id": first["id"], "score": -0.5})
        assert again.status_code == 201 and again.json()["closed_turn"] is False
        assert [f.score for f in await res.store.list_feedback(first["id"])] == [1.0, -0.5]


async def test_a_plain_client_conversation_lands_in_one_session_and_the_reply_closes_the_turn(tmp_path):
    async with serve(tmp_path, ScriptedBackend(["Lisbon is at UTC+0.", "Sorry, in Lisbon it is 13:00.", "Sure."])) as (client, res):
        first = await client.post("/v1/chat/completions", json=chat_body("time in Lisbon?"))
        answer = first.json()["choices"][0]["message"]["content"]
        second = await client.post(
            "/v1/chat/completions", json=chat_body("time in Lisbon?", answer, "No, I meant the local time")
        )
        assert second.headers["x-whet-session"] == first.headers["x-whet-session"]
        closed = await res.store.get_turn(first.json()["id"])
        assert closed.next_state_kind == "user_message"
        assert closed.next_state["messages"][0]["content"] == "No, I meant the local time"
        # an unrelated conversation starts its own session
        other = await client.post("/v1/chat/completions", json=chat_body("something else"))
        assert other.headers["x-whet-session"] != first.headers["x-whet-session"]


async def test_a_malformed_tool_call_becomes_a_tool_error_for_the_model(tmp_path):
    replies = ['<tool_call>{"name": "calculate", "arguments": {oops</tool_call>',
               '<tool_call>{"name": "no_such_tool", "arguments": {}}</tool_call>',
               '<tool_call>{"name": "calculate", "arguments": {"expression": 5}}</tool_call>',
               "I could not compute that."]
    backend = ScriptedBackend(replies)
    async with serve(tmp_path, backend) as (client, _):
        response = await client.post("/v1/chat/completions", json=chat_body("compute"))
        assert response.status_code == 200
        assert response.json()["choices"][0]["message"]["content"] == "I could not compute that."
    errors = [m["content"] for call in backend.calls[1:] for m in call.messages[-1:] if m["role"] == "tool"]
    assert len(errors) == 3 and all(e.startswith("error:") for e in errors)
    assert "no_such_tool" in errors[1]


async def test_client_side_tools_come_back_to_the_client_as_tool_calls(tmp_path):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Porto"}}</tool_call>'
    backend = ScriptedBackend([call, "It is sunny in Porto."])
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    async with serve(tmp_path, backend) as (client, res):
        first = await client.post("/v1/chat/completions", json=chat_body("weather in Porto?", tools=[weather]))
        message = first.json()["choices"][0]
        assert message["finish_reason"] == "tool_calls"
        tool_call = message["message"]["tool_calls"][0]
        assert tool_call["function"]["name"] == "get_weather"
        follow_up = {
            "model": "scripted",
            "tools": [weather],
            "messages": [
                {"role": "user", "content": "weather in Porto?"},
                {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                {"role": "tool", "tool_call_id": tool_call["id"], "content": "sunny, 24C"},
            ],
        }
        second = await client.post("/v1/chat/completions", json=follow_up)
        assert second.json()["choices"][0]["message"]["content"] == "It is sunny in Porto."
        assert second.headers["x-whet-session"] == first.headers["x-whet-session"]
        closed = await res.store.get_turn(first.json()["id"])
        assert closed.next_state_kind == "tool_result"


@pytest.mark.parametrize(
    ("send", "status", "fragment"),
    [
        (lambda c: c.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}), 400, "not valid JSON"),
        (lambda c: c.post("/v1/chat/completions", json={"model": "scripted", "messages": []}), 400, "at least one message"),
        (lambda c: c.post("/v1/chat/completions", json={"model": "scripted"}), 400, "messages"),
        (lambda c: c.post("/v1/chat/completions", content=b"x" * 5000, headers={"content-type": "application/json"}), 413, "larger than"),
        (lambda c: c.get("/v1/turns/turn_doesnotexist"), 404, "turn_doesnotexist"),
        (lambda c: c.post("/v1/feedback", json={"turn_id": "turn_nope", "score": 1}), 404, "turn_nope"),
        (lambda c: c.post("/v1/feedback", json={"turn_id": "turn_nope", "score": 7}), 400, "between -1 and 1"),
        (lambda c: c.get("/v1/turns?limit=0"), 400, "limit"),
    ],
)
async def test_bad_input_gets_a_4xx_with_a_message(tmp_path, send, status, fragment):
    async with serve(tmp_path, ScriptedBackend(["ok"]), server={"max_body_bytes": 4096}) as (client, _):
        response = await send(client)
    assert response.status_code == status, response.text
    assert fragment in response.json()["error"]["message"]


async def test_api_keys_decide_the_user_and_guard_every_route(tmp_path):
    keys = {"sk-alice": "alice", "sk-bob": "bob"}
    async with serve(tmp_path, ScriptedBackend(["hi alice"]), server={"api_keys": keys}) as (client, _):
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/health", headers={"Authorization": "Bearer wrong"})).status_code == 401
        alice = {"Authorization": "Bearer sk-alice"}
        response = await client.post("/v1/chat/completions", json=chat_body("hello", user="mallory"), headers=alice)
        turn_id = response.json()["id"]
        assert (await client.get(f"/v1/turns/{turn_id}", headers=alice)).json()["user_id"] == "alice"
        # bob cannot see or rate alice's turn
        bob = {"Authorization": "Bearer sk-bob"}
        assert (await client.get(f"/v1/turns/{turn_id}", headers=bob)).status_code == 404
        assert (await client.post("/v1/feedback", json={"turn_id": turn_id, "score": 1}, headers=bob)).status_code == 404


async def test_models_tools_health_and_metrics_describe_the_service(tmp_path):
    async with serve(tmp_path, ScriptedBackend([CALC_CALL, "391"])) as (client, _):
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == "scripted" and models["data"][0]["adapter"] is None
        tools = {t["name"]: t for t in (await client.get("/v1/tools")).json()}
        assert {"calculate", "convert"} <= set(tools) and tools["calculate"]["server"] == "calc"
        assert tools["calculate"]["annotations"].get("readOnlyHint") is True
        health = (await client.get("/health")).json()
        assert health["status"] == "ok" and set(health["servers"]) == {"calc", "clock", "notes"}
        assert health["server_errors"] == {}
        await client.post("/v1/chat/completions", json=chat_body("17*23"))
        metrics = (await client.get("/metrics")).text
        assert 'whet_turns_total{policy_version="base"} 2.0' in metrics
        assert 'whet_tool_calls_total{outcome="ok",server="calc",tool="calculate"} 1.0' in metrics


async def test_lessons_from_memory_reach_the_prompt_for_that_user_only(tmp_path):
    backend = ScriptedBackend(["noted", "noted", "a joke"])
    async with serve(tmp_path, backend) as (client, res):
        lesson = await res.store.add_lesson("alice", "When alice says home she means Lisbon time.")
        res.index.add(lesson.id, "alice", lesson.text)
        await client.post("/v1/chat/completions", json=chat_body("what time is it at home?", user="alice"))
        await client.post("/v1/chat/completions", json=chat_body("what time is it at home?", user="bob"))
        await client.post("/v1/chat/completions", json=chat_body("Tell me a joke about penguins.", user="alice"))
        unrelated = res.index.search("alice", "Tell me a joke about penguins.", 1)[0].score
    alice_system = backend.calls[0].messages[0]["content"]
    bob_system = backend.calls[1].messages[0]["content"]
    assert "Lisbon time" in alice_system and "Lisbon time" not in bob_system
    # a lesson that does not read like the request stays out (agent.lessons_min_score)
    assert unrelated < AgentConfig().lessons_min_score and "Lisbon time" not in backend.calls[2].messages[0]["content"]


async def test_a_lesson_far_below_the_closest_stays_out_of_the_prompt(tmp_path):
    """The lesson about this request is not drowned by the user's other lessons of its kind
    (run Q: alex's three lessons about home beside Sam's city made "Sam's place" Tbilisi)."""
    sam = 'When asked "What time is it at Sam\'s place?": The user meant Tokyo time, Sam lives in Tokyo'
    home = ['When asked "What time is it at home?": The user meant Lisbon time',
            'When asked "What time is it at home?": calling now({"timezone": "Lisbon"}) was right.']
    backend = ScriptedBackend(["ok", "ok"])
    async with serve(tmp_path, backend) as (client, res):
        for text in (sam, *home):
            lesson = await res.store.add_lesson("alice", text)
            res.index.add(lesson.id, "alice", lesson.text)
        for asked in ("What time is it at Sam's place?", "What time is it at home?"):
            await client.post("/v1/chat/completions", json=chat_body(asked, user="alice"))
        scores = {h.text: h.score for h in res.index.search("alice", "What time is it at Sam's place?", 4)}
    config = AgentConfig()
    # the home lessons are close enough to be shown on their own, but far below Sam's
    assert all(config.lessons_min_score <= scores[h] < scores[sam] - config.lessons_margin for h in home), scores
    sam_prompt, home_prompt = (call.messages[0]["content"] for call in backend.calls)
    assert "Tokyo" in sam_prompt and "Lisbon" not in sam_prompt
    assert all(h in home_prompt for h in home)  # the two about home are about as close as each other


async def test_a_request_with_store_false_is_served_and_kept_but_never_learned_from(tmp_path):
    """``store: false`` (OpenAI's field): the bench's evaluation sends it. A failed tool call is
    judged the moment its result comes back, and a correction makes a lesson; neither may come
    of such a request, whatever feedback follows it. The same request without it is learned from."""
    from whet.memory.tables import UNLEARNED_JUDGE

    bad_call = '<tool_call>{"name": "now", "arguments": {"timezone": "Atlantis"}}</tool_call>'
    backend = ScriptedBackend([bad_call, "Sorry, that did not work.", bad_call, "Sorry, that did not work."])
    async with serve(tmp_path, backend, learner={"train": False}) as (client, res):
        kept = await client.post("/v1/chat/completions", json=chat_body("What time is it at home?", store=False))
        learnt = await client.post("/v1/chat/completions", json=chat_body("What time is it at home?", user="bob"))
        assert kept.status_code == learnt.status_code == 200, kept.text
        for response in (kept, learnt):
            feedback = {"turn_id": response.json()["id"], "thumbs": "down", "text": "No, I meant Lisbon time."}
            assert (await client.post("/v1/feedback", json=feedback)).status_code == 201
            for turn in await res.store.list_turns(session_id=response.headers["x-whet-session"]):
                await res.learner.judge_turn(turn.id, rejudge=True)
        await res.learner.catch_up()
        kept_turns = await res.store.list_turns(session_id=kept.headers["x-whet-session"])
        assert len(kept_turns) == 2  # kept for the session: its tool call is there to read
        for turn in kept_turns:
            judgment = await res.store.get_judgment(turn.id)
            assert judgment.judge == UNLEARNED_JUDGE and judgment.score == 0 and not judgment.trainable
        assert await res.store.list_lessons(res.config.server.default_user) == []
        learnt_turns = await res.store.list_turns(session_id=learnt.headers["x-whet-session"])
        assert [(await res.store.get_judgment(t.id)).score for t in learnt_turns] == [-1, -1]
        assert await res.store.list_lessons("bob")


def test_learner_scope_auto_is_per_user_when_the_keys_name_several_users():
    keys = {"sk-a": "alice", "sk-b": "bob"}
    assert load_config(overrides={"server": {"api_keys": keys}}).learner.scope == "user"
    assert load_config(overrides={"server": {"api_keys": {"sk-a": "alice", "sk-a2": "alice"}}}).learner.scope == "global"
    assert load_config(overrides={}).learner.scope == "global"  # no keys: one user
    explicit = {"server": {"api_keys": keys}, "learner": {"scope": "global"}}
    assert load_config(overrides=explicit).learner.scope == "global"  # an operator's choice stands


async def test_in_global_scope_only_trusted_users_turns_train_the_shared_adapter(tmp_path):
    """``learner.trusted_users``: bob's corrected turn is judged and gives bob a lesson, but is no
    training sample for the adapter alice gets; alice's is."""
    bad_call = '<tool_call>{"name": "now", "arguments": {"timezone": "Atlantis"}}</tool_call>'
    backend = ScriptedBackend([bad_call, "Sorry.", bad_call, "Sorry."])
    learner = {"train": False, "scope": "global", "trusted_users": ["alice"]}
    async with serve(tmp_path, backend, learner=learner) as (client, res):
        trainable = {}
        for user in ("alice", "bob"):
            response = await client.post("/v1/chat/completions", json=chat_body("What time is it at home?", user=user))
            feedback = {"turn_id": response.json()["id"], "thumbs": "down", "text": "No, I meant Lisbon time."}
            assert (await client.post("/v1/feedback", json=feedback)).status_code == 201
            for turn in await res.store.list_turns(session_id=response.headers["x-whet-session"]):
                await res.learner.judge_turn(turn.id, rejudge=True)
            turns = await res.store.list_turns(session_id=response.headers["x-whet-session"])
            trainable[user] = [(await res.store.get_judgment(t.id)).trainable for t in turns]
            assert await res.store.list_lessons(user)  # every user's lessons are their own
    assert trainable == {"alice": [True, True], "bob": [False, False]}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    from whet.learner.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


async def test_a_tiny_random_model_serves_and_its_turn_keeps_the_engine_token_ids(tmp_path, tiny_model_dir):
    from whet.runtime.hf import TransformersBackend

    backend = TransformersBackend(str(tiny_model_dir), model_name="tiny", workers=2)
    async with serve(tmp_path, backend, model={"id": "tiny", "max_new_tokens": 16}) as (client, res):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "seed": 3}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        turn = await res.store.get_turn(response.json()["id"])
        # the recorded prompt ids are exactly what the engine's template and tokenizer give
        prompt_messages = turn.prompt_messages
        tools = res.tools.openai_tools(turn.tool_names)
        assert turn.prompt_token_ids == backend.prompt_ids(prompt_messages, tools)
        assert 0 < len(turn.response_token_ids) == len(turn.response_logprobs) <= 16
        assert response.json()["usage"]["completion_tokens"] == len(turn.response_token_ids)


@pytest.mark.loopback
async def test_scale_out_wiring_records_in_postgresql_and_publishes_on_mqtt(tmp_path, postgres_schema_url, mqtt_url):
    """Store commits first, then the event: a consumer on the broker finds the rows the event names."""
    from whet.memory.bus import FEEDBACK_ADDED, TURN_CLOSED, open_bus
    from whet.memory.store import open_store

    prefix = f"whet-test-{tmp_path.name[-8:]}"
    backend = ScriptedBackend([CALC_CALL, "391."])
    consumer = open_bus(f"{mqtt_url}/{prefix}")
    await consumer.start()
    reader = open_store(postgres_schema_url)
    try:
        async with consumer.subscribe(TURN_CLOSED, FEEDBACK_ADDED) as events:
            overrides = {"store": {"url": postgres_schema_url}, "bus": {"url": f"{mqtt_url}/{prefix}"}}
            async with serve(tmp_path, backend, **overrides) as (client, _):
                reply = (await client.post("/v1/chat/completions", json=chat_body("17*23?"))).json()
                await client.post("/v1/feedback", json={"turn_id": reply["id"], "thumbs": "down"})
                seen = []
                with anyio.fail_after(10):
                    async for event in events:
                        seen.append(event)
                        # the store is the source of truth: what the event names is already there
                        turn = await reader.get_turn(event.data["turn_id"])
                        assert turn is not None and turn.closed_at is not None
                        if len(seen) == 3:
                            break
        kinds = [(e.name, e.data.get("kind")) for e in seen]
        assert kinds == [(TURN_CLOSED, "tool_result"), (TURN_CLOSED, "feedback"), (FEEDBACK_ADDED, None)]
        assert seen[2].data["turn_id"] == reply["id"]
    finally:
        await reader.aclose()
        await consumer.aclose()


async def test_a_long_tool_list_is_narrowed_to_the_tools_relevant_to_the_request(tmp_path):
    backend = ScriptedBackend(["5 km is about 3.1 miles."])
    async with serve(tmp_path, backend, agent={"tools_k": 3}) as (client, res):
        assert len(res.tools.tools()) > 3
        await client.post("/v1/chat/completions", json=chat_body("please convert 5 km to miles"))
    shown = [t["function"]["name"] for t in backend.calls[0].tools]
    assert len(shown) == 3 and "convert" in shown


async def test_health_is_degraded_and_names_the_reason_when_a_tool_server_failed(tmp_path):
    from whet.config.mcp import McpServerSpec, StdioTransport
    from whet.memory.index import HashingEmbedder

    broken = McpServerSpec(name="broken", transport=StdioTransport(command="/nonexistent/whet-server"))
    tools = ToolPool([broken], in_memory={"calc": calc.build_server()}, start_timeout=10)
    app = create_app(make_config(tmp_path), backend=ScriptedBackend(["hi"]), tools=tools, embedder=HashingEmbedder())
    async with app.router.lifespan_context(app):
        await tools.settle()  # the pool starts in the background: let both servers' first starts end
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://whet") as client:
            response = await client.get("/health")
    assert response.status_code == 200  # still serving, with calc's tools
    health = response.json()
    assert health["status"] == "degraded"
    assert health["servers"] == {"broken": "failed", "calc": "ready"}
    assert list(health["server_errors"]) == ["broken"] and "FileNotFoundError" in health["server_errors"]["broken"]


@pytest.mark.parametrize(("failure", "status", "code"), [(StoreUnavailable, 503, "store_unavailable"),
                                                         (StoreFull, 507, "store_full")])  # fmt: skip
async def test_a_store_that_cannot_write_is_a_503_or_507_and_a_started_stream_says_so_in_band(
    tmp_path, monkeypatch, failure, status, code
):
    async with serve(tmp_path, ScriptedBackend(["it is sunny", "it is sunny again"])) as (client, res):

        async def cannot_write(*args: Any, **kwargs: Any) -> Any:
            raise failure("nothing was written (test)")

        monkeypatch.setattr(res.store, "add_turn", cannot_write)
        plain = await client.post("/v1/chat/completions", json=chat_body("weather?"))
        assert plain.status_code == status and plain.json()["error"]["code"] == code
        if status == 503:
            assert plain.headers["retry-after"] == "5"
        streamed = chat_body("weather?", stream=True)
        async with client.stream("POST", "/v1/chat/completions", json=streamed) as response:
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        assert response.status_code == 200  # the stream had started before the write
        errors = [json.loads(line[6:])["error"] for line in lines[:-1] if "error" in json.loads(line[6:])]
        assert errors and "nothing was written (test)" in errors[0]["message"] and lines[-1] == "data: [DONE]"
