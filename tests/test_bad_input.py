"""Bad input through the API: NUL bytes on both store backends, and fields refused by name."""

from __future__ import annotations

import json

import anyio
import pytest

from tests.test_api import chat_body, serve
from whet.runtime.scripted import ScriptedBackend

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from whet.learner.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.loopback)])
def store_overrides(request) -> dict:
    if request.param == "sqlite":
        return {}
    return {"store": {"url": request.getfixturevalue("postgres_schema_url")}}


async def test_nul_bytes_in_what_is_said_are_stored_and_nul_ids_are_not_found(tmp_path, store_overrides):
    said = "an\x00swer"
    async with serve(tmp_path, ScriptedBackend([said, said]), **store_overrides) as (client, res):
        reply = await client.post("/v1/chat/completions", json=chat_body("q\x00uestion"))
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == said
        turn = await res.store.get_turn(reply.json()["id"])
        assert turn.response_text == said and turn.prompt_messages[-1]["content"] == "q\x00uestion"
        feedback = await client.post("/v1/feedback", json={"turn_id": turn.id, "score": -1, "text": "no\x00pe"})
        assert feedback.status_code == 201, feedback.text
        assert (await res.store.list_feedback(turn.id))[0].text == "no\x00pe"
        missing = await client.post("/v1/feedback", json={"turn_id": "turn_\x00", "score": 1})
        assert missing.status_code == 404, missing.text
        assert (await client.get("/v1/turns", params={"session": "s\x00", "user": "u\x00"})).json() == []
        refused = await client.post("/v1/chat/completions", json=chat_body("hi", user="al\x00ice"))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "user", refused.text
        assert (await client.delete("/v1/users/al%00ice")).json()["error"]["param"] == "user_id"


@pytest.mark.parametrize(
    ("path", "send"),
    [
        ("messages.0.content", lambda c: post_ascii(c, "/v1/chat/completions", tiny_body("a\ud800b"))),
        ("user", lambda c: post_ascii(c, "/v1/chat/completions", tiny_body("hi", user="\udfff"))),
        ("text", lambda c: post_ascii(c, "/v1/feedback", {"turn_id": "turn_x", "score": 1, "text": "x\ud800"})),
    ],
)
async def test_a_lone_surrogate_with_the_in_process_model_is_a_400_naming_the_field(tmp_path, tiny_model_dir,
                                                                                     path, send):  # fmt: skip
    from whet.runtime.hf import TransformersBackend

    backend = TransformersBackend(str(tiny_model_dir), model_name="tiny", workers=1)
    async with serve(tmp_path, backend, model={"id": "tiny", "max_new_tokens": 4}) as (client, _):
        response = await send(client)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == path and "unicode" in response.json()["error"]["message"].lower()
        fine = await client.post("/v1/chat/completions", json=tiny_body("hello"))
        assert fine.status_code == 200, fine.text


def post_ascii(client, url: str, body: dict):
    """JSON with \\u escapes, as a client sends a lone surrogate (httpx's own encoder cannot)."""
    return client.post(url, content=json.dumps(body), headers={"content-type": "application/json"})


def tiny_body(content: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **extra}


async def http_exchange(stream, body: dict) -> tuple[int, bytes]:
    """One HTTP/1.1 request on an open connection, and its response (status, body); (0, b"") if the
    server closed the connection instead of answering."""
    payload = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: whet\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()  # fmt: skip
    await stream.send(head + payload)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            data += await stream.receive()
        header, _, rest = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in header.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(rest) < length:
            rest += await stream.receive()
    except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
        return 0, b""
    return int(header.split(b" ")[1]), rest


@pytest.mark.loopback
async def test_after_a_500_the_next_request_on_the_same_keep_alive_connection_is_served(tmp_path):
    from tests.test_api import bundled_tools, make_config
    from tests.test_tools import serving_over_http
    from whet.memory.index import HashingEmbedder
    from whet.runtime.app import create_app

    def reply(messages, tools) -> str:
        if messages[-1]["content"] == "boom":
            raise RuntimeError("a bug in the serving path")
        return "fine"

    app = create_app(make_config(tmp_path), backend=ScriptedBackend(reply), tools=bundled_tools(tmp_path),
                     embedder=HashingEmbedder())  # fmt: skip
    async with serving_over_http(app) as port, await anyio.connect_tcp("127.0.0.1", port) as stream:
        with anyio.fail_after(30):
            status, body = await http_exchange(stream, chat_body("boom"))
            assert status == 500 and b"RuntimeError" in body
            for _ in range(2):  # the same connection, kept alive
                status, body = await http_exchange(stream, chat_body("hello"))
                assert status == 200, body


KEYED = {"server": {"api_keys": {"sk-alice": "alice"}, "max_body_bytes": 4096}}


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/no/such/route"])
async def test_docs_and_schema_need_the_key_when_keys_are_set(tmp_path, path):
    async with serve(tmp_path, ScriptedBackend(["ok"]), **KEYED) as (client, _):
        assert (await client.get(path)).status_code == 401
        keyed = await client.get(path, headers={"Authorization": "Bearer sk-alice"})
        assert keyed.status_code == (404 if path.startswith("/no/") else 200)


