"""The assistant world's checkers, profiles, the simulated user and the demo policy's training data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from whet.learner.judge import NextState, RulesJudge, correction_hint
from whet.world.tasks import GENERAL, INTENTS, PERSONAL, ToolUse, World, load_profile, make_task
from whet.world.user import SimulatedUser

PROFILE = load_profile(None)
PROFILES = Path(__file__).parents[1] / "config" / "profiles"  # the shipped ones


def test_the_default_profile_loads_and_the_world_covers_at_least_eight_intents():
    assert PROFILE.home == "Lisbon" and PROFILE.people["Sam"] == "Tokyo"
    assert len(INTENTS) >= 8 and set(PERSONAL) | set(GENERAL) == set(INTENTS)
    world = World(PROFILE, seed=0)
    assert {t.intent for t in world.general_tasks(len(GENERAL))} == set(GENERAL)
    assert {t.intent for t in world.heldout_tasks(len(PERSONAL))} == set(PERSONAL)


def test_tasks_are_deterministic_per_seed_and_heldout_phrasings_never_appear_in_training():
    a, b, c = World(PROFILE, 3), World(PROFILE, 3), World(PROFILE, 4)
    assert [t.text for t in a.training_tasks(40)] == [t.text for t in b.training_tasks(40)]
    assert [t.text for t in a.training_tasks(40)] != [t.text for t in c.training_tasks(40)]
    training = {t.text for t in a.training_tasks(200) if t.personal}
    heldout = {t.text for t in a.heldout_tasks(50)}
    assert heldout and not training & heldout


def test_the_learner_imports_neither_the_world_nor_the_servers_and_the_world_never_the_runtime():
    # a fresh interpreter: this test session has imported everything elsewhere
    code = (
        "import importlib, pkgutil, sys, whet.learner\n"
        "def load(package):\n"
        "    for m in pkgutil.iter_modules(package.__path__):\n"
        "        importlib.import_module(f'{package.__name__}.{m.name}')\n"
        "load(whet.learner)\n"
        "bad = [m for m in sys.modules if m.startswith(('whet.world', 'whet.servers', 'whet.runtime'))]\n"
        "assert not bad, bad\n"
        "import whet.world\n"
        "load(whet.world)\n"
        "bad = [m for m in sys.modules if m.startswith('whet.runtime')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# right and wrong solutions for one task of every intent: (calls, answer) pairs
def _right(task, folder: Path) -> tuple[list[ToolUse], str]:
    from whet.world.conversations import BundledTools, answer_for

    tools = BundledTools(folder)
    try:
        result = tools.call(task.call)
    finally:
        tools.close()
    return [task.call], answer_for(task, task.call, result)


@pytest.mark.parametrize("intent", INTENTS)
def test_checkers_accept_the_right_solution_and_reject_wrong_ones(intent, tmp_path):
    import random

    task = make_task(intent, random.Random(intent), PROFILE)
    calls, answer = _right(task, tmp_path)
    assert task.check(calls, answer), (task, answer)
    assert not task.check([], answer), "no tool call"
    assert not task.check(calls, ""), "no answer"
    wrong_name = ToolUse("search_notes" if task.call.name != "search_notes" else "now", dict(task.call.arguments))
    assert not task.check([wrong_name], answer)
    for key, value in task.call.arguments.items():  # every argument matters
        changed = {**task.call.arguments, key: _other(key, value)}
        assert not task.check([ToolUse(task.call.name, changed)], answer), (intent, key)


def _other(key: str, value):
    return {"timezone": "Honolulu", "to_unit": "yards", "from_unit": "ounces", "list_name": "nowhere",
            "kind": "note", "text": "something else entirely", "expression": "1 + 1", "date": "1999-01-01",
            "start": "1999-01-01", "end": "1999-01-02"}.get(key, value + 1 if isinstance(value, int | float) else "x")


def test_checkers_compare_meaning_not_spelling():
    task = make_task("time_home", __import__("random").Random(0), PROFILE)
    assert task.check([ToolUse("now", {"timezone": "Europe/Lisbon"})], "It is 10:15 in Europe/Lisbon.")
    assert not task.check([ToolUse("now", {"timezone": "Europe/Lisbon"})], "It is late in Lisbon.")  # no time
    distance = next(t for t in World(PROFILE, 0).heldout_tasks(10) if t.intent == "distance")
    value = distance.call.arguments["value"]
    right = ToolUse("convert", {"value": float(value), "from_unit": "kilometres", "to_unit": "mi"})
    answer = f"{value} km is about {round(value * 0.621371192237, 2)} miles."
    assert distance.check([right], answer)
    calc = make_task("calculate", __import__("random").Random(1), PROFILE)
    spaced = ToolUse("calculate", {"expression": calc.call.arguments["expression"].replace(" ", "")})
    assert calc.check([spaced], f"It is {calc.shows[0]}.")
    assert not calc.check([spaced], f"It is {calc.shows[0]}0.")


def test_a_bad_profile_file_gets_a_clear_error(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("name: x\nhome: Atlantis\npeople: {Sam: Tokyo}\ndistance_unit: miles\n"
                   "temperature_unit: kelvin\nreminders_list: work\n")
    with pytest.raises(ValueError, match="Atlantis"):
        load_profile(bad)
    bad.write_text("name: x\nhome: Lisbon\npeople: {Sam: Tokyo}\ndistance_unit: kelvin\n"
                   "temperature_unit: kelvin\nreminders_list: work\n")
    with pytest.raises(ValueError, match="distance_unit: 'kelvin' is a unit of temperature"):
        load_profile(bad)
    bad.write_text("name: x\nfavourite_colour: blue\n")
    with pytest.raises(ValueError, match="unknown keys favourite_colour"):
        load_profile(bad)
    with pytest.raises(ValueError, match="cannot read profile"):
        load_profile(tmp_path / "missing.yaml")


def test_shipped_profiles_all_load():
    profiles = sorted(PROFILES.glob("*.yaml"))
    assert len(profiles) >= 2
    for path in profiles:
        assert load_profile(path).name


def test_the_simulated_user_thanks_when_served_right_and_corrects_when_wrong():
    task = next(t for t in World(PROFILE, 0).heldout_tasks(5) if t.intent == "time_home")
    user = SimulatedUser(PROFILE, seed=0)
    replies = [user.reply(task, "It is 10:15 on Friday in Lisbon.") for _ in range(20)]
    verdicts = {_score(r, task.text) for r in replies}
    assert verdicts == {1}, replies
    wrong = [user.reply(task, "It is 10:15 on Friday in Tokyo.") for _ in range(40)]
    assert "No, I meant Lisbon time." in wrong
    assert all(_score(r, task.text) == -1 for r in wrong)
    assert correction_hint("No, I meant Lisbon time.") == 'The user meant "Lisbon time"'


def test_the_simulated_user_does_not_take_an_error_message_as_an_answer_whatever_it_names():
    task = next(t for t in World(PROFILE, 0).heldout_tasks(5) if t.intent == "time_home")
    user = SimulatedUser(PROFILE, seed=0)
    echoed = "<tool_response>\nerror: Unknown timezone 'Champagne'. Try a city like 'Lisbon' or UTC+5:30"
    assert task.answer_ok(echoed) and task.mentions_preference(echoed)  # the words are there...
    assert not user.satisfied(task, echoed)  # ...but a person reads an error
    assert user.satisfied(task, "It is 10:15 on Friday in Lisbon.")


def _score(reply: str, asked: str) -> int:
    """The rules judge's score for the user's reply to the answer to ``asked``."""
    state = NextState("user_message", {"messages": [{"role": "user", "content": reply}]})
    return RulesJudge().decide(None, state, [{"role": "user", "content": asked}]).score


def test_the_simulated_user_is_deterministic_per_seed():
    tasks = World(PROFILE, 1).training_tasks(30)
    answers = ["It is 10:15 in Lisbon.", "Done.", "It is 10:15 in UTC."] * 10

    def conversation(seed: int) -> list[str]:
        user = SimulatedUser(PROFILE, seed)
        return [user.reply(t, a) for t, a in zip(tasks, answers, strict=True)]

    assert conversation(5) == conversation(5)
    assert conversation(5) != conversation(6)


def test_training_conversations_use_the_servers_real_output_and_the_learners_lesson_and_hint_forms():
    from whet.learner.prompt import LESSONS_HEADER
    from whet.world.conversations import examples

    batch = list(examples(200, seed=0, chats=[("Tell me a joke.", "Why did the chicken cross the road?")]))
    kinds = {e.kind for e in batch}
    assert kinds == {"general", "guess", "lesson", "hint", "correction", "thanks", "error", "chat"}
    failed = next(e for e in batch if e.kind == "error")  # a call the tool refused, then a plain answer
    assert failed.messages[-2]["role"] == "tool" and failed.messages[-2]["content"].startswith("error:")
    assert failed.messages[-1]["content"].startswith("Sorry, that did not work")
    assert "<tool" not in failed.messages[-1]["content"]
    chat = next(e for e in batch if e.kind == "chat")
    assert chat.messages[-1] == {"role": "assistant", "content": "Why did the chicken cross the road?"}
    assert "chat" not in {e.kind for e in examples(40, seed=0)}  # no chats given, none drawn
    lesson = next(e for e in batch if e.kind == "lesson")
    assert LESSONS_HEADER.strip() in lesson.messages[0]["content"]
    hint = next(e for e in batch if e.kind == "hint")
    assert "\n\n[hint] The user meant" in hint.messages[1]["content"]
    tool = next(m for e in batch if e.kind == "general" for m in e.messages if m["role"] == "tool")
    assert json.loads(tool["content"])  # the server's structured output, as the pool renders it
    assert [e.messages for e in examples(5, seed=1)] == [e.messages for e in examples(5, seed=1)]


def test_the_warm_start_deals_its_intents_in_even_rounds_the_calculator_twice(tmp_path):
    from collections import Counter

    from whet.world.conversations import GENERAL_DRAW, BundledTools, ExampleMaker
    from whet.world.tasks import GENERAL, NATURAL, PERSONAL

    tools = BundledTools(tmp_path)
    try:
        maker = ExampleMaker(tools, 0, NATURAL)
        round_size = sum(GENERAL_DRAW.get(i, 1) for i in GENERAL)
        dealt = [maker._deal(("general", False), maker._general_round) for _ in range(3 * round_size)]
        assert Counter(dealt) == {i: 3 * GENERAL_DRAW.get(i, 1) for i in GENERAL}
        assert GENERAL_DRAW == {"calculate": 2} and dealt[:round_size] != dealt[round_size: 2 * round_size]  # shuffled
        for kind in ("error", "lesson"):  # each kind its own rounds: a rare kind still sees every intent
            assert Counter(maker._deal((kind, True), PERSONAL) for _ in range(2 * len(PERSONAL))) == {i: 2 for i in PERSONAL}
    finally:
        tools.close()


def test_the_warm_start_can_show_distractor_lessons_as_retrieval_ranks_them(tmp_path):
    """With a ranker, each request's distractors are the nearest to it of ``lookalikes`` times as many lessons
    of any personal intent, nearest first; the lesson that answers it (the ``lesson`` kind) is still shown beside them."""
    from whet.memory.index import HashingEmbedder, LessonIndex, lesson_keys
    from whet.world.conversations import BundledTools, ExampleMaker, retrieval_ranker
    from whet.world.tasks import NATURAL

    asked: list[tuple[str, list[str], list[float]]] = []

    def rank(request, lessons):
        scores = [float(len(text) % 97) for text in lessons]  # any order but the drawn one
        asked.append((request, list(lessons), scores))
        return scores

    tools = BundledTools(tmp_path)
    try:
        maker = ExampleMaker(tools, 0, NATURAL, chats=[("Hi!", "Hello.")], rank=rank, lookalikes=5)
        checked = 0
        for _ in range(120):
            before = len(asked)
            example = maker.example()
            if len(asked) == before:
                continue
            request, pool, scores = asked[-1]
            system = example.messages[0]["content"]
            distractors = sorted({text for text in pool if f"- {text}" in system}, key=lambda t: system.index(f"- {t}"))
            n = len(distractors)
            assert len(pool) == 5 * n and request == example.messages[1]["content"]
            assert distractors == [pool[i] for i in sorted(range(len(pool)), key=lambda i: -scores[i])[:n]]
            assert system.count("\n- ") == n + (example.kind == "lesson")  # the lesson kind shows one more: its own
            checked += 1
        assert checked > 20
    finally:
        tools.close()
    embedder = HashingEmbedder()
    lesson = 'When asked "What time is it at home?": calling now({"timezone": "Lisbon"}) was right.'
    [score] = retrieval_ranker(LessonIndex(embedder))("What time is it at home?", [lesson])
    assert abs(score - float(embedder.embed(["What time is it at home?"])[0] @ embedder.embed([lesson_keys(lesson)[0]])[0])) < 1e-5
    (tmp_path / "other").mkdir()
    tools = BundledTools(tmp_path / "other")
    try:
        with pytest.raises(ValueError, match="lookalikes"):
            ExampleMaker(tools, 0, NATURAL, rank=rank)
    finally:
        tools.close()


def test_the_warm_start_ranks_the_distractors_of_the_kinds_it_is_told_and_can_show_general_requests_more(tmp_path):
    """``ranked`` names the kinds whose distractor lessons are drawn as retrieval ranks them; ``general_lessons``,
    how many general requests are shown distractor lessons at all."""
    from whet.world.conversations import BundledTools, ExampleMaker
    from whet.world.tasks import NATURAL

    asked: list[str] = []

    def rank(request, lessons):
        asked.append(request)
        return [0.0] * len(lessons)

    tools = BundledTools(tmp_path)
    try:
        kinds: dict[str, list[bool]] = {}
        maker = ExampleMaker(tools, 0, NATURAL, chats=[("Hi!", "Hello.")], rank=rank, lookalikes=3,
                             ranked=("general",), general_lessons=1.0)  # fmt: skip
        for _ in range(200):
            before = len(asked)
            example = maker.example()
            shown = "\n- " in example.messages[0]["content"]
            kinds.setdefault(example.kind, []).append(len(asked) > before)
            if example.kind == "general":
                assert shown and asked[-1] == example.messages[1]["content"]
        assert len(kinds["general"]) > 30 and all(kinds["general"])
        assert not any(ranked for kind, seen in kinds.items() if kind != "general" for ranked in seen)
        assert {"lesson", "guess", "chat"} <= set(kinds)
        for bad, match in (({"ranked": ("general", "gossip")}, "gossip"), ({"general_lessons": 1.5}, "general_lessons")):
            with pytest.raises(ValueError, match=match):
                ExampleMaker(tools, 0, NATURAL, rank=rank, lookalikes=3, **bad)
    finally:
        tools.close()


def test_training_values_are_far_wider_than_what_the_simulated_users_say():
    from whet.servers.clock import resolve_timezone
    from whet.world.conversations import training_vocabulary
    from whet.world.tasks import NATURAL

    wide = training_vocabulary()
    assert len(wide.cities) > 10 * len(NATURAL.cities) and len(wide.lists) > 2 * len(NATURAL.lists)
    for city in wide.cities[::25]:
        resolve_timezone(city)  # every one is a city the clock knows


def test_the_chat_probe_and_the_gates_chats_ask_nothing_the_warm_start_trained_on():
    from whet.world.conversations import CHAT_PROMPTS
    from whet.world.regression import CHATS, REHEARSAL_CHATS
    from whet.world.tasks import CHAT_PROBE

    assert len(CHAT_PROBE) >= 12 and not set(CHAT_PROBE) & set(CHAT_PROMPTS)
    pinned = {request for request, _ in CHATS}
    assert len(pinned) == len(CHATS) >= 40  # of every kind: greetings, feelings, opinions, how-to, meanings...
    assert not pinned & set(CHAT_PROMPTS) and not pinned & set(CHAT_PROBE)
    assert not pinned & {request for request, _ in REHEARSAL_CHATS}  # the gate checks what no step trains on


def test_a_user_who_gives_wrong_feedback_ignores_what_was_right():
    from dataclasses import replace

    noisy = replace(PROFILE, wrong_feedback_rate=1.0)
    task = next(t for t in World(noisy, 0).heldout_tasks(5) if t.intent == "time_home")
    user = SimulatedUser(noisy, seed=0)
    right = [user.reply(task, "It is 10:15 on Friday in Lisbon.") for _ in range(40)]
    corrections = [r for r in right if r.startswith("No, I meant")]
    assert corrections and any(_score(r, task.text) == 1 for r in right)  # thanks and corrections, at random
    assert all("Lisbon" not in r for r in corrections)  # a correction names some other city
    assert load_profile(PROFILES / "noisy.yaml").wrong_feedback_rate == 1.0


def test_the_offlist_profile_is_off_the_simulated_users_vocabulary_and_sparing_with_thanks():
    from whet.world.tasks import CITIES, DISTANCE_UNITS, LISTS, PEOPLE

    offlist = load_profile(PROFILES / "offlist.yaml")
    assert not {offlist.home, *offlist.people.values()} & set(CITIES) and not set(offlist.people) & set(PEOPLE)
    assert offlist.distance_unit not in DISTANCE_UNITS and offlist.reminders_list not in LISTS
    assert offlist.thanks_rate < 0.5 < offlist.requery_rate


def test_a_tool_error_is_an_ordinary_result_for_the_in_process_servers(tmp_path):
    from whet.world.conversations import BundledTools

    tools = BundledTools(tmp_path)
    try:
        assert tools.call(ToolUse("now", {"timezone": "now"})).startswith("error: ")
        assert tools.call(ToolUse("teleport", {})).startswith("error: unknown tool 'teleport'")
    finally:
        tools.close()


def test_the_shipped_regression_set_is_what_the_world_generates():
    from whet.world.regression import line, records

    shipped = (Path(__file__).parents[1] / "config" / "regression.jsonl").read_text().splitlines()
    assert shipped == [line(r) for r in records()]  # as text: key order is what the prompt shows


def test_the_shipped_rehearsal_set_is_generated_and_shares_no_request_with_the_regression_set():
    """The gate's regression set checks what training did not see: the rehearsal set that every
    step trains on holds other requests, of the same kinds (general calls, answers, small talk)."""
    from whet.world.regression import asked, line, records, rehearsal_records

    shipped = (Path(__file__).parents[1] / "config" / "rehearsal.jsonl").read_text().splitlines()
    rehearsal = [json.loads(text) for text in shipped]
    assert shipped == [line(r) for r in rehearsal_records()]
    assert not {asked(r) for r in rehearsal} & {asked(r) for r in records()}
    calls = [r for r in rehearsal if r["response"].startswith("<tool_call>")]
    chats = [r for r in rehearsal if r["messages"][-1]["role"] == "user" and "<tool_call>" not in r["response"]]
    assert len(calls) >= 16 and len(chats) >= 12


def test_the_shipped_lesson_probes_are_generated_general_calls_that_neither_other_set_holds():
    from whet.world.regression import asked, line, probe_records, records, rehearsal_records

    shipped = (Path(__file__).parents[1] / "config" / "lesson_probes.jsonl").read_text().splitlines()
    probes = [json.loads(text) for text in shipped]
    assert shipped == [line(r) for r in probe_records()]
    assert not {asked(r) for r in probes} & ({asked(r) for r in records()} | {asked(r) for r in rehearsal_records()})
    assert all(r["response"].startswith("<tool_call>") and r["messages"][-1]["role"] == "user" for r in probes)
    called = {json.loads(r["response"].split("\n")[1])["name"] for r in probes}
    assert called == {"now", "calculate", "convert", "add_note", "weekday", "days_between", "add_to_date"}
    assert len(probes) >= 64


@pytest.mark.parametrize("profile", [PROFILE, load_profile(PROFILES / "commuter.yaml")],
                         ids=lambda p: p.name)
def test_the_users_first_personal_requests_touch_every_preference_once_each_person_included(profile):
    for seed in range(5):
        tasks = World(profile, seed).training_tasks(40)
        personal = [t for t in tasks if t.personal]
        first = personal[: len(PERSONAL) - 1 + len(profile.people)]
        assert [t.intent for t in first if t.intent != "time_person"] == [i for i in PERSONAL if i != "time_person"]
        assert sorted(t.meta["person"] for t in first if t.intent == "time_person") == sorted(profile.people)
        assert {t.intent for t in tasks} - set(PERSONAL)  # general requests still come in between
