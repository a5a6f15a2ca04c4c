"""The page at / and the JSON routes it reads, in-process (ASGI transport, scripted model)."""

from __future__ import annotations

import pytest
from test_api import CALC_CALL, chat_body, serve

from whet.memory.tables import Adapter, Judgment
from whet.runtime.scripted import ScriptedBackend

pytestmark = pytest.mark.anyio

ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}
KEYS = {"server": {"api_keys": {"sk-alice": "alice", "sk-bob": "bob"}}}


async def test_the_page_is_served_without_a_key_and_its_data_only_with_one(tmp_path):
    async with serve(tmp_path, ScriptedBackend([]), **KEYS) as (http, _):
        page = await http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script src="/web/app.js">' in page.text
        for asset, kind in (("/web/app.js", "javascript"), ("/web/style.css", "text/css")):
            response = await http.get(asset)
            assert response.status_code == 200 and kind in response.headers["content-type"]
        for route in ("/v1/sessions", "/v1/learning", "/v1/lessons"):
            assert (await http.get(route)).status_code == 401
            assert (await http.get(route, headers=ALICE)).status_code == 200


async def test_a_session_is_listed_and_resumes_with_its_tool_steps_and_answers(tmp_path):
    backend = ScriptedBackend([CALC_CALL, "It is 391.", "You're welcome."])
    async with serve(tmp_path, backend, **KEYS) as (http, _):
        first = await http.post("/v1/chat/completions", json=chat_body("what is 17*23?"), headers=ALICE)
        session = first.headers["x-whet-session"]
        await http.post("/v1/feedback", json={"turn_id": first.json()["id"], "thumbs": "up"}, headers=ALICE)
        again = {**ALICE, "X-Whet-Session": session}
        await http.post("/v1/chat/completions", json=chat_body("what is 17*23?", "It is 391.", "thanks"), headers=again)
        listed = (await http.get("/v1/sessions", headers=ALICE)).json()
        assert [(s["id"], s["title"], s["turns"]) for s in listed] == [(session, "what is 17*23?", 3)]
        detail = (await http.get(f"/v1/sessions/{session}", headers=ALICE)).json()
        one, two = detail["exchanges"]
        assert one["user"] == "what is 17*23?" and one["answer"] == "It is 391."
        assert one["turn_id"] == first.json()["id"] and one["feedback"] == [{"score": 1.0, "text": None}]
        assert [(t["name"], t["is_error"]) for t in one["tools"]] == [("calculate", False)]
        assert "391" in one["tools"][0]["result"] and "17*23" in one["tools"][0]["arguments"]
        assert two["user"] == "thanks" and two["answer"] == "You're welcome." and two["tools"] == []
        assert detail["messages"] == [
            {"role": "user", "content": "what is 17*23?"}, {"role": "assistant", "content": "It is 391."},
            {"role": "user", "content": "thanks"}, {"role": "assistant", "content": "You're welcome."},
        ]
        # bob sees none of it
        assert (await http.get("/v1/sessions", headers=BOB)).json() == []
        assert (await http.get(f"/v1/sessions/{session}", headers=BOB)).status_code == 404


