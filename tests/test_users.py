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
            if response.json()["choices"][0]["finish_reason"] == "tool_calls":  # delete_note waits for approval
                [held] = response.json()["choices"][0]["message"]["tool_calls"]
                assert held["function"]["name"] == "whet_approval"
                decided = await client.post(f"/v1/approvals/{held['id']}", json={"decision": "approve"}, headers=who)
                assert decided.status_code == 200, decided.text
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


ADMIN_KEYS = {**KEYS, "sk-ops": "ops"}
OPS = {"Authorization": "Bearer sk-ops"}


async def seed_user(client, res, tmp_path, who: dict, user: str, note: str) -> dict:
    """One chat that saves a note, feedback on it, a verdict, a lesson, and a per-user adapter folder."""
    from whet.memory import Adapter, Judgment

    response = await client.post("/v1/chat/completions", json=chat_body(f"remember {note}"), headers=who)
    assert response.status_code == 200, response.text
    turn_id, session_id = response.json()["id"], response.headers["x-whet-session"]
    assert (await client.post("/v1/feedback", json={"turn_id": turn_id, "score": 1}, headers=who)).status_code == 201
    turn = await res.store.get_turn(turn_id)
    await res.store.save_judgment(Judgment(turn_id=turn_id, user_id=user, request_id=turn.request_id, score=1))
    lesson = await res.store.add_lesson(user, f"{user} likes {note}")
    res.index.add(lesson.id, user, lesson.text)
    folder = tmp_path / "adapters" / "user" / user / f"user-{user}-0001"
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    await res.store.add_adapter(Adapter(id=f"user-{user}-0001", scope="user", user_id=user, path=str(folder),
                                        status="live"))  # fmt: skip
    return {"turn": turn_id, "session": session_id, "folder": folder}


async def notes_of(res, user: str) -> list[str]:
    listed = await res.tools.call("list_notes", {}, user=user)
    return [note["text"] for note in json.loads(listed.content)["notes"]]


async def test_forgetting_a_user_leaves_nothing_of_theirs_in_store_index_notes_or_disk(tmp_path):
    backend = ScriptedBackend([tool_call("add_note", text="alice PIN 4711"), "saved",
                               tool_call("add_note", text="bob likes tea"), "saved"])  # fmt: skip
    config = {"server": {"api_keys": ADMIN_KEYS, "admin_users": ["ops"]}, "learner": {"enabled": False}}
    async with serve(tmp_path, backend, **config) as (client, res):
        alice = await seed_user(client, res, tmp_path, ALICE, "alice", "PIN")
        bob = await seed_user(client, res, tmp_path, BOB, "bob", "tea")
        # bob can neither forget alice nor see her turns
        refused = await client.delete("/v1/users/alice", headers=BOB)
        assert refused.status_code == 403, refused.text
        assert {t["user_id"] for t in (await client.get("/v1/turns?user=alice", headers=BOB)).json()} == {"bob"}
        # the operator sees everyone's turns
        assert {t["user_id"] for t in (await client.get("/v1/turns", headers=OPS)).json()} == {"alice", "bob"}

        forgotten = await client.delete("/v1/users/alice", headers=ALICE)
        assert forgotten.status_code == 200, forgotten.text
        report = forgotten.json()
        assert report["complete"] and report["index"] == 1 and "notes" in report["tools"]
        assert report["store"]["turns"] == 2 and report["store"]["adapters"] == 1

        store = res.store
        assert await store.get_turn(alice["turn"]) is None and await store.get_session(alice["session"]) is None
        assert await store.list_turns(user_id="alice") == [] and await store.list_feedback(alice["turn"]) == []
        assert await store.get_judgment(alice["turn"]) is None and await store.list_lessons("alice") == []
        assert await store.list_adapters(user_id="alice") == []
        assert res.index.search("alice", "alice likes PIN", 5) == []
        assert await notes_of(res, "alice") == []
        assert not (tmp_path / "adapters" / "user" / "alice").exists()
        # bob keeps everything
        assert await store.get_turn(bob["turn"]) is not None and await store.list_lessons("bob")
        assert await notes_of(res, "bob") == ["bob likes tea"] and bob["folder"].is_dir()
        assert [hit.text for hit in res.index.search("bob", "bob likes tea", 5)] == ["bob likes tea"]
        # an admin key forgets others
        assert (await client.delete("/v1/users/bob", headers=OPS)).status_code == 200
        assert await store.list_turns(user_id="bob") == [] and not bob["folder"].exists()


