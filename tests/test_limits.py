"""Limits on what one request may ask for and how much one client may ask at once (issue #12)."""

from __future__ import annotations

import threading

import anyio
import httpx
import pytest

from tests.test_api import chat_body, serve
from whet.config.settings import ServerConfig
from whet.runtime.limits import Admission
from whet.runtime.scripted import ScriptedBackend

pytestmark = pytest.mark.anyio

KEYS = {"sk-alice": "alice", "sk-bob": "bob"}
ALICE, BOB = ({"Authorization": f"Bearer {key}"} for key in KEYS)


def ok(messages, tools) -> str:
    return "ok"


class GatedBackend(ScriptedBackend):
    """Answers "ok" once ``gate`` is set; ``arrived`` is set when ``expected`` requests are waiting."""

    def __init__(self, expected: int) -> None:
        super().__init__(ok)
        self.expected, self.waiting = expected, 0
        self.gate, self.arrived = anyio.Event(), anyio.Event()

    async def _hold(self) -> None:
        self.waiting += 1
        if self.waiting == self.expected:
            self.arrived.set()
        await self.gate.wait()

    async def generate(self, *args, **kwargs):
        await self._hold()
        return await super().generate(*args, **kwargs)

    async def stream(self, *args, **kwargs):
        await self._hold()
        async for item in super().stream(*args, **kwargs):
            yield item


def refused(response: httpx.Response, status: int, setting: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert setting in error["message"], error
    return error


async def test_more_messages_than_server_max_messages_is_a_400_naming_the_setting(tmp_path):
    async with serve(tmp_path, ScriptedBackend(ok), server={"max_messages": 4}) as (client, _):
        error = refused(await client.post("/v1/chat/completions", json=chat_body(*"uauau")), 400, "server.max_messages")
        assert error["param"] == "messages" and error["code"] == "too_many_messages" and "(4," in error["message"]
        assert (await client.post("/v1/chat/completions", json=chat_body(*"uau"))).status_code == 200


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_max_tokens_above_server_max_tokens_cap_is_a_400_naming_the_field_and_the_cap(tmp_path, field):
    async with serve(tmp_path, ScriptedBackend(ok), server={"max_tokens_cap": 100}) as (client, _):
        over = await client.post("/v1/chat/completions", json=chat_body("hi", **{field: 101}))
        error = refused(over, 400, "server.max_tokens_cap")
        assert error["param"] == field and "101" in error["message"] and "100" in error["message"]
        assert (await client.post("/v1/chat/completions", json=chat_body("hi", **{field: 100}))).status_code == 200


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from whet.learner.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


async def test_a_prompt_over_the_models_context_is_a_400_naming_the_limit_plain_and_in_band_in_a_stream(
    tmp_path, tiny_model_dir
):
    from whet.runtime.hf import TransformersBackend

    backend = TransformersBackend(str(tiny_model_dir), model_name="tiny", workers=1, max_context_tokens=2048)
    long = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 3000}], "tool_choice": "none"}
    async with serve(tmp_path, backend, model={"id": "tiny", "max_new_tokens": 4}) as (client, _):
        error = refused(await client.post("/v1/chat/completions", json=long), 400, "model.max_context_tokens")
        assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
        assert "context is 2048" in error["message"]
        stream = await client.post("/v1/chat/completions", json={**long, "stream": True})
        assert '"code": "context_length_exceeded"' in stream.text and "context is 2048" in stream.text
        short = {**long, "messages": [{"role": "user", "content": "hello"}]}  # no tools shown: a short prompt
        fine = await client.post("/v1/chat/completions", json=short)
        assert fine.status_code == 200, fine.text


@pytest.mark.parametrize("setting", [40_000, 2048])
def test_the_context_error_advises_raising_the_setting_only_when_the_setting_is_the_limit(tiny_model_dir, setting):
    from whet.runtime.hf import TransformersBackend
    from whet.runtime.policy import PromptTooLong, SamplingParams

    # the tiny model has 32768 positions: a setting above them leaves the model's own limit
    backend = TransformersBackend(str(tiny_model_dir), model_name="tiny", workers=1, max_context_tokens=setting)
    with pytest.raises(PromptTooLong) as raised:
        backend._generate_sync([{"role": "user", "content": "word " * 34_000}], None, SamplingParams(), None,
                               lambda _: None, threading.Event())  # fmt: skip
    if setting > 32768:
        assert "model.max_context_tokens" not in str(raised.value) and "32768 positions is this model's own limit" in str(raised.value)
    else:
        assert "raise model.max_context_tokens" in str(raised.value)