async def test_the_learning_view_shows_adapters_with_gate_numbers_verdicts_and_lessons(tmp_path):
    # no learner here: the rows below are the learner's, written by hand
    async with serve(tmp_path, ScriptedBackend(["It is 10:00."]), learner={"enabled": False}, **KEYS) as (http, res):
        reply = (await http.post("/v1/chat/completions", json=chat_body("time at home?"), headers=ALICE)).json()
        await http.post("/v1/feedback", json={"turn_id": reply["id"], "thumbs": "down", "text": "I meant Lisbon"},
                        headers=ALICE)  # fmt: skip
        store = res.store
        turn = await store.get_turn(reply["id"])
        await store.save_judgment(Judgment(turn_id=turn.id, user_id="alice", request_id=turn.request_id, score=-1,
                                           hint="The user meant Lisbon.", reason="explicit feedback -1.00", judge="rules"))  # fmt: skip
        gate = {"accepted": False, "reason": "held-out preference margin -0.2000 nats/token is below -0.01",
                "preference_margin": -0.2, "regression_drift": 0.01, "holdout_turns": 4}
        for version in ("global-0001", "global-0002", "global-0003"):
            await store.add_adapter(Adapter(id=version, scope="global", path=f"/x/{version}", parent=None))
        await store.promote_adapter("global-0001")
        await store.update_adapter("global-0002", status="rejected", metrics={"gate": gate})
        await store.update_adapter("global-0003", parent="global-0001")
        await store.promote_adapter("global-0003")
        await store.rollback_adapter("global", None, "rolling score fell below its parent's")
        await store.add_lesson("alice", "When alice asks the time at home: The user meant Lisbon.")
        await store.add_lesson("bob", "bob's own lesson")
        view = (await http.get("/v1/learning", headers=ALICE)).json()
    assert view["live"] == {"global": "global-0001", "user": None}
    statuses = {a["id"]: a["status"] for a in view["adapters"]}
    assert statuses == {"global-0001": "live", "global-0002": "rejected", "global-0003": "rolled back"}
    rejected = next(a for a in view["adapters"] if a["id"] == "global-0002")
    assert rejected["gate"]["preference_margin"] == -0.2 and "below" in rejected["gate"]["reason"]
    judged = view["judgments"][0]
    assert (judged["score"], judged["hint"], judged["action"]) == (-1, "The user meant Lisbon.", "It is 10:00.")
    assert judged["next_state"] == "👎 I meant Lisbon"
    assert [lesson["text"] for lesson in view["lessons"]] == ["When alice asks the time at home: The user meant Lisbon."]


async def test_deleting_a_lesson_removes_it_from_the_store_and_the_index(tmp_path):
    async with serve(tmp_path, ScriptedBackend([]), **KEYS) as (http, res):
        mine = await res.store.add_lesson("alice", "alice's home is Lisbon")
        theirs = await res.store.add_lesson("bob", "bob's home is Tokyo")
        for lesson in (mine, theirs):
            res.index.add(lesson.id, lesson.user_id, lesson.text)
        assert (await http.delete(f"/v1/lessons/{theirs.id}", headers=ALICE)).status_code == 404
        assert (await http.delete(f"/v1/lessons/{mine.id}", headers=ALICE)).status_code == 204
        assert await res.store.get_lesson(mine.id) is None
        assert res.index.search("alice", "home", 4) == []
        assert [hit.text for hit in res.index.search("bob", "home", 4)] == ["bob's home is Tokyo"]
        assert (await http.get("/v1/lessons", headers=ALICE)).json() == []
        assert (await http.delete(f"/v1/lessons/{mine.id}", headers=ALICE)).status_code == 404


async def test_a_user_asks_for_a_training_step_now_and_is_told_why_when_none_can_run(tmp_path):
    async with serve(mkdir(tmp_path / "off"), ScriptedBackend([]), learner={"enabled": False}, **KEYS) as (http, _):
        refused = await http.post("/v1/learning/train", headers=ALICE)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "learner_off"
        assert "learner.enabled" in refused.json()["error"]["message"]
    async with serve(mkdir(tmp_path / "lessons"), ScriptedBackend([]), learner={"train": False}, **KEYS) as (http, _):
        refused = await http.post("/v1/learning/train", headers=ALICE)
        assert refused.status_code == 409 and "learner.train is false" in refused.json()["error"]["message"]
    shared = {"scope": "global", "trusted_users": ["alice"]}
    async with serve(mkdir(tmp_path / "shared"), ScriptedBackend([]), learner=shared, **KEYS) as (http, res):
        assert (await http.post("/v1/learning/train")).status_code == 401
        refused = await http.post("/v1/learning/train", headers=BOB)
        assert refused.status_code == 403 and "learner.trusted_users" in refused.json()["error"]["message"]
        assert res.learner._asked == set(), "an untrusted user's ask is not taken"
        asked = await http.post("/v1/learning/train", headers=ALICE)
        assert asked.status_code == 202 and asked.json() == {"lineage": "global", "waiting": 0}
    async with serve(mkdir(tmp_path / "own"), ScriptedBackend([]), **KEYS) as (http, res):
        asked = await http.post("/v1/learning/train", headers=BOB)
        assert asked.status_code == 202 and asked.json() == {"lineage": "user:bob", "waiting": 0}


def mkdir(path):
    path.mkdir()
    return path