@pytest.mark.parametrize(
    "send",
    [
        lambda c: c.post("/v1/chat/completions", content=b"{not json"),
        lambda c: c.post("/v1/chat/completions", json={"model": "scripted"}),
        lambda c: c.post("/v1/chat/completions", content=b"x" * 10_000),
        lambda c: c.post("/v1/feedback", json={"turn_id": "t", "score": 7}),
    ],
    ids=["bad-json", "invalid", "too-large", "bad-feedback"],
)
async def test_a_request_without_a_key_is_a_401_before_its_body_is_looked_at(tmp_path, send):
    async with serve(tmp_path, ScriptedBackend(["ok"]), **KEYED) as (client, _):
        response = await send(client)
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == "invalid_api_key"


async def test_the_openapi_schema_declares_the_400_the_api_returns_and_no_422(tmp_path):
    async with serve(tmp_path, ScriptedBackend(["ok"])) as (client, _):
        schema = (await client.get("/openapi.json")).json()
        refused = await client.post("/v1/chat/completions", json={"model": "scripted"})
    assert refused.status_code == 400
    assert "422" not in json.dumps(schema["paths"])
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert chat["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "ErrorBody" in schema["components"]["schemas"]


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"turn_id": "t", "score": True}, "score", "not true/false"),
        (chat_body("x") | {"messages": [{"role": "user", "content": [{"text": "hi"}]}]}, "messages.0.content",
         "has no type"),
        (chat_body("x") | {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages.0.content", "'image_url'"),
        (chat_body("x") | {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "4"}]},
         "messages.1", "tool_call_id"),
    ],
    ids=["bool-score", "part-without-type", "image-part", "tool-without-id"],
)
async def test_a_field_that_cannot_be_honoured_is_refused_by_name(tmp_path, body, param, fragment):
    url = "/v1/feedback" if "turn_id" in body else "/v1/chat/completions"
    async with serve(tmp_path, ScriptedBackend(["ok"])) as (client, _):
        response = await client.post(url, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"]


async def test_a_404_never_echoes_a_huge_id_in_full(tmp_path):
    huge = "t" * 900_000
    async with serve(tmp_path, ScriptedBackend(["ok"]), server={"max_body_bytes": 2_000_000, "strict_model_names": True}) as (client, _):
        missing = await client.post("/v1/feedback", json={"turn_id": huge, "score": 1})
        unknown_model = await client.post("/v1/chat/completions", json=chat_body("hi") | {"model": huge})
    for response in (missing, unknown_model):
        assert response.status_code == 404 and len(response.content) < 1000
        assert "900000 characters" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("extra", "param", "fragment"),
    [
        ({"foo": 1}, "foo", "'foo' is not a field this server reads"),
        ({"messages": [{"role": "user", "content": "hi", "foo": 1}]}, "messages.0.foo", "'foo' is not a field"),
        ({"stream_options": {"include_usage": True, "foo": 1}}, "stream_options.foo", "'foo' is not a field"),
        ({"metadata": {"chat_id": "x"}}, "metadata", "not kept"),
        ({"service_tier": "auto"}, "service_tier", "one service tier"),
        ({"modalities": ["text", "audio"]}, "modalities", "text only"),
        ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio", "audio"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction", "predicted outputs"),
        ({"reasoning_effort": "low"}, "reasoning_effort", "reasoning-effort"),
        ({"web_search_options": {}}, "web_search_options", "search the web"),
        ({"functions": [{"name": "f"}]}, "functions", "send tools"),
        ({"function_call": "auto"}, "function_call", "send tool_choice"),
        ({"messages": [{"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
                       {"role": "user", "content": "hi"}]}, "messages.0.function_call", "send tool_calls"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, "tools.0.function.strict",
         "not held to the schema"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation", "pads no"),
    ],
    ids=["unknown", "unknown-in-message", "unknown-in-stream-options", "metadata", "service-tier", "modalities",
         "audio", "prediction", "reasoning-effort", "web-search", "functions", "function-call",
         "message-function-call", "strict-tool", "obfuscation"],
)
async def test_a_request_field_is_honoured_or_refused_by_name_never_ignored(tmp_path, extra, param, fragment):
    async with serve(tmp_path, ScriptedBackend(["ok"])) as (client, _):
        response = await client.post("/v1/chat/completions", json=chat_body("hi") | extra)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert error["code"] in ("unsupported_field", "unsupported_value")


async def test_an_unknown_feedback_field_is_refused_by_name(tmp_path):
    async with serve(tmp_path, ScriptedBackend(["ok"])) as (client, _):
        response = await client.post("/v1/feedback", json={"turn_id": "t", "score": 1, "comment": "nice"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "comment"


async def test_the_openai_client_hears_which_extra_field_was_refused(tmp_path):
    import openai

    async with serve(tmp_path, ScriptedBackend(["ok"])) as (http, _):
        client = openai.AsyncOpenAI(base_url="http://whet/v1", api_key="unused", http_client=http)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}],
                                                 extra_body={"foo": 1})  # fmt: skip
    assert refused.value.param == "foo" and "'foo' is not a field this server reads" in refused.value.message
    assert refused.value.code == "unsupported_field"


