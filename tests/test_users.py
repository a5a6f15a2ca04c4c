"""Users kept apart: what one user's key reaches of another user's data (nothing), through the real API."""

from __future__ import annotations

import json

import pytest

from tests.test_api import chat_body, serve
from whet.runtime.scripted import ScriptedBackend

pytestmark = pytest.mark.anyio

KEYS = {"sk-alice": "alice", "sk-bob": "bob"}
ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}


def tool_call(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def tool_outputs(call) -> str:
    return " ".join(m["content"] for m in call.messages if m["role"] == "tool")


async def test_bob_never_sees_alices_notes_through_the_agent_and_tool_pool(tmp_path):
    backend = ScriptedBackend([
        tool_call("add_note", text="bank PIN 4711"), "saved",
        tool_call("list_notes"), "here they are",
        tool_call("search_notes", query="PIN"), "found",
        tool_call("delete_note", note_id=1), "deleted?",
        tool_call("list_notes"), "still there",
    ])
    async with serve(tmp_path, backend, server={"api_keys": KEYS}) as (client, _):
        for text, who in [("remember my PIN", ALICE), ("list my notes", BOB), ("find PIN", BOB),
                          ("delete note 1", BOB), ("list my notes", ALICE)]:
            response = await client.post("/v1/chat/completions", json=chat_body(text), headers=who)
            assert response.status_code == 200, response.text
    assert "4711" in tool_outputs(backend.calls[1])  # alice's add answered with her note
    assert "4711" not in tool_outputs(backend.calls[3])  # bob's list
    assert "4711" not in tool_outputs(backend.calls[5])  # bob's search
    assert "no note or todo with id 1" in tool_outputs(backend.calls[7])  # bob cannot delete it either
    assert "4711" in tool_outputs(backend.calls[9])  # and it is still alice's


async def test_the_forget_tool_is_never_offered_to_the_model(tmp_path):
    backend = ScriptedBackend(["hi"])
    async with serve(tmp_path, backend) as (client, _):
        assert "whet_forget_user" not in {t["name"] for t in (await client.get("/v1/tools")).json()}
        await client.post("/v1/chat/completions", json=chat_body("hello"))
    assert "whet_forget_user" not in {t["function"]["name"] for t in backend.calls[0].tools}
