"""The clients people already use, in-process: the official openai client over the ASGI app."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_api import CALC_CALL, serve

from whet.runtime.scripted import ScriptedBackend

pytestmark = pytest.mark.anyio

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def openai_client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://whet/v1", api_key="unused", http_client=http)


async def test_text_before_a_tool_call_is_streamed_stored_and_continued_in_one_session(tmp_path):
    backend = ScriptedBackend(["Let me compute that.\n" + CALC_CALL, "It is 391.", "You're welcome."])
    async with serve(tmp_path, backend) as (http, res):
        client = openai_client(http)
        question = [{"role": "user", "content": "what is 17*23?"}]
        stream = await client.chat.completions.create(model="scripted", messages=question, stream=True)
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "Let me compute that.\nIt is 391."
        assert len({c.id for c in chunks}) == 1
        answer = await res.store.get_turn(chunks[0].id)
        assert answer is not None and answer.response_text == "It is 391."
        # the client sends back exactly what it was streamed: whet finds the session and closes the answer
        follow = [*question, {"role": "assistant", "content": text}, {"role": "user", "content": "thanks"}]
        raw = await client.chat.completions.with_raw_response.create(model="scripted", messages=follow)
        assert raw.headers["x-whet-session"] == answer.session_id
        closed = await res.store.get_turn(answer.id)
        assert closed.next_state_kind == "user_message"


async def test_the_plain_reply_carries_the_text_written_before_a_tool_call_too(tmp_path):
    backend = ScriptedBackend(["Let me compute that." + CALC_CALL, "It is 391."])
    async with serve(tmp_path, backend) as (http, _):
        reply = await openai_client(http).chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "17*23?"}]
        )
    assert reply.choices[0].message.content == "Let me compute that.\n\nIt is 391."


async def test_a_step_calling_a_client_tool_and_an_mcp_tool_runs_the_mcp_call_and_returns_the_other(tmp_path):
    both = CALC_CALL + '<tool_call>{"name": "get_weather", "arguments": {"city": "Porto"}}</tool_call>'
    backend = ScriptedBackend([both, "391, and sunny in Porto."])
    async with serve(tmp_path, backend) as (http, res):
        client = openai_client(http)
        question = [{"role": "user", "content": "17*23 and the weather in Porto?"}]
        first = await client.chat.completions.create(model="scripted", messages=question, tools=[WEATHER])
        calls = first.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["get_weather"]
        turn = await res.store.get_turn(first.id)
        assert turn.next_state_kind == "tool_result" and "391" in json.dumps(turn.next_state)
        follow = [*question, first.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]
        second = await client.chat.completions.create(model="scripted", messages=follow, tools=[WEATHER])
        assert second.choices[0].message.content == "391, and sunny in Porto."
    # the model's next step saw its whole previous step: both calls, and both results
    seen = backend.calls[1].messages
    step = next(m for m in seen if m.get("tool_calls"))
    assert {c["function"]["name"] for c in step["tool_calls"]} == {"calculate", "get_weather"}
    results = [m["content"] for m in seen if m["role"] == "tool"]
    assert any("391" in r for r in results) and "sunny" in results
