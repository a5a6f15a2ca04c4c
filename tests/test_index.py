"""Retrieval memory: per-user lesson search with both embedders."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from whet.config.settings import AgentConfig
from whet.learner.lessons import lesson_text
from whet.memory import HashingEmbedder, Lesson, LessonIndex, MiniLMEmbedder, open_embedder
from whet.memory.index import agent_shown, called_values, lesson_key, lesson_keys

LESSONS = [
    (1, "alice", "Alice lives in Berlin, so give times in the Europe/Berlin time zone."),
    (2, "alice", "Alice prefers answers in metric units like kilometres and celsius."),
    (3, "alice", "When Alice asks for code, answer in Python with type hints."),
    (4, "bob", "Bob lives in Tokyo, so give times in the Asia/Tokyo time zone."),
    (5, "bob", "Bob likes short answers without greetings."),
]


@pytest.fixture(scope="module")
def minilm() -> MiniLMEmbedder:
    return open_embedder("minilm")


@pytest.fixture(params=["hashing", "minilm"])
def embedder(request, minilm):
    return HashingEmbedder() if request.param == "hashing" else minilm


def test_hashing_embedder_is_deterministic_normalised_and_scores_similar_texts_higher():
    embedder = HashingEmbedder(dim=256)
    vectors = embedder.embed(["the time zone in Berlin", "time zone of berlin", "bake a chocolate cake"])
    assert vectors.shape == (3, 256) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(vectors, HashingEmbedder(dim=256).embed(
        ["the time zone in Berlin", "time zone of berlin", "bake a chocolate cake"]))  # fmt: skip
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2] + 0.3


def test_the_minilm_embedder_a_server_opens_is_loaded_before_the_first_request(minilm):
    assert minilm.loaded  # open_embedder, which the lifespan runs in a worker thread, loaded it


def test_minilm_embedder_loads_offline_from_the_package_and_normalises(minilm):
    vectors = minilm.embed(["what time is it in Berlin?", "current time in Berlin", "a recipe for soup"])
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-4)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]


def test_open_embedder_chooses_by_kind():
    assert isinstance(open_embedder("hashing"), HashingEmbedder)
    assert isinstance(open_embedder("minilm", load=False), MiniLMEmbedder)
    assert isinstance(open_embedder("auto", load=False), MiniLMEmbedder)  # installed here
    with pytest.raises(ValueError, match="'auto', 'minilm' or 'hashing'"):
        open_embedder("word2vec")


def test_relevant_lesson_ranks_first(embedder):
    index = LessonIndex(embedder)
    index.add_many(LESSONS)
    hits = index.search("alice", "what time is it right now in my time zone?", k=3)
    assert [h.lesson_id for h in hits][0] == 1
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert index.search("alice", "write me a python function", k=1)[0].lesson_id == 3


def test_a_learner_lesson_is_found_by_the_request_it_came_from_not_by_its_call(embedder):
    home = lesson_text("What time is it at home?", calls=[{"name": "now", "arguments": '{"timezone": "Seoul"}'}])
    dad = lesson_text("What's the time where Dad is?", hint='The user meant "Honolulu time, Dad lives in Honolulu"')
    assert lesson_key(home) == "What time is it at home?" and lesson_key(dad) == "What's the time where Dad is?"
    assert lesson_key("Alice likes short answers.") == "Alice likes short answers."  # written by hand: all of it
    index = LessonIndex(embedder)
    index.add_many([(1, "jun", home), (2, "jun", dad)])
    hits = index.search("jun", "What time is it at home?", k=2)
    assert [h.lesson_id for h in hits] == [1, 2] and hits[0].score == pytest.approx(1.0, abs=1e-5)
    assert hits[0].text == home  # the prompt shows the whole lesson
    # the lesson check scores a lesson against pinned requests by the same key
    request = index.embedder.embed(["What's the time where Dad is?"])[0]
    assert index.scores(request[None, :], dad)[0] == pytest.approx(1.0, abs=1e-5)


def test_a_lesson_is_also_found_by_its_request_less_what_its_calls_copied_from_it(minilm):
    """jun's reminder lessons scored 0.27-0.28 against "Can you remind me to cancel the gym trial?",
    under the agent's floor of 0.3: the request's business, not its kind, is what MiniLM weighs."""
    haircut = lesson_text("I need a reminder to book a haircut.", calls=[{"name": "add_note", "arguments": {
        "text": "book a haircut", "list_name": "work", "kind": "todo"}}])  # fmt: skip
    assert lesson_keys(haircut) == ("I need a reminder to book a haircut.", "I need a reminder to ….")
    dad = lesson_text("What's the time where Dad is?", hint='The user meant "Honolulu time"')
    assert lesson_keys(dad) == ("What's the time where Dad is?",)  # nothing was called: one key
    clipped = lesson_text("Remind me to " + "x " * 100, calls=[{"name": "add_note", "arguments": {"text": "x " * 100}}])
    assert lesson_keys(clipped) == (lesson_key(clipped),)  # the call was clipped away: nothing to leave out
    assert called_values('calling add_note({"text": "Dad (home)", "n": 2}), now({"timezone": ["Asia/Seoul"]}) was right.') \
        == ["Dad (home)", "2", "Asia/Seoul"]

    index = LessonIndex(minilm)
    index.add_many([(7, "jun", haircut), (8, "jun", dad)])
    asked = "Can you remind me to cancel the gym trial?"
    by_request = float(minilm.embed([asked])[0] @ minilm.embed([lesson_key(haircut)])[0])
    hits = index.search("jun", asked, k=4)
    assert [h.lesson_id for h in hits] == [7, 8]  # each lesson once, by its closer key
    assert hits[0].score == pytest.approx(index.similarity(asked, haircut)) and hits[0].score > by_request
    assert by_request < 0.3 <= hits[0].score  # the agent's floor (config/whet.yaml) shows it now
    # the same lesson again under the same id is replaced, both its keys; removing it removes both
    index.add_many([(7, "jun", haircut)])
    assert len(index) == 2 and [h.lesson_id for h in index.search("jun", asked, k=4)] == [7, 8]
    assert index.remove(7) and [h.lesson_id for h in index.search("jun", asked, k=4)] == [8]
    assert index.remove_user("jun") == 1 and index.search("jun", asked, k=4) == []


def test_a_narrowed_lesson_is_shown_only_to_requests_as_close_as_its_floor_and_does_not_crowd_the_rest():
    """A lesson the lesson check narrowed carries its own floor through the index and the store; below it
    the lesson is as if absent: not shown, and not the closest that the margin counts from."""
    home = lesson_text("What time is it at home?", calls=[{"name": "now", "arguments": '{"timezone": "Seoul"}'}])
    dad = lesson_text("What's the time where Dad is?", calls=[{"name": "now", "arguments": '{"timezone": "Cairo"}'}])
    index = LessonIndex(HashingEmbedder())
    index.rebuild([Lesson(id=1, user_id="jun", text=home, min_score=0.9), Lesson(id=2, user_id="jun", text=dad)])
    agent = AgentConfig(lessons_min_score=0.1, lessons_margin=0.1)

    def shown_for(request: str) -> list[int]:
        return [h.lesson_id for h in agent_shown(agent, index.search("jun", request, 4))]

    look_alike = index.search("jun", "What is the time at home in Cairo?", 4)
    assert [h.lesson_id for h in look_alike] == [1, 2] and look_alike[0].score < 0.9
    assert look_alike[0].score - look_alike[1].score > 0.1  # the home lesson would have crowded Dad's out
    assert shown_for("What is the time at home in Cairo?") == [2]
    assert shown_for("What time is it at home?") == [1]  # its own request: 1.0, and Dad's far below
    index.add(1, "jun", home)  # the same lesson unnarrowed replaces it
    assert shown_for("What is the time at home in Cairo?") == [1]


def test_search_never_returns_another_users_lesson(embedder):
    index = LessonIndex(embedder)
    index.add_many(LESSONS)
    # Bob's Tokyo lesson is the nearest vector to this query, yet Alice must not see it
    hits = index.search("alice", "Bob lives in Tokyo, so give times in the Asia/Tokyo time zone.", k=10)
    assert {h.user_id for h in hits} == {"alice"}
    assert {h.lesson_id for h in hits} == {1, 2, 3}
    assert index.search("carol", "time zone", k=5) == []


def test_adding_a_lesson_id_again_replaces_it():
    index = LessonIndex(HashingEmbedder())
    index.add(7, "alice", "old text about gardening")
    index.add(7, "alice", "new text about sailing")
    assert len(index) == 1
    assert index.search("alice", "sailing", k=5)[0].text == "new text about sailing"


def test_adding_the_same_lesson_again_does_nothing_and_embeds_nothing():
    embedded: list[str] = []

    class Counting(HashingEmbedder):
        def embed(self, texts: list[str]) -> np.ndarray:
            embedded.extend(texts)
            return super().embed(texts)

    index = LessonIndex(Counting())
    index.add(7, "alice", "a lesson delivered twice")
    index.add(7, "alice", "a lesson delivered twice")
    index.add_many([(7, "alice", "a lesson delivered twice"), (8, "bob", "another")])
    assert embedded == ["a lesson delivered twice", "another"]
    assert len(index) == 2
    assert [h.lesson_id for h in index.search("alice", "lesson", k=5)] == [7]


def test_remove_user_forgets_only_that_users_lessons():
    index = LessonIndex(HashingEmbedder())
    index.add_many(LESSONS)
    assert index.remove_user("alice") == 3
    assert len(index) == 2
    assert index.search("alice", "time zone", k=5) == []
    assert [h.lesson_id for h in index.search("bob", "time zone", k=1)] == [4]
    assert index.remove_user("alice") == 0


def test_rebuild_replaces_the_index_with_the_stores_lessons():
    index = LessonIndex(HashingEmbedder())
    index.add(99, "alice", "a lesson the store no longer has")
    index.rebuild(Lesson(id=i, user_id=u, text=t) for i, u, t in LESSONS)
    assert len(index) == len(LESSONS)
    assert all(h.lesson_id != 99 for h in index.search("alice", "a lesson the store no longer has", k=5))
    assert index.search("bob", "greetings", k=1)[0].lesson_id == 5


def test_index_survives_concurrent_adds_and_searches():
    index = LessonIndex(HashingEmbedder())
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for i in range(50):
                lesson_id = worker * 1000 + i
                index.add(lesson_id, f"user{worker}", f"lesson {i} for worker {worker}")
                assert all(h.user_id == f"user{worker}" for h in index.search(f"user{worker}", "lesson", 5))
        except BaseException as exc:  # noqa: BLE001 - surfaced to the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(index) == 200


def _random_lessons(n: int, user: str, start: int, seed: int) -> list[tuple[int, str, str]]:
    rng = np.random.default_rng(seed)
    words = ["time", "home", "list", "note", "city", "tea", "train", "km", "miles", "Lisbon", "Tokyo", "Sam"]
    return [(start + i, user, " ".join(rng.choice(words, 6)) + f" {i}") for i in range(n)]


def test_a_user_with_many_lessons_is_searched_approximately_with_high_recall_and_still_alone():
    index = LessonIndex(HashingEmbedder(), approximate_from=500)
    index.add_many(_random_lessons(1500, "alice", 1, seed=0))
    index.add_many(_random_lessons(50, "bob", 10_000, seed=1))
    alice, bob = index._shelves["alice"], index._shelves["bob"]
    assert alice.approximate is not None and alice.trained_on == 1500 and bob.approximate is None
    exact = LessonIndex(HashingEmbedder(), approximate_from=10**9)  # the same lessons, searched exactly
    exact.add_many(_random_lessons(1500, "alice", 1, seed=0))
    queries = [text for _, _, text in _random_lessons(40, "q", 0, seed=2)]
    recall = np.mean([len({h.lesson_id for h in index.search("alice", q, 5)} &
                          {h.lesson_id for h in exact.search("alice", q, 5)}) / 5 for q in queries])  # fmt: skip
    assert recall >= 0.95
    assert all(h.user_id == "bob" and h.lesson_id >= 10_000 for q in queries for h in index.search("bob", q, 5))


def test_removal_replacement_and_growth_reach_the_approximate_index():
    index = LessonIndex(HashingEmbedder(), approximate_from=300)
    index.add_many(_random_lessons(400, "alice", 1, seed=3))
    shelf = index._shelves["alice"]
    assert shelf.approximate is not None and shelf.trained_on == 400
    index.add(7, "alice", "Sam lives in Tokyo: his time is Tokyo time")  # replaces lesson 7's text
    assert index.search("alice", "Sam lives in Tokyo: his time is Tokyo time", 1)[0].lesson_id == 7
    assert index.remove(7) and all(h.lesson_id != 7 for h in index.search("alice", "Sam lives in Tokyo", 5))
    assert shelf.approximate.ntotal == shelf.exact.ntotal == 399
    index.add_many(_random_lessons(500, "alice", 1000, seed=4))  # doubled since training: trained again
    assert index._shelves["alice"].trained_on == 899 and len(index) == 899
    assert index.remove_user("alice") == 899 and index.search("alice", "Tokyo", 5) == [] and len(index) == 0