async def test_a_replica_drops_a_forgotten_users_lessons_when_the_event_arrives(tmp_path):
    import anyio

    from whet.memory.bus import USER_FORGOTTEN

    async with serve(tmp_path, ScriptedBackend(["hi"]), learner={"enabled": False}) as (_, res):
        lesson = await res.store.add_lesson("carol", "carol lives in Lisbon")
        res.index.add(lesson.id, "carol", lesson.text)
        assert res.index.search("carol", "Lisbon", 3)
        await res.bus.publish(USER_FORGOTTEN, {"user_id": "carol"})  # e.g. from `whet forget` on another machine
        with anyio.fail_after(10):
            await res.follower.wait_until(lambda: not res.index.search("carol", "Lisbon", 3))


async def test_a_lesson_deleted_through_one_replica_leaves_every_replicas_index(tmp_path):
    import anyio

    from whet.memory.bus import LESSON_DELETED

    async with serve(tmp_path, ScriptedBackend(["hi"]), learner={"enabled": False}) as (client, res):
        lessons = []
        for text in ("dana lives in Oslo", "dana walks to Oslo harbour", "dana flies from Oslo"):
            lesson = await res.store.add_lesson("dana", text)
            res.index.add(lesson.id, "dana", lesson.text)
            lessons.append(lesson.id)

        def offered() -> set[int]:
            return {hit.lesson_id for hit in res.index.search("dana", "Oslo", 5)}

        # deleted here: gone at once, and announced for the other replicas
        async with res.bus.subscribe(LESSON_DELETED) as events:
            response = await client.delete(f"/v1/lessons/{lessons[0]}", params={"user": "dana"})
            assert response.status_code == 204
            with anyio.fail_after(10):
                event = await anext(aiter(events))
        assert event.data == {"lesson_id": lessons[0]} and lessons[0] not in offered()
        # deleted through another replica: the event takes it out of this one's index
        await res.store.delete_lesson(lessons[1])
        await res.bus.publish(LESSON_DELETED, {"lesson_id": lessons[1]})
        with anyio.fail_after(10):
            await res.follower.wait_until(lambda: lessons[1] not in offered())
        # the event was missed (a replica away from the bus): the store poll takes it out
        await res.store.delete_lesson(lessons[2])
        assert lessons[2] in offered()
        await res.follower.catch_up()
        assert offered() == set()


async def test_user_b_cannot_reach_user_a_through_turns_sessions_lessons_or_adapters(tmp_path):
    backend = ScriptedBackend(lambda messages, tools: "ok")
    config = {"server": {"api_keys": KEYS}, "learner": {"enabled": False, "scope": "user"}}
    async with serve(tmp_path, backend, **config) as (client, res):
        first = await client.post("/v1/chat/completions", json=chat_body("my secret is 4711"), headers=ALICE)
        alice_turn, alice_session = first.json()["id"], first.headers["x-whet-session"]
        lesson = await res.store.add_lesson("alice", "alice's bank PIN is 4711")
        res.index.add(lesson.id, "alice", lesson.text)
        await res.adapters.activate("user-alice-0001", str(tmp_path / "adapter"), "alice")

        # listing and reading
        listed = await client.get("/v1/turns", params={"user": "alice", "session": alice_session}, headers=BOB)
        assert listed.status_code == 200 and listed.json() == []
        assert (await client.get(f"/v1/turns/{alice_turn}", headers=BOB)).status_code == 404
        assert (await client.post("/v1/feedback", json={"turn_id": alice_turn, "score": -1},
                                  headers=BOB)).status_code == 404  # fmt: skip
        # joining her session, by name or by replaying her conversation
        named = await client.post("/v1/chat/completions", json=chat_body("hi"),
                                  headers={**BOB, "X-Whet-Session": alice_session})  # fmt: skip
        assert named.status_code == 403
        replay = await client.post("/v1/chat/completions", json=chat_body("my secret is 4711", "ok", "and?"),
                                   headers=BOB)  # fmt: skip
        assert replay.status_code == 200 and replay.headers["x-whet-session"] != alice_session
        # her lessons and her adapter, even when bob claims to be her in the `user` field
        asked = await client.post("/v1/chat/completions", json=chat_body("what is my PIN?", user="alice"),
                                  headers=BOB)  # fmt: skip
        assert asked.status_code == 200
        assert "4711" not in backend.calls[-1].messages[0]["content"] and backend.calls[-1].adapter is None
        assert (await client.get("/v1/models", headers=BOB)).json()["data"][0]["adapter"] is None
        assert (await client.get("/v1/models", headers=ALICE)).json()["data"][0]["adapter"] == "user-alice-0001"
        # nothing of hers changed
        assert (await res.store.get_turn(alice_turn)).closed_at is None
        assert [t.user_id for t in await res.store.list_turns(session_id=alice_session)] == ["alice"]