async def test_more_requests_in_flight_for_one_key_than_max_concurrent_per_key_is_a_429_others_go_on(tmp_path):
    backend = GatedBackend(expected=3)  # two of alice's (one a stream) and one of bob's
    config = {"api_keys": KEYS, "max_concurrent_per_key": 2}
    async with serve(tmp_path, backend, server=config) as (client, _):
        answers: list[int] = []

        async def chat(headers: dict, **extra) -> None:
            answers.append((await client.post("/v1/chat/completions", json=chat_body("hi", **extra),
                                              headers=headers)).status_code)  # fmt: skip

        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                group.start_soon(chat, ALICE)
                group.start_soon(lambda: chat(ALICE, stream=True))
                group.start_soon(chat, BOB)
                await backend.arrived.wait()
                third = await client.post("/v1/chat/completions", json=chat_body("hi"), headers=ALICE)
                error = refused(third, 429, "server.max_concurrent_per_key")
                assert error["code"] == "too_many_concurrent_requests" and third.headers["retry-after"] == "1"
                backend.gate.set()
            assert answers == [200, 200, 200]
            again = await client.post("/v1/chat/completions", json=chat_body("hi"), headers=ALICE)
            assert again.status_code == 200, again.text  # the slots were given back


async def test_with_keys_off_every_request_counts_as_one_client_whatever_its_user_field(tmp_path):
    backend = GatedBackend(expected=1)
    async with serve(tmp_path, backend, server={"max_concurrent_per_key": 1}) as (client, _):
        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                group.start_soon(lambda: client.post("/v1/chat/completions", json=chat_body("hi", user="alice")))
                await backend.arrived.wait()
                other = await client.post("/v1/chat/completions", json=chat_body("hi", user="mallory"))
                refused(other, 429, "server.max_concurrent_per_key")
                backend.gate.set()


async def test_over_rate_limit_per_minute_a_key_gets_429_with_retry_after_in_whole_seconds(tmp_path):
    config = {"api_keys": KEYS, "rate_limit_per_minute": 2}
    async with serve(tmp_path, ScriptedBackend(ok), server=config) as (client, _):
        for _ in range(2):
            assert (await client.post("/v1/chat/completions", json=chat_body("hi"), headers=ALICE)).status_code == 200
        third = await client.post("/v1/chat/completions", json=chat_body("hi"), headers=ALICE)
        error = refused(third, 429, "server.rate_limit_per_minute")
        wait = int(third.headers["retry-after"])  # a token every 30 s
        assert 25 <= wait <= 30 and f"retry in {wait} s" in error["message"] and error["code"] == "rate_limit_exceeded"
        assert (await client.post("/v1/chat/completions", json=chat_body("hi"), headers=BOB)).status_code == 200
        no_key = await client.post("/v1/chat/completions", json=chat_body("hi"))
        assert no_key.status_code == 401  # the key check comes first and costs no token


def test_the_rate_bucket_refills_with_time_and_a_refused_request_takes_nothing():
    now = [0.0]
    admission = Admission(ServerConfig(rate_limit_per_minute=60, max_concurrent_per_key=0), clock=lambda: now[0])
    assert [admission.enter("alice") for _ in range(60)] == [None] * 60
    assert admission.enter("alice").retry_after == 1
    now[0] = 0.5
    assert admission.enter("alice") is not None  # half a token came back: still refused
    now[0] = 1.0
    assert admission.enter("alice") is None and admission.enter("alice") is not None
    assert admission.enter("bob") is None


async def test_the_openapi_schema_declares_429_with_retry_after_for_the_generating_routes(tmp_path):
    async with serve(tmp_path, ScriptedBackend(ok)) as (client, _):
        paths = (await client.get("/openapi.json")).json()["paths"]
        for path in ("/v1/chat/completions", "/v1/approvals/{approval_id}"):
            assert "Retry-After" in paths[path]["post"]["responses"]["429"]["headers"]
        assert "429" not in paths["/v1/turns"]["get"]["responses"]