async def test_what_the_openai_client_sends_and_echoes_back_is_all_read(tmp_path):
    """Tools, streaming, the reply echoed back as the client library models it (refusal, name,
    tool_calls, tool_call_id), and every field the client sends that this server honours."""
    import openai

    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Porto"}}</tool_call>'
    weather = {"type": "function", "function": {"name": "get_weather", "description": "weather", "strict": False,
                                                "parameters": {"type": "object", "properties": {}}}}  # fmt: skip
    async with serve(tmp_path, ScriptedBackend([call, "Sunny.", "You're welcome."])) as (http, res):
        client = openai.AsyncOpenAI(base_url="http://whet/v1", api_key="unused", http_client=http)
        asked = [{"role": "system", "content": "Be brief.", "name": "setup"},
                 {"role": "user", "content": [{"type": "text", "text": "Weather in Porto?"}], "name": "ana"}]
        first = await client.chat.completions.create(
            model="scripted", messages=asked, tools=[weather], tool_choice="auto", parallel_tool_calls=True,
            temperature=0.5, top_p=0.9, seed=7, stop=["\n\n"], max_completion_tokens=64, n=1, user="ana",
            store=True, logprobs=False, frequency_penalty=0, presence_penalty=0,
        )  # fmt: skip
        message = first.choices[0].message
        assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
        # the message as the library models it, every attribute included (refusal=None, ...)
        echoed = {k: v for k, v in message.model_dump().items() if k in ("role", "content", "refusal", "tool_calls")}
        follow = [*asked, echoed, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}]
        stream = await client.chat.completions.create(model="scripted", messages=follow, tools=[weather], stream=True,
                                                      stream_options={"include_usage": True})  # fmt: skip
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Sunny."
        assert chunks[-1].usage is not None
        refused = [*follow, {"role": "assistant", "content": None, "refusal": "I can't say."},
                   {"role": "user", "content": "thanks"}]  # fmt: skip
        last = await client.chat.completions.create(model="scripted", messages=refused)
        assert last.choices[0].message.content == "You're welcome."
        turn = await res.store.get_turn(last.id)
        assert any(m["content"] == "I can't say." for m in turn.prompt_messages if m["role"] == "assistant")


async def test_the_schema_says_which_fields_and_values_are_read(tmp_path):
    async with serve(tmp_path, ScriptedBackend(["ok"]), server={"max_messages": 7, "max_tokens_cap": 99}) as (client, _):
        schema = (await client.get("/openapi.json")).json()
    parts = schema["components"]["schemas"]
    chat = parts["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False and parts["ChatMessage"]["additionalProperties"] is False
    assert parts["FeedbackRequest"]["additionalProperties"] is False
    assert "metadata" not in chat["properties"] and chat["properties"]["messages"]["maxItems"] == 7
    assert chat["properties"]["max_tokens"]["anyOf"][0]["maximum"] == 99
    assert {"const": "required"} not in chat["properties"]["tool_choice"]["anyOf"]
    routes = schema["paths"]
    assert {"404", "500"} <= set(routes["/v1/turns/{turn_id}"]["get"]["responses"])
    assert "text/plain" in routes["/metrics"]["get"]["responses"]["200"]["content"]
    assert "text/event-stream" in routes["/v1/chat/completions"]["post"]["responses"]["200"]["content"]


@pytest.mark.parametrize(
    ("send", "param"),
    [
        (lambda c: c.post("/v1/chat/completions", json=chat_body("hi", temperature="0.5")), "temperature"),
        (lambda c: c.post("/v1/chat/completions", json=chat_body("hi", stream="true")), "stream"),
        (lambda c: c.post("/v1/chat/completions", json=chat_body("hi", max_tokens=2.5)), "max_tokens"),
        (lambda c: c.post("/v1/feedback", json={"turn_id": "t", "score": "1"}), "score"),
        (lambda c: c.delete("/v1/lessons/66800622778585354076160"), "lesson_id"),
    ],
    ids=["number-as-string", "bool-as-string", "fractional-int", "score-as-string", "lesson-id-past-int64"],
)
async def test_a_value_is_read_in_its_json_type_only(tmp_path, send, param):
    async with serve(tmp_path, ScriptedBackend(["ok"])) as (client, _):
        response = await send(client)
        whole = await client.post("/v1/chat/completions", json=chat_body("hi", max_tokens=5.0))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param)
    assert whole.status_code == 200, whole.text  # 5.0 is JSON's integer 5


async def test_a_405_names_every_method_the_path_allows(tmp_path):
    async with serve(tmp_path, ScriptedBackend(["ok"])) as (client, _):
        response = await client.request("PUT", "/v1/approvals/some-id")
    assert response.status_code == 405
    assert response.headers["allow"] == "GET, POST" and response.json()["error"]["message"]
