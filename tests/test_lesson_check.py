"""The lesson check: a lesson that breaks a pinned turn it would be shown with is added narrowed (shown
only to requests closer to it than that turn), or not at all."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from whet.config.settings import AgentConfig, LearnerConfig
from whet.learner.gate import PinnedAction, PinnedTurn, load_pinned_turns
from whet.learner.judge import RulesJudge
from whet.learner.learner import Learner, regression_path
from whet.learner.lesson_check import LessonCheck
from whet.learner.prompt import last_user_text
from whet.learner.registry import AdapterRegistry
from whet.memory.bus import MemoryBus
from whet.memory.experience import Experience
from whet.memory.index import HashingEmbedder, LessonIndex, lesson_key
from whet.memory.store import Store, open_store
from whet.memory.tables import TurnCreate

SYSTEM = {"role": "system", "content": "You are whet."}
NOTE_SUM = 'When asked "What\'s 37 plus 14?": calling add_note({"text": "37 + 14"}) was right.'
NOTE_SUM_LISTED = 'When asked "What\'s 37 plus 14?": calling add_note({"list_name": "maths", "text": "37 + 14"}) was right.'
TIME_HOME = 'When asked "What time is it at home?": calling now({"timezone": "Lisbon"}) was right.'


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def pinned(request: str, response: str) -> PinnedTurn:
    record = {"messages": [SYSTEM, {"role": "user", "content": request}], "response": response}
    return PinnedTurn(record["messages"], None, response, PinnedAction.of(record))


PINNED = [pinned("What's 37 plus 15?", call("calculate", expression="37 + 15")),
          pinned("What time is it in Moscow?", call("now", timezone="Moscow")),
          pinned("Hello!", "Hello! How can I help?")]  # fmt: skip
PROBES = [pinned("What's 12 plus 90?", call("calculate", expression="12 + 90")),
          pinned("What's 37 plus 16?", call("calculate", expression="37 + 16")),
          pinned("Good morning!", "Good morning! How can I help?")]  # fmt: skip


class Model:
    """A served model that copies the first call a lesson in its system prompt spells, into any
    request (what a lesson that says where one user's things go does to a request that names its own),
    and otherwise answers each pinned request as pinned; ``asked`` keeps what it was asked."""

    def __init__(self, copies: bool = True) -> None:
        self.copies = copies
        self.asked: list[tuple[str, str]] = []  # (request, system prompt)

    async def __call__(self, user_id: str, messages: list[dict[str, Any]], tools: Any, max_tokens: int) -> str:
        request, system = last_user_text(messages), messages[0]["content"]
        self.asked.append((request, system))
        if self.copies and "add_note(" in system:
            return call("add_note", text=request)
        if self.copies and "now(" in system:
            return call("now", timezone="Lisbon")
        return next(t.response for t in PINNED + PROBES if last_user_text(t.messages) == request)


def check_with(model: Model, *lessons: str, **agent: Any) -> LessonCheck:
    index = LessonIndex(HashingEmbedder())
    for n, text in enumerate(lessons, 1):
        index.add(n, "alice", text)
    return LessonCheck(PINNED, index, AgentConfig(**agent), model)


def similarity(a: str, b: str) -> float:
    vectors = HashingEmbedder().embed([a, b])
    return float(vectors[0] @ vectors[1])


@pytest.mark.anyio
async def test_a_lesson_that_makes_a_pinned_turn_wrong_is_broken_and_unrelated_turns_are_not_asked():
    assert similarity(NOTE_SUM, "What's 37 plus 15?") >= 0.3 > similarity(NOTE_SUM, "Hello!")  # the premise
    model = Model()
    broken = await check_with(model).broken("alice", NOTE_SUM)
    assert [(b.request, b.reply) for b in broken] == [("What's 37 plus 15?", '<tool_call>\n{"name": "add_note", '
                                                      '"arguments": {"text": "What\'s 37 plus 15?"}}\n</tool_call>')]
    # scored as the index scores a search: by the request the lesson names
    assert broken[0].score == pytest.approx(similarity("What's 37 plus 14?", "What's 37 plus 15?"), abs=1e-5)
    # asked with the lesson, then without it (right: so the lesson broke it); "Hello!" was never asked
    assert [(request, NOTE_SUM in system) for request, system in model.asked] == [
        ("What's 37 plus 15?", True), ("What's 37 plus 15?", False)]  # fmt: skip


@pytest.mark.anyio
async def test_a_lesson_the_model_reads_right_or_one_no_pinned_turn_is_shown_breaks_nothing():
    model = Model(copies=False)
    assert await check_with(model).broken("alice", NOTE_SUM) == []
    assert [request for request, _ in model.asked] == ["What's 37 plus 15?"]  # right with it: not asked again
    model = Model()
    assert await check_with(model, lessons_min_score=0.99).broken("alice", NOTE_SUM) == []
    assert await check_with(model, lessons_k=0).broken("alice", NOTE_SUM) == []
    assert model.asked == []


@pytest.mark.anyio
async def test_a_turn_already_wrong_without_the_lesson_is_not_the_lessons_doing():
    """The user's other lesson (about home) already makes "What time is it in Moscow?" wrong: a second
    lesson of the same kind shown beside it is not blamed for it."""
    other = 'When asked "What time is it at home, please?": calling now({"timezone": "Lisbon"}) was right.'
    assert similarity(TIME_HOME, "What time is it in Moscow?") >= 0.3
    assert abs(similarity(other, "What time is it in Moscow?") - similarity(TIME_HOME, "What time is it in Moscow?")) < 0.1
    model = Model()
    assert await check_with(model, other).broken("alice", TIME_HOME) == []
    assert len(model.asked) == 2  # with both lessons, then with the other alone: wrong either way


@pytest.mark.anyio
async def test_a_lesson_shown_below_the_closest_by_more_than_the_margin_is_not_checked():
    """The user has a lesson about this very request; the new one, far below it, would not be shown."""
    exact = 'When asked "What\'s 37 plus 15?": calling calculate({"expression": "37 + 15"}) was right.'
    assert similarity(exact, "What's 37 plus 15?") - similarity(NOTE_SUM, "What's 37 plus 15?") > 0.1
    model = Model()
    assert await check_with(model, exact).broken("alice", NOTE_SUM) == []
    assert model.asked == []


@pytest.mark.anyio
@pytest.mark.parametrize("nearest", [0, 1, 3])
async def test_the_check_also_asks_the_probes_nearest_the_lesson_and_asks_them_together(nearest):
    """Beside every pinned turn, the ``nearest`` lesson probes most similar to the lesson: "What's 37 plus 16?"
    first, then "What's 12 plus 90?" ("Good morning!" is below the retrieval floor, so never asked). The
    replies with the lesson are asked at once (the server decodes them in one batch), then, for the ones it
    made wrong, the replies without it."""
    index = LessonIndex(HashingEmbedder())
    near, far, chat = (index.similarity(q, NOTE_SUM) for q in ("What's 37 plus 16?", "What's 12 plus 90?", "Good morning!"))
    assert near > far >= 0.3 > chat  # the premise, as the check scores them: by the request the lesson names
    model = Concurrent()
    broken = await LessonCheck(PINNED, index, AgentConfig(), model, PROBES, nearest).broken("alice", NOTE_SUM)
    expected = {0: ["What's 37 plus 15?"], 1: ["What's 37 plus 15?", "What's 37 plus 16?"],
                3: ["What's 37 plus 15?", "What's 37 plus 16?", "What's 12 plus 90?"]}[nearest]
    assert sorted(b.request for b in broken) == sorted(expected)
    assert [b.score for b in broken] == sorted((b.score for b in broken), reverse=True)  # closest first
    assert "Good morning!" not in [request for request, _ in model.asked]
    assert model.most == len(expected)  # every reply with the lesson was asked at once, then every one without


class Concurrent(Model):
    """:class:`Model`, counting the most requests it was asked at once."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.most = 0

    async def __call__(self, *args: Any) -> str:
        self.now += 1
        self.most = max(self.most, self.now)
        await anyio.sleep(0.01)
        try:
            return await super().__call__(*args)
        finally:
            self.now -= 1


def test_the_bundled_regression_set_loads_as_pinned_turns_in_its_order():
    turns = load_pinned_turns(regression_path("bundled"))
    assert len(turns) >= 30
    assert all(t.messages[-1]["role"] in ("user", "tool") and t.tools for t in turns)
    assert all(t.action.kept(t.response) for t in turns)  # each pinned reply does what it pins


@pytest.fixture
async def store(tmp_path) -> AsyncIterator[Store]:
    store = open_store(f"sqlite:///{tmp_path / 'whet.db'}")
    yield store
    await store.aclose()


async def thanked_call(store: Store, experience: Experience, request: str, name: str, arguments: dict) -> None:
    """One request answered by a call and an answer, then thanked: a success lesson for the call."""
    session = await store.create_session("alice")
    asked = [SYSTEM, {"role": "user", "content": request}]
    tool_call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    common = {"session_id": session.id, "user_id": "alice", "request_id": f"req-{session.id}", "model": "tiny"}
    step0 = await experience.record(TurnCreate(**common, step=0, prompt_messages=asked, tool_calls=[tool_call],
                                               response_token_ids=[1, 2], response_logprobs=[-0.1, -0.2]))  # fmt: skip
    await experience.close(step0.id, "tool_result", {"results": [{"role": "tool", "name": name, "content": "ok"}]})
    await experience.record(TurnCreate(**common, step=1, prompt_messages=asked, response_text="Done: 51.",
                                       response_token_ids=[3], response_logprobs=[-0.3]))  # fmt: skip
    await experience.close_open(session.id, "user_message", {"messages": [{"role": "user", "content": "Thanks!"}]})


class Unreachable(Model):
    async def __call__(self, *args: Any) -> str:
        raise RuntimeError("the served model is down")


@pytest.mark.anyio
@pytest.mark.parametrize(("copies", "margin"), [(True, 0.15), (True, 0.2), (False, 0.15), (None, 0.15)])
async def test_the_learner_narrows_or_holds_back_a_success_lesson_that_breaks_a_pinned_sum(tmp_path, store, copies,
                                                                                             margin):  # fmt: skip
    """A random thanks after a sum was noted on a list makes "calling add_note(...) was right" a lesson (the
    list is what the request did not say: a note of the sum alone would teach none). A model that
    would then note the pinned sum gets it narrowed: shown only to requests ``margin`` closer to it than the
    pinned sum is, or, when that leaves nothing below 1, not at all (counted, not stored). One that reads it
    right keeps it as it is; when the served model cannot be asked (None), the lesson is added unchecked
    rather than lost with its judging."""
    closest = similarity("What's 37 plus 14?", "What's 37 plus 15?")
    assert closest + 0.15 < 1.0 <= closest + 0.2  # the premise: one margin narrows, the other holds back
    bus = MemoryBus()
    await bus.start()
    index = LessonIndex(HashingEmbedder())
    config = LearnerConfig(train=False, gate={"lesson_scope_margin": margin})
    learner = Learner(config, store, bus, RulesJudge(), AdapterRegistry(store, bus, tmp_path),
                      lesson_check=LessonCheck(PINNED, index, AgentConfig(), Unreachable() if copies is None
                                               else Model(copies)))  # fmt: skip
    await thanked_call(store, Experience(store, bus), "What's 37 plus 14?", "add_note", {"text": "37 + 14", "list_name": "maths"})
    await learner.catch_up()
    lessons = [(lesson.text, lesson.min_score) for lesson in await store.list_lessons("alice")]
    status = await learner.status()
    counts = (status["lessons"], status["lessons_narrowed"], status["lessons_held"])
    if copies and margin == 0.2:
        assert (lessons, counts) == ([], (0, 0, 1))
    elif copies:
        assert lessons == [(NOTE_SUM_LISTED, pytest.approx(closest + margin, abs=1e-5))] and counts == (1, 1, 0)
    else:
        assert (lessons, counts) == ([(NOTE_SUM_LISTED, None)], (1, 0, 0))
    await bus.aclose()


@pytest.mark.anyio
async def test_whet_serve_checks_a_thanked_wrong_call_on_the_served_model_and_narrows_it(tmp_path):
    """The whole path: a sum answered with add_note and thanked; the learner asks the served model the
    bundled pinned turns the lesson would be shown with (the hashing embedder scores them 0.24-0.29, so
    the floor is lowered to reach them), sees a pinned sum noted, and adds no lesson."""
    from test_api import chat_body, serve

    from whet.runtime.scripted import ScriptedBackend

    pins = {last_user_text(t.messages): t.response for t in load_pinned_turns(regression_path("bundled"))
            if t.messages[-1]["role"] == "user"}  # fmt: skip

    def model(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
        """Notes whatever it is asked once a lesson says add_note was right, and notes this one sum on a
        list (what the request did not say, so that its thanks teach a lesson)."""
        request = last_user_text(messages)
        if messages[-1]["role"] == "tool":
            return "Done."
        if request == "What's 37 plus 14?" and "add_note(" not in messages[0]["content"]:
            return call("add_note", text=request, list_name="maths")
        if "add_note(" in messages[0]["content"]:
            return call("add_note", text=request)
        return pins.get(request, "Hello.")

    backend = ScriptedBackend(model)
    learner = {"train": False, "gate": {"check_lessons": True}}
    async with serve(tmp_path, backend, learner=learner, agent={"lessons_min_score": 0.2}) as (client, res):
        first = await client.post("/v1/chat/completions", json=chat_body("What's 37 plus 14?"))
        assert first.status_code == 200, first.text
        thanked = chat_body("What's 37 plus 14?", first.json()["choices"][0]["message"]["content"], "Thanks!")
        assert (await client.post("/v1/chat/completions", json=thanked)).status_code == 200
        await res.learner.catch_up()
        with anyio.fail_after(60):  # the learner's own task may be judging it (and asking the model) meanwhile
            while (await res.learner.status())["busy"]:
                await anyio.sleep(0.05)  # polling the learner: it publishes no event for a lesson held back
        asked = [(last_user_text(c.messages), "add_note(" in c.messages[0]["content"], c.params.temperature)
                 for c in backend.calls[3:]]  # fmt: skip
        assert ("What's 22 plus 45?", True, 0.0) in asked and ("What's 22 plus 45?", False, 0.0) in asked
        [lesson] = await res.store.list_lessons(res.config.server.default_user)
        closest = similarity(lesson_key(lesson.text), "What's 22 plus 45?")  # the closest pinned turn it broke
        assert lesson.min_score == pytest.approx(closest + 0.15, abs=1e-5) and closest > 0.5
        assert (await res.learner.status())["lessons_narrowed"] == 1
        with anyio.fail_after(30):
            while len(res.index) < 1:  # the lesson reaches the index through the bus
                await anyio.sleep(0.05)
        for request, shown in (("What's 22 plus 45?", False), ("What's 37 plus 14?", True)):
            before = len(backend.calls)
            assert (await client.post("/v1/chat/completions", json=chat_body(request))).status_code == 200
            assert ("add_note(" in backend.calls[before].messages[0]["content"]) is shown, request


SAMS = 'When asked "What time is it at Sam\'s place?": calling now({"timezone": "Tokyo"}) was right.'


def called(request: str, lessons: list[str], **arguments: Any) -> Any:
    """A recorded call turn (what :func:`misled_lessons` reads of one): ``now(**arguments)`` for ``request``,
    served with ``lessons``."""
    from types import SimpleNamespace

    from whet.learner.prompt import prompt_with_lessons

    messages = prompt_with_lessons([{"role": "user", "content": request}], lessons, "You are whet.")
    tool_call = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": json.dumps(arguments)}}
    return SimpleNamespace(prompt_messages=messages, tool_calls=[tool_call], step=0)


def test_a_lesson_misled_a_corrected_call_only_where_the_call_copied_a_value_the_lesson_spells_and_the_user_did_not():
    from whet.learner.learner import misled_lessons
    from whet.memory.tables import Lesson

    home = "What's the time back home?"
    sams, work = Lesson(id=1, user_id="alice", text=SAMS), Lesson(id=2, user_id="alice", text="Notes go on my homework list.")
    hint = 'The user meant "Lisbon time"'
    assert misled_lessons([called(home, [SAMS, work.text], timezone="Tokyo")], hint, [sams, work]) == [(sams, home)]
    # a reminder written to the work list, the user meaning errands: both lessons spell "todo", one says errands
    said = {"list_name": "work", "text": "order new glasses", "kind": "todo"}
    misled, right = (Lesson(id=n, user_id="alice", text=f'When asked "{asked}": calling add_note('
                            f'{json.dumps({**said, "list_name": name, "text": asked[13:-1]})}) was right.')
                     for n, (asked, name) in enumerate((("Remind me to call the bank.", "work"),
                                                        ("Remind me to buy a plant.", "errands")), 3))  # fmt: skip
    remind = "Remind me to order new glasses."
    errands = 'The user meant "on my errands list"'
    assert misled_lessons([called(remind, [misled.text, right.text], **said)], errands, [misled, right]) == [
        (misled, remind)]
    # the same call answering a correction: what it was shown was chosen for the correction's words
    assert misled_lessons([called("No, I meant on my errands list.", [misled.text], **said)], errands, [misled]) == []
    for turn, said in ((called(home, [SAMS], timezone="Tokyo"), 'The user meant "Tokyo, not Osaka"'),  # the hint names it
                       (called("What's the time in Tokyo?", [SAMS], timezone="Tokyo"), hint),  # the request names it
                       (called(home, [], timezone="Tokyo"), hint),  # not shown: made up, not copied
                       (called(home, [work.text], timezone="work"), hint)):  # "homework" is not "work"
        assert misled_lessons([turn], said, [sams, work]) == []


@pytest.mark.anyio
async def test_whet_serve_narrows_a_lesson_a_corrected_call_copied_away_from_that_request(tmp_path):
    """Sam's city, copied from Sam's lesson into a question about home, and corrected: the lesson is stored
    again narrowed (a new id, the old one dropped from the index through the bus), shown from then on to
    Sam's request and no longer to home's."""
    from test_api import chat_body, serve

    from whet.runtime.scripted import ScriptedBackend

    def model(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
        """Copies Tokyo from any lesson that spells it."""
        if messages[-1]["role"] == "tool":
            return "Done."
        return call("now", timezone="Tokyo") if "Tokyo" in messages[0]["content"] else "Hello."

    backend = ScriptedBackend(model)
    home, sams = "What's the time back home?", "What time is it at Sam's place?"
    learner = {"train": False, "gate": {"check_lessons": False}}
    agent = {"lessons_min_score": 0.0, "lessons_margin": 2.0}  # the hashing embedder: every lesson is shown
    async with serve(tmp_path, backend, learner=learner, agent=agent) as (client, res):
        user = res.config.server.default_user
        old = await res.store.add_lesson(user, SAMS, kind="success")
        res.index.add(old.id, user, SAMS)
        first = await client.post("/v1/chat/completions", json=chat_body(home))
        assert first.status_code == 200, first.text
        corrected = chat_body(home, first.json()["choices"][0]["message"]["content"], "No, I meant Lisbon time.")
        assert (await client.post("/v1/chat/completions", json=corrected)).status_code == 200
        await res.learner.catch_up()
        with anyio.fail_after(60):
            while (await res.learner.status())["busy"]:
                await anyio.sleep(0.05)
        [narrowed] = [lesson for lesson in await res.store.list_lessons(user) if lesson.text == SAMS]
        assert narrowed.id != old.id and narrowed.kind == "success"
        assert narrowed.min_score == pytest.approx(similarity(lesson_key(SAMS), home) + 0.15, abs=1e-5)
        assert (await res.learner.status())["lessons_misled"] == 1
        with anyio.fail_after(30):
            while old.id in res.index.ids() or narrowed.id not in res.index.ids():
                await anyio.sleep(0.05)
        for request, shown in ((home, False), (sams, True)):
            before = len(backend.calls)
            assert (await client.post("/v1/chat/completions", json=chat_body(request))).status_code == 200
            assert ("Tokyo" in backend.calls[before].messages[0]["content"]) is shown, request
