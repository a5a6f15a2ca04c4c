"""Bad input through the API: NUL bytes on both store backends, and fields refused by name."""

from __future__ import annotations

import pytest

from tests.test_api import chat_body, serve
from whet.runtime.scripted import ScriptedBackend

pytestmark = pytest.mark.anyio


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
