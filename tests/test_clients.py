"""The clients people already use, in-process: the official openai client over the ASGI app."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_api import CALC_CALL, chat_body, serve

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


class SubwordBackend(ScriptedBackend):
    """Streams a character at a time, as a real engine streams sub-word tokens ("1", "7", " times")."""

    async def stream(self, messages, tools, params, adapter=None):
        async for item in super().stream(messages, tools, params, adapter):
            if isinstance(item, str):
                for char in item:
                    yield char
            else:
                yield item


# word-sized deltas, and sub-word ones: a step's deltas join as written, only a new step starts a paragraph
@pytest.mark.parametrize("backend_class", [ScriptedBackend, SubwordBackend])
async def test_the_plain_reply_carries_the_text_written_before_a_tool_call_too(tmp_path, backend_class):
    backend = backend_class(["Let me compute that." + CALC_CALL, "17 times 23 is 391."])
    async with serve(tmp_path, backend) as (http, _):
        reply = await openai_client(http).chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "17*23?"}]
        )
    assert reply.choices[0].message.content == "Let me compute that.\n\n17 times 23 is 391."


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


async def test_tool_choice_none_answers_in_words_and_acts_on_no_call(tmp_path):
    backend = ScriptedBackend([CALC_CALL])
    async with serve(tmp_path, backend) as (http, res):
        reply = await openai_client(http).chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "17*23?"}], tools=[WEATHER], tool_choice="none"
        )
        assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "stop"
        assert backend.calls[0].tools == [] and len(backend.calls) == 1
        assert (await res.store.get_turn(reply.id)).closed_at is None  # no tool ran to close it


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"logprobs": True, "top_logprobs": 3}, "top_logprobs"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logit_bias": {"42": 5}}, "logit_bias"),
    ],
)
async def test_a_field_the_server_cannot_honour_is_refused_by_name(tmp_path, extra, field):
    async with serve(tmp_path, ScriptedBackend(["ok"])) as (http, _):
        response = await http.post("/v1/chat/completions", json=chat_body("hi", tools=[WEATHER], **extra))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith(field) and field in error["message"]


async def test_logprobs_come_back_in_the_openai_shape_plain_and_streamed(tmp_path):
    async with serve(tmp_path, ScriptedBackend(["Hi!", "Yo"])) as (http, res):
        client = openai_client(http)
        messages = [{"role": "user", "content": "hello"}]
        reply = await client.chat.completions.create(model="scripted", messages=messages, logprobs=True, top_logprobs=0)
        entries = reply.choices[0].logprobs.content
        assert "".join(e.token for e in entries) == "Hi!"
        turn = await res.store.get_turn(reply.id)
        assert [e.logprob for e in entries] == turn.response_logprobs
        stream = await client.chat.completions.create(model="scripted", messages=messages, logprobs=True, stream=True)
        streamed = [e.token for c in [c async for c in stream] if c.choices and c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content]  # fmt: skip
        assert "".join(streamed) == "Yo"


async def test_models_retrieve_finds_the_served_model_even_with_a_slash_in_its_id(tmp_path):
    async with serve(tmp_path, ScriptedBackend([]), model={"served_name": "org/some-model"}) as (http, _):
        client = openai_client(http)
        assert (await client.models.retrieve("org/some-model")).id == "org/some-model"
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("other/model")


async def test_another_model_name_is_served_by_default_and_refused_when_strict(tmp_path):
    async with serve(tmp_path, ScriptedBackend(["hello"])) as (http, _):
        reply = await openai_client(http).chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], user="u1",
            stream_options=None,
        )
        assert reply.model == "scripted" and reply.choices[0].message.content == "hello"
    (tmp_path / "strict").mkdir()
    async with serve(tmp_path / "strict", ScriptedBackend([]), server={"strict_model_names": True}) as (http, _):
        with pytest.raises(openai.NotFoundError, match="gpt-4o"):
            await openai_client(http).chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])


async def test_what_open_webui_and_librechat_send_is_accepted_with_usage_in_the_stream(tmp_path):
    # the shapes both send: stream_options.include_usage, a user id, zero penalties (Open WebUI keeps
    # its own metadata to itself: its OpenAI router pops the key before forwarding the body)
    body = chat_body("hi", stream=True, stream_options={"include_usage": True}, user="librechat-user-1",
                     frequency_penalty=0, presence_penalty=0, top_p=1, temperature=0.7, max_tokens=64,
                     model="llama3.1:latest")  # fmt: skip
    async with serve(tmp_path, ScriptedBackend(["Hello there"])) as (http, res):
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            chunks = [json.loads(line[6:]) async for line in response.aiter_lines()
                      if line.startswith("data: {")]  # fmt: skip
        usage = [c["usage"] for c in chunks if c.get("usage")]
        assert usage and usage[0]["completion_tokens"] == len("Hello there")
        assert {c["model"] for c in chunks} == {"scripted"}
        turn = await res.store.get_turn(chunks[0]["id"])
        assert turn.user_id == "librechat-user-1"
