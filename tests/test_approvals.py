"""Human approval for consequential tools, end to end over the API (in-process, bundled notes server)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import update
from test_api import serve

from whet.config.settings import ConfigError, load_config
from whet.learner.judge import NextState, RulesJudge
from whet.memory.tables import Approval, utcnow
from whet.runtime.scripted import ScriptedBackend

pytestmark = pytest.mark.anyio

KEYS = {"sk-alice": "alice", "sk-bob": "bob", "sk-root": "root"}
ALICE, BOB, ROOT = ({"Authorization": f"Bearer {key}"} for key in KEYS)
DELETE_CALL = 'I will delete it. <tool_call>{"name": "delete_note", "arguments": {"note_id": 1}}</tool_call>'


def keyed(**extra):
    return {"server": {"api_keys": KEYS, "admin_users": ["root"]}, **extra}


async def alice_notes(res) -> list[str]:
    listed = await res.tools.call("list_notes", {}, user="alice")
    return [note["text"] for note in json.loads(listed.content)["notes"]]


async def held_request(client, res, **chat):
    """Alice has a note and asks to delete it: the response is the held step."""
    await res.tools.call("add_note", {"text": "buy milk"}, user="alice")
    body = {"model": "scripted", "messages": [{"role": "user", "content": "delete note 1"}], **chat}
    response = await client.post("/v1/chat/completions", json=body, headers=ALICE)
    assert response.status_code == 200, response.text
    return response


def pending_call(response) -> tuple[dict, dict]:
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    return call, json.loads(call["function"]["arguments"])


async def test_a_destructive_call_waits_for_its_owner_and_runs_once_approved(tmp_path):
    backend = ScriptedBackend([DELETE_CALL, "Deleted note 1."])
    async with serve(tmp_path, backend, **keyed()) as (client, res):
        held = await held_request(client, res)
        call, pending = pending_call(held)
        approval_id = call["id"]
        assert call["function"]["name"] == "whet_approval" and approval_id.startswith("appr_")
        assert pending["approval_id"] == approval_id and pending["status"] == "pending"
        assert pending["calls"] == [{"name": "delete_note", "arguments": {"note_id": 1}}]
        assert pending["decide"] == f"/v1/approvals/{approval_id}"
        assert held.json()["choices"][0]["message"]["content"] == "I will delete it."
        assert await alice_notes(res) == ["buy milk"]  # nothing ran
        assert len(backend.calls) == 1
        session = f"/v1/sessions/{held.headers['x-whet-session']}"
        [exchange] = (await client.get(session, headers=ALICE)).json()["exchanges"]
        assert exchange["approval"]["id"] == approval_id and exchange["tools"][0]["waiting"] is True

        listed = (await client.get("/v1/approvals", headers=ALICE)).json()
        assert [a["id"] for a in listed] == [approval_id] and listed[0]["calls"][0]["name"] == "delete_note"
        assert (await client.get("/v1/approvals", headers=BOB)).json() == []
        refused = await client.post(f"/v1/approvals/{approval_id}", json={"decision": "approve"}, headers=BOB)
        assert refused.status_code == 404 and "not found" in refused.json()["error"]["message"]
        assert (await client.get(f"/v1/approvals/{approval_id}", headers=ALICE)).json()["status"] == "pending"

        done = await client.post(f"/v1/approvals/{approval_id}", json={"decision": "approve"}, headers=ALICE)
        assert done.status_code == 200, done.text
        answer = done.json()
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["finish_reason"] == "stop"
        assert answer["choices"][0]["message"]["content"] == "I will delete it. Deleted note 1."
        assert done.headers["x-whet-session"] == held.headers["x-whet-session"]
        assert await alice_notes(res) == []  # the approved call ran
        [exchange] = (await client.get(session, headers=ALICE)).json()["exchanges"]
        assert exchange["approval"] is None and exchange["answer"] == "I will delete it.\n\nDeleted note 1."
        assert not exchange["tools"][0]["waiting"] and "buy milk" in exchange["tools"][0]["result"]
        tool_messages = [m for m in backend.calls[1].messages if m["role"] == "tool"]
        assert len(tool_messages) == 1 and "buy milk" in tool_messages[0]["content"]

        held_turn = await res.store.get_turn(held.json()["id"])
        assert held_turn.next_state_kind == "tool_result"
        assert held_turn.next_state["approval"]["decision"] == "approved"
        assert held_turn.next_state["approval"]["by"] == "alice"
        verdict = RulesJudge().decide(held_turn, NextState.of(held_turn), held_turn.prompt_messages)
        assert verdict.score == 1 and "approved" in verdict.reason
        final = await res.store.get_turn(answer["id"])
        assert final.request_id == held_turn.request_id and final.step == 1

        decided = (await client.get(f"/v1/approvals/{approval_id}", headers=ALICE)).json()
        assert decided["status"] == "approved" and decided["decided_by"] == "alice"
        again = await client.post(f"/v1/approvals/{approval_id}", json={"decision": "reject"}, headers=ALICE)
        assert again.status_code == 409 and "already approved" in again.json()["error"]["message"]
        assert (await client.get("/v1/approvals", headers=ALICE)).json() == []


async def test_a_rejected_call_never_runs_and_the_model_reads_the_rejection_in_a_stream(tmp_path):
    backend = ScriptedBackend([DELETE_CALL, "Alright, I kept the note."])
    async with serve(tmp_path, backend, **keyed()) as (client, res):
        held = await held_request(client, res)
        approval_id = pending_call(held)[0]["id"]
        decision = {"decision": "reject", "reason": "keep my notes", "stream": True}
        # an admin key may decide for anyone
        async with client.stream(
            "POST", f"/v1/approvals/{approval_id}", json=decision, headers=ROOT
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == "Alright, I kept the note."  # what the first stream said is not repeated
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and len({c["id"] for c in chunks}) == 1

        assert await alice_notes(res) == ["buy milk"]
        [rejection] = [m for m in backend.calls[1].messages if m["role"] == "tool"]
        assert rejection["content"] == "error: the user rejected this call: keep my notes; it did not run"
        held_turn = await res.store.get_turn(held.json()["id"])
        assert held_turn.next_state["approval"] == {
            "id": approval_id, "decision": "rejected", "by": "root", "reason": "keep my notes",
            "calls": ["delete_note"],
        }  # fmt: skip
        verdict = RulesJudge().decide(held_turn, NextState.of(held_turn), held_turn.prompt_messages)
        assert verdict.score == -1
        assert verdict.hint == 'The user rejected calling delete_note({"note_id": 1}): keep my notes'
        forgotten = (await client.delete("/v1/users/alice", headers=ROOT)).json()
        assert forgotten["store"]["approvals"] == 1 and await res.store.get_approval(approval_id) is None


async def test_a_message_sent_while_a_call_waits_leaves_the_decision_as_its_next_state(tmp_path):
    backend = ScriptedBackend([DELETE_CALL, "What else?", "Kept it."])
    async with serve(tmp_path, backend, **keyed()) as (client, res):
        held = await held_request(client, res)
        approval_id = pending_call(held)[0]["id"]
        session = {"X-Whet-Session": held.headers["x-whet-session"], **ALICE}
        later = {"model": "scripted", "messages": [{"role": "user", "content": "also, hello"}]}
        assert (await client.post("/v1/chat/completions", json=later, headers=session)).status_code == 200
        assert (
            await res.store.get_turn(held.json()["id"])
        ).closed_at is None  # still waiting for the decision
        await client.post(f"/v1/approvals/{approval_id}", json={"decision": "reject"}, headers=ALICE)
        held_turn = await res.store.get_turn(held.json()["id"])
        assert (
            held_turn.next_state_kind == "tool_result"
            and held_turn.next_state["approval"]["decision"] == "rejected"
        )


async def test_an_undecided_approval_expires_and_its_call_never_runs(tmp_path):
    backend = ScriptedBackend([DELETE_CALL])
    async with serve(tmp_path, backend, **keyed(mcp={"approval_timeout": 30})) as (client, res):
        held = await held_request(client, res)
        approval_id = pending_call(held)[0]["id"]
        row = await res.store.get_approval(approval_id)
        assert row.expires_at - row.created_at == timedelta(seconds=30)
        # the half minute passes (moved in the store rather than waited out)
        past = (
            update(Approval)
            .where(Approval.id == approval_id)
            .values(expires_at=utcnow() - timedelta(seconds=1))
        )
        await res.store._run(lambda db: db.execute(past))

        assert (await client.get("/v1/approvals", headers=ALICE)).json() == []
        expired = (await client.get("/v1/approvals?status=expired", headers=ALICE)).json()
        assert [a["id"] for a in expired] == [approval_id] and expired[0]["status"] == "expired"
        late = await client.post(f"/v1/approvals/{approval_id}", json={"decision": "approve"}, headers=ALICE)
        assert late.status_code == 410
        assert (
            "expired" in late.json()["error"]["message"] and "did not run" in late.json()["error"]["message"]
        )
        assert await alice_notes(res) == ["buy milk"]
        assert len(backend.calls) == 1
        held_turn = await res.store.get_turn(held.json()["id"])
        assert held_turn.next_state["approval"]["decision"] == "expired"
        assert "did not run" in held_turn.next_state["results"][0]["content"]
        verdict = RulesJudge().decide(held_turn, NextState.of(held_turn), held_turn.prompt_messages)
        assert verdict.score == 0


async def test_config_decides_which_tools_wait_and_bad_decisions_get_a_400(tmp_path):
    calc = '<tool_call>{"name": "calculate", "arguments": {"expression": "2+2"}}</tool_call>'
    backend = ScriptedBackend([calc, "As you wish.", DELETE_CALL, "Deleted."])
    overrides = keyed(mcp={"approval_required": ["calc.*"], "approve_destructive": False})
    async with serve(tmp_path, backend, **overrides) as (client, res):
        body = {"model": "scripted", "messages": [{"role": "user", "content": "2+2?"}]}
        held = await client.post("/v1/chat/completions", json=body, headers=ALICE)
        call, pending = pending_call(held)
        assert pending["calls"][0]["name"] == "calculate"
        for bad, fragment in [({"decision": "maybe"}, "decision"), ({"decision": "approve", "when": 1}, "when"),
                              ({}, "decision")]:  # fmt: skip
            answer = await client.post(f"/v1/approvals/{call['id']}", json=bad, headers=ALICE)
            assert answer.status_code == 400 and fragment in answer.json()["error"]["message"]
        missing = await client.post("/v1/approvals/appr_nope", json={"decision": "approve"}, headers=ALICE)
        assert missing.status_code == 404
        # approve_destructive: false, and delete_note is not listed: it runs at once
        rejected = await client.post(
            f"/v1/approvals/{call['id']}", json={"decision": "reject"}, headers=ALICE
        )
        assert rejected.json()["choices"][0]["message"]["content"] == "As you wish."
        ran = await held_request(client, res)
        assert ran.json()["choices"][0]["message"]["content"] == "I will delete it. Deleted."
        assert await alice_notes(res) == []
    with pytest.raises(ConfigError, match="server.tool"):
        load_config(overrides={"mcp": {"approval_required": ["delete_note"]}})
