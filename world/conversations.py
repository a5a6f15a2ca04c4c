"""Warm-start conversations for the default model, in exactly the format whet serves.

Every example is a conversation the agent could have had: the agent's system
prompt (with retrieved lessons, when there are any), the bundled servers' tool
list, the user's request, the tool call, the tool's real output (the bundled
MCP servers run in-process here, and their results are rendered as the tool
pool renders them), and the final answer. The tasks come from the assistant
world (``whet.world.tasks``), with random preferences, so that the policy
learns to *read* preferences rather than to know any one user's:

- ``general``: a general task, sometimes beside unrelated lessons;
- ``guess``: a personal task with nothing in context; the right value is
  random, so the policy can only guess (this is where a new user starts);
- ``lesson``: a personal task with a lesson that says the value (a hint as
  the learner phrases it, or a call that was right), among unrelated lessons;
- ``hint``: a personal task whose user message carries ``[hint] ...``, as the
  learner's teacher sees it in hindsight distillation;
- ``correction``: a wrong answer, then the user's correction, then the redo;
- ``thanks``: an answer, the user's thanks, a short reply;
- ``chat``: a request no tool answers (small talk, facts, writing), answered in the base
  model's own words (self-distilled before fine-tuning), so that it keeps chatting and
  does not call a tool for everything.

In ``correction`` and ``thanks`` the first answer is history as a client sends it back, in
words: only the replies after the last user message are taught
(:func:`whet.world.warmstart.conversation_text`).

Values come from :func:`training_vocabulary`, far wider than what the simulated users say (every city the
clock server knows by name, many list names and people), so that the only way to get a
preference right is to copy it from the context.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from importlib import resources
from pathlib import Path
from typing import Any

from whet.config.settings import AgentConfig
from whet.learner.judge import correction_hint
from whet.learner.lessons import lesson_text
from whet.learner.prompt import openai_tool_spec, render_tool_result, with_hint, with_lessons
from whet.memory.index import LessonIndex
from whet.world.tasks import (
    DISTANCE_UNITS,
    GENERAL,
    NATURAL,
    PERSONAL,
    TEMPERATURE_UNITS,
    Profile,
    Task,
    ToolUse,
    Vocabulary,
    make_task,
)


def _clock_cities(zones: Iterable[str] | None = None) -> tuple[str, ...]:
    """Every city name the clock server resolves: the last part of each regional IANA zone
    (of ``zones``; by default every zone this machine knows)."""
    from zoneinfo import available_timezones

    from whet.servers.clock import ClockError, resolve_timezone

    regions = ("Africa", "America", "Asia", "Atlantic", "Australia", "Europe", "Indian", "Pacific")
    names = set()
    for zone in available_timezones() if zones is None else zones:
        region, _, city = zone.partition("/")
        if region in regions and city and "/" not in city:
            name = city.replace("_", " ")
            try:
                resolve_timezone(name)
            except ClockError:
                continue
            names.add(name)
    return tuple(sorted(names))


_PEOPLE = (
    "Mum", "Dad", "Sam", "Alex", "Grandma", "Grandpa", "Maria", "Tom", "Priya", "Leo", "Nina", "Omar", "Kate",
    "Yuki", "Ahmed", "Lucia", "Ben", "Chloe", "Diego", "Elena", "Felix", "Hana", "Ivan", "Jonas", "Kofi", "Lena",
    "Marco", "Noor", "Oscar", "Paula", "Quinn", "Rosa", "Sven", "Tara", "Uma", "Victor", "Wen", "Zoe", "Aunt May",
    "Uncle Joe", "Carlos", "Mei", "Raj", "Sofia", "Liam", "Emma", "Noah", "Olivia", "Ana", "Pedro", "Ines",
    "Jack", "Ruth", "Hugo", "Ada", "Kenji", "Fatima", "Oliver",
)
_LISTS = (
    "errands", "home", "work", "shopping", "groceries", "personal", "family", "garden", "chores", "weekend",
    "health", "travel", "car", "school", "reminders", "inbox", "projects", "admin", "kitchen", "office", "house",
    "gym", "kids", "pets", "bills", "holiday", "party", "study", "music", "books", "garage", "wedding", "moving",
    "daily", "later", "someday", "urgent", "phone", "finance", "hobby", "art", "camping", "cleaning", "repairs",
    "birthday", "todo", "tasks", "side project", "clients", "team", "taxes", "bike", "boat", "cottage",
    "backlog", "today", "tomorrow",
)
_THINGS = (
    "book a table for Friday", "buy stamps", "send mum the photos", "call the plumber", "buy dog food",
    "update my CV", "pay the water bill", "collect the dry cleaning", "book a haircut", "buy sunscreen",
    "check the mail", "get a new charger", "water the lawn", "order pizza", "write to the council",
    "reply to Tom", "sign the form", "pack for the trip", "defrost the freezer",
)


def training_vocabulary(*, pinned_zones: bool = False) -> Vocabulary:
    """The values warm-start conversations are made of: :data:`NATURAL` widened (see the module doc).
    ``pinned_zones`` takes the cities from the ``tzdata`` package's zone list alone (its version is
    pinned), not from every zone this machine knows, so that a shipped file made of them is the
    same wherever it is regenerated."""
    zones = resources.files("tzdata").joinpath("zones").read_text().split() if pinned_zones else None
    return Vocabulary(cities=_clock_cities(zones), people=_PEOPLE, lists=_LISTS,
                      things=(*NATURAL.things, *_THINGS))


# Requests no tool answers; each maker is a template over one topic list. The bench's chat probe
# (whet.world.tasks.CHAT_PROBE) asks other things, so it measures chat the model was not trained on.
_CHAT_TOPICS: dict[str, tuple[str, ...]] = {
    "Tell me a fun fact about {}.": (
        "cats", "dogs", "octopuses", "owls", "bees", "dolphins", "elephants", "penguins", "horses", "ants",
        "sharks", "parrots", "frogs", "whales", "foxes"),
    "Write a haiku about {}.": (
        "autumn", "the sea", "coffee", "rain", "mountains", "friendship", "the moon", "spring", "snow", "morning"),
    "What is the capital of {}?": (
        "Japan", "France", "Canada", "Brazil", "Egypt", "Italy", "Kenya", "Norway", "Peru", "India", "Spain"),
    "Explain {} in one sentence.": (
        "gravity", "photosynthesis", "inflation", "a black hole", "democracy", "the internet", "a vaccine",
        "recursion", "evolution", "electricity"),
    "Give me a tip for {}.": (
        "sleeping better", "learning a language", "running a first 5k", "saving money", "public speaking",
        "studying", "cooking rice", "staying focused"),
    "{}": (
        "Hi!", "Hello, how are you?", "Good morning!", "Who are you?", "Tell me a joke.",
        "What should I cook for dinner tonight?", "Why is the sky blue?", "Can you recommend a good book?",
        "I'm bored, any ideas?", "How do I make a cup of tea?", "What is the meaning of life?",
        "What's a good name for a goldfish?", "How many legs does a spider have?", "Who wrote Romeo and Juliet?",
        "What is the largest planet?", "Say something nice.", "How do rainbows form?",
        # small talk, feelings, opinions, how-to, advice and word meanings (here and below): the kinds of chat
        # that a model which learned the tools turns into add_note calls ("I'm feeling a bit tired today.")
        "Hey, what's up?", "How's it going?", "Good afternoon!", "Hello again!", "Are you there?",
        "Thanks, you're great.", "Can we just chat for a bit?", "Do you ever sleep?", "Are you a person?",
        "Do you have feelings?", "What are you good at?", "Where do you live?"),
    "I'm feeling {} today.": ("happy", "stressed", "a bit sad", "lonely", "excited", "sleepy", "grumpy", "proud"),
    "What's your favourite {}?": ("food", "book", "holiday", "number", "sport", "flower", "word", "planet"),
    "Do you like {}?": ("pizza", "football", "poetry", "the rain", "jazz", "dogs", "winter", "board games"),
    "How do I {}?": (
        "make pancakes", "wash a wool jumper", "plant tomatoes", "fix a squeaky door", "make friends in a new city",
        "remove a coffee stain", "stop procrastinating", "learn to juggle"),
    "How can I {}?": (
        "sleep better", "be more patient", "eat more vegetables", "stay calm before a meeting", "keep my plants alive",
        "get better at chess", "make my mornings easier"),
    "What does '{}' mean?": (
        "bon appetit", "c'est la vie", "hakuna matata", "ad hoc", "status quo", "faux pas", "alter ego", "per se"),
    "What does the word '{}' mean?": (
        "ubiquitous", "melancholy", "resilient", "nostalgia", "eloquent", "curious", "meticulous", "whimsical"),
    "Can you recommend {}?": (
        "a podcast", "a hobby I can do at home", "a classic novel", "a board game for two", "a houseplant for beginners",
        "a song to cheer me up", "a snack for a long walk"),
    "Any advice for {}?": (
        "a first day at a new job", "a long flight", "moving house", "a first date", "learning to cook",
        "writing a thank-you card"),
}
CHAT_PROMPTS = tuple(template.format(topic) for template, topics in _CHAT_TOPICS.items() for topic in topics)


# The intents whose requests read alike: what similarity retrieval puts beside a request.
NEIGHBOURS: dict[str, tuple[str, ...]] = {
    "time_home": ("time_person", "time_city"), "time_person": ("time_person", "time_home", "time_city"),
    "time_city": ("time_city", "time_home", "time_person"),
    "distance": ("convert", "temperature"), "temperature": ("convert", "distance"),
    "convert": ("convert", "distance", "temperature"),
    "reminder": ("add_todo", "add_note"), "add_todo": ("add_todo", "reminder", "add_note"),
    "add_note": ("add_note", "reminder", "add_todo"),
    "weekday": ("weekday", "days_between", "add_days"), "days_between": ("days_between", "weekday", "add_days"),
    "add_days": ("add_days", "weekday", "days_between"), "calculate": ("calculate", "convert"),
}
# How many of each round of general requests are of an intent (1 when not listed). The
# calculator's requests share their words with the notes tool's name ("What's 22 plus 45?" ->
# add_note): at one a round, builds chose the calculator by under 0.4 nats (AMD, AVX-512) or lost
# it (Intel, AMX: "What is 63 * 6?" -> add_note); at two, by over 1.0 nats in all six builds made
# on the latter (bench/results/warmstart-builds-amx.txt).
GENERAL_DRAW = {"calculate": 2}
# Each kind's share of the conversations, dealt in shuffled rounds of 100 (a kind with no examples
# to give, chat without chats, is left out). Refused calls are one user's first contact with a new
# request the model cannot know ("What time is it at Sam's place?"), and at 3% one build made up a
# time after a refused clock call: 5%.
KINDS = {"general": 0.27, "guess": 0.06, "lesson": 0.21, "hint": 0.08, "correction": 0.08, "thanks": 0.05,
         "error": 0.05, "chat": 0.20}
# what a request's value turns into when the model writes it wrong: the tool refuses it
BAD_VALUES = ("home", "my place", "here", "local", "the usual", "there", "my list", "?")
THANKS_REPLIES = ("You're welcome!", "Glad to help.", "Any time!")
# what a person says after a good answer: thanks, or only that they read it; neither asks for
# anything, so the answer is a word back, never the last action again
ACKNOWLEDGEMENTS = ("Thanks!", "Great, thanks.", "Thank you!", "Thanks a lot.", "Cheers!", "Perfect.", "Nice, thanks.",
                    "Ok.", "Okay.", "OK, got it.", "Got it.", "Cool.", "Alright.", "Good to know.", "Sounds good.",
                    "Makes sense.", "That's right, thanks.", "Yes, that's it.", "Great.", "Fine.")
# the kinds whose distractor lessons a ranker draws (ExampleMaker's ``ranked``)
RANKED_KINDS = ("general", "guess", "lesson", "chat")
ACK_REPLIES = ("Glad to help.", "Any time!", "Let me know if you need anything else.", "Happy to help.")


Ranker = Callable[[str, Sequence[str]], Sequence[float]]
"""(a request, lesson texts) -> each lesson's similarity to the request, as retrieval scores it."""


def retrieval_ranker(index: LessonIndex) -> Ranker:
    """A :data:`Ranker` that scores as ``index``'s lesson search does (:meth:`LessonIndex.scores`: a lesson by the
    closer of its keys to the request)."""

    def rank(request: str, lessons: Sequence[str]) -> list[float]:
        query = index.embedder.embed([request])  # [1, dim]
        return [float(index.scores(query, text)[0]) for text in lessons]

    return rank


@dataclass
class Example:
    kind: str
    messages: list[dict[str, Any]]  # system first; the assistant messages after the last user message are the targets
    tools: list[dict[str, Any]]


class BundledTools:
    """The bundled notes, calc and clock servers, in-process, in the order config/mcp.json lists them."""

    def __init__(self, folder: Path) -> None:
        from whet.servers import calc, clock, notes

        self.instant = datetime(2026, 11, 21, 9, 30, tzinfo=UTC)
        self.servers = [notes.build_server(folder / "notes.db", now=lambda: self.instant), calc.build_server(),
                        clock.build_server(now=lambda: self.instant)]
        self.loop = asyncio.new_event_loop()
        self.specs: list[dict[str, Any]] = []
        self.owner: dict[str, Any] = {}
        for server in self.servers:
            for tool in self.loop.run_until_complete(server.list_tools()):
                self.specs.append(openai_tool_spec(tool.name, tool.description or "", tool.input_schema))
                self.owner[tool.name] = server

    def call(self, use: ToolUse) -> str:
        """The tool's result as the model reads it; a failure is an ``error: ...`` result, as the
        tool pool gives it (an unknown tool, bad arguments), never an exception."""
        server = self.owner.get(use.name)
        if server is None:
            return f"error: unknown tool '{use.name}'; available tools: {', '.join(self.owner)}"
        try:
            result = self.loop.run_until_complete(server.call_tool(use.name, dict(use.arguments)))
        except Exception as exc:  # the in-process server raises what a stdio server reports as an error
            return f"error: {exc}"
        text = render_tool_result(result)
        return f"error: {text}" if result.is_error else text

    def close(self) -> None:
        self.loop.close()


def random_profile(rng: random.Random, vocab: Vocabulary) -> Profile:
    people = rng.sample(list(vocab.people), 3)
    return Profile(
        name="sft", user="sft", home=rng.choice(vocab.cities), people={p: rng.choice(vocab.cities) for p in people},
        distance_unit=rng.choice([u for u in DISTANCE_UNITS if u != "kilometers"]),
        temperature_unit=rng.choice([u for u in TEMPERATURE_UNITS if u != "celsius"]),
        reminders_list=rng.choice(vocab.lists),
    )


def success_lesson(task: Task) -> str:
    """The lesson a thanked request leaves, as the learner writes it: ``task``'s right call."""
    call = {"name": task.call.name, "arguments": json.dumps(dict(task.call.arguments))}
    return lesson_text(task.text, calls=[call])


def answer_for(task: Task, call: ToolUse, result: str) -> str:
    """The final answer a careful assistant gives after the tool's result."""
    if result.startswith("error:"):
        return "Sorry, that did not work: " + result[len("error:"):].strip()
    r = json.loads(result)
    name = call.name
    if name == "now":
        return f"It is {r['time'][:5]} on {r['weekday']} in {call.arguments['timezone']}."
    if name == "convert" or name == "days_between":
        return f"{r['text']}."
    if name == "calculate":
        return f"The answer is {r['text']}."
    if name == "add_note":
        if r["kind"] == "todo":
            return f"Added \"{r['text']}\" to your {r['list']} list."
        return f"Saved the note: {r['text']}."
    if name == "weekday":
        return f"{r['date']} is a {r['weekday']}."
    if name == "add_to_date":
        return f"That is {r['weekday']}, {r['date']}."
    raise ValueError(f"no answer form for tool {name}")


class ExampleMaker:
    """``chats``: (request, answer) pairs for the ``chat`` kind; without them that kind is not drawn.

    ``rank`` and ``lookalikes``: with a ranker, each distractor lesson is the nearest to the request, as retrieval
    scores it, of ``lookalikes`` candidates of any personal intent (:meth:`_distractors`), for the kinds
    ``ranked`` names; otherwise distractors are drawn by neighbouring intent. ``general_lessons``: the share of
    ``general`` requests shown distractor lessons at all."""

    def __init__(self, tools: BundledTools, seed: int, vocab: Vocabulary,
                 chats: Sequence[tuple[str, str]] = (), rank: Ranker | None = None, lookalikes: int = 0,
                 ranked: Sequence[str] = RANKED_KINDS, general_lessons: float = 0.6) -> None:  # fmt: skip
        if rank is not None and lookalikes < 1:
            raise ValueError(f"lookalikes must be at least 1 with a ranker, not {lookalikes}")
        if unknown := set(ranked) - set(KINDS):
            raise ValueError(f"ranked names kinds that do not exist: {sorted(unknown)}; kinds are {sorted(KINDS)}")
        if not 0 <= general_lessons <= 1:
            raise ValueError(f"general_lessons is a share, from 0 to 1, not {general_lessons}")
        self.tools = tools
        self.vocab = vocab
        self.chats = list(chats)
        self.rank, self.lookalikes, self.ranked, self.general_lessons = rank, lookalikes, set(ranked), general_lessons
        self.kinds = {k: w for k, w in KINDS.items() if k != "chat" or self.chats}
        self.rng = random.Random(seed)
        # a round of kinds, and of general intents; each deck holds what is left of its round (:meth:`_deal`)
        self._kind_round = [k for k, share in self.kinds.items() for _ in range(round(100 * share))]
        self._general_round = [i for i in GENERAL for _ in range(GENERAL_DRAW.get(i, 1))]
        self._decks: dict[Any, list[str]] = {}
        self.system = AgentConfig().system_prompt

    def _deal(self, deck: Any, whole: Sequence[str]) -> str:
        """The next of ``deck``, dealt from shuffled rounds of ``whole`` rather than drawn one by one: a
        few hundred conversations hold only a dozen or so of each intent, and a kind such as ``error`` a
        dozen in all; independent draws left some intents with half the others' share, and one build's
        conversations held a single refused clock call (its model then made up a time after one). Kinds
        are one deck; each kind deals its intents from a deck of its own (:data:`GENERAL_DRAW` times
        for a general one)."""
        left = self._decks.setdefault(deck, [])
        if not left:
            left.extend(whole)
            self.rng.shuffle(left)
        return left.pop()

    def _solve(self, task: Task, call: ToolUse | None = None) -> list[dict[str, Any]]:
        """Assistant call, tool result, final answer."""
        call = call or task.call
        self.tools.instant = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=self.rng.randrange(525_600))
        result = self.tools.call(call)
        call_id = f"call_{self.rng.getrandbits(48):012x}"
        arguments = json.dumps(dict(call.arguments), ensure_ascii=False)
        return [
            {"role": "assistant", "content": "",
             "tool_calls": [{"id": call_id, "type": "function", "function": {"name": call.name, "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": call_id, "name": call.name, "content": result},
            {"role": "assistant", "content": answer_for(task, call, result)},
        ]

    def _lesson(self, task: Task) -> str:
        """A lesson as the learner writes it, from another request of the same intent and value."""
        if task.correction and self.rng.random() < 0.6:
            return lesson_text(task.text, hint=correction_hint(task.correction))
        return success_lesson(task)

    def _distractors(self, n: int, avoid: Task | None, near: Task | None = None, request: str | None = None) -> list[str]:
        """``n`` lessons that do not answer ``avoid``'s request. Beside ``near``, most are of the
        intents that read like it (:data:`NEIGHBOURS`), as similarity retrieval brings them: a
        lesson about the time at home beside "What time is it in Cairo?", another person's city
        beside a question about Sam. The policy learns that the value a request names, or the
        lesson about *this* request, wins over a lesson that only looks alike.

        With a ranker (``self.rank``) and the ``request`` they are shown to, they are the ``n`` nearest to it of
        ``n * lookalikes`` lessons of any personal intent, nearest first: what retrieval shows a request,
        whatever its intent. Drawn by intent, a date sum was rarely shown a time lesson, nor a chat any lesson like it, and
        in bench runs both were (run FK: "What date is 23 days after 2027-07-02?", shown jun's time lessons,
        called ``now(Seoul)``; bench/results/RUNS.md, stop 78)."""
        if self.rank is not None and request is not None and n > 0:
            pool = self._lessons_of(n * self.lookalikes, avoid, None, any_personal=True)
            scores = self.rank(request, pool)
            return [pool[i] for i in sorted(range(len(pool)), key=lambda i: -scores[i])[:n]]
        return self._lessons_of(n, avoid, near)

    def _lessons_of(self, n: int, avoid: Task | None, near: Task | None, any_personal: bool = False) -> list[str]:
        """:meth:`_distractors` by intent; ``any_personal``: of any personal intent, what a user's lessons are about (a
        general request's right call passes only what it said, and teaches none: ``learner.lessons.says_more``)."""
        out = []
        while len(out) < n:
            if any_personal:
                pool = PERSONAL
            else:
                pool = NEIGHBOURS[near.intent] if near is not None and self.rng.random() < 0.75 else PERSONAL + GENERAL
            intent = self.rng.choice(pool)
            other = make_task(intent, self.rng, random_profile(self.rng, self.vocab), vocab=self.vocab)
            if avoid is not None and other.intent == avoid.intent and (
                    other.call == avoid.call or other.meta.get("person") == avoid.meta.get("person")):
                continue  # the same request with another value would contradict the lesson that answers it
            if other.personal or near is not None or self.rng.random() < 0.5:
                out.append(self._lesson(other))
        return out

    def _ranks(self, kind: str, request: str) -> str | None:
        """``request``, where ``kind``'s distractors are drawn as retrieval ranks them (``ranked``); else None."""
        return request if kind in self.ranked else None

    def _broken(self, call: ToolUse) -> ToolUse:
        """``call`` with one text argument written wrong, so that its tool refuses it."""
        keys = [k for k, v in call.arguments.items() if isinstance(v, str)]
        for _ in range(20):
            key = self.rng.choice(keys)
            broken = ToolUse(call.name, {**call.arguments, key: self.rng.choice(BAD_VALUES)})
            self.tools.instant = datetime(2026, 1, 1, tzinfo=UTC)
            if self.tools.call(broken).startswith("error:"):
                return broken
        return ToolUse(call.name, {})  # no arguments at all: every bundled tool refuses that

    def example(self) -> Example:
        kind = self._deal("kinds", self._kind_round)
        if kind == "chat":
            request, answer = self.rng.choice(self.chats)
            lessons = self._distractors(self.rng.randint(1, 3), None, request=self._ranks(kind, request)) \
                if self.rng.random() < 0.4 else []
            messages = [{"role": "system", "content": with_lessons(self.system, lessons)},
                        {"role": "user", "content": request}, {"role": "assistant", "content": answer}]
            return Example(kind, messages, self.tools.specs)
        profile = random_profile(self.rng, self.vocab)
        personal = kind in ("guess", "lesson", "hint", "correction") or (
            kind in ("thanks", "error") and self.rng.random() < 0.5)
        intent = self._deal((kind, personal), PERSONAL if personal else self._general_round)
        task = make_task(intent, self.rng, profile, heldout=self.rng.random() < 0.2, vocab=self.vocab)
        lessons: list[str] = []
        user = task.text
        if kind in ("general", "guess") and self.rng.random() < (self.general_lessons if kind == "general" else 0.6):
            lessons = self._distractors(self.rng.randint(1, 3), task if kind == "guess" else None, near=task,
                                        request=self._ranks(kind, task.text))  # fmt: skip
        elif kind == "lesson":
            # the lesson came from an earlier request of the same intent (and person), phrased differently
            same = replace(profile, people={task.meta["person"]: profile.people[task.meta["person"]]}) \
                if "person" in task.meta else profile
            lesson = self._lesson(make_task(intent, self.rng, same, vocab=self.vocab))
            lessons = self._distractors(self.rng.randint(0, 3), task, near=task, request=self._ranks(kind, task.text))
            # retrieval ranks by similarity, so the relevant lesson is usually first
            lessons.insert(0 if self.rng.random() < 0.7 else self.rng.randint(0, len(lessons)), lesson)
        elif kind == "hint":
            user = with_hint([{"role": "user", "content": task.text}], correction_hint(task.correction))[0]["content"]
        messages = [{"role": "system", "content": with_lessons(self.system, lessons)},
                    {"role": "user", "content": user}]
        if kind == "correction":
            wrong = make_task(intent, self.rng, random_profile(self.rng, self.vocab), vocab=self.vocab)
            wrong_call = ToolUse(task.call.name, {**task.call.arguments, **_preference_args(wrong, self.vocab)})
            if wrong_call == task.call:
                wrong_call = ToolUse(task.call.name, {**task.call.arguments, **_preference_args(task, self.vocab, other=True)})
            messages.append({"role": "assistant", "content": self._solve(task, wrong_call)[-1]["content"]})
            messages.append({"role": "user", "content": task.correction})
        elif kind == "thanks":
            messages.append({"role": "assistant", "content": self._solve(task)[-1]["content"]})
            ack = self.rng.choice(ACKNOWLEDGEMENTS)
            messages.append({"role": "user", "content": ack})
            replies = THANKS_REPLIES if "thank" in ack.lower() or "cheers" in ack.lower() else ACK_REPLIES
            messages.append({"role": "assistant", "content": self.rng.choice(replies)})
            return Example(kind, messages, self.tools.specs)
        elif kind == "error":
            # the call went wrong and the tool said so: the answer says it plainly, never echoes
            # the tool's markup, and makes up no value
            messages += self._solve(task, self._broken(task.call))
            return Example(kind, messages, self.tools.specs)
        messages += self._solve(task)
        return Example(kind, messages, self.tools.specs)


def _preference_args(task: Task, vocab: Vocabulary, other: bool = False) -> dict[str, Any]:
    """The arguments of ``task``'s call that carry its preference (another value when ``other``)."""
    key = {"now": "timezone", "convert": "to_unit", "add_note": "list_name"}[task.call.name]
    value = task.call.arguments[key]
    if other:
        pool = {"timezone": vocab.cities, "to_unit": DISTANCE_UNITS if task.intent == "distance" else TEMPERATURE_UNITS,
                "list_name": vocab.lists}[key]
        value = next(v for v in pool if v != value and v not in ("kilometers", "celsius"))
    return {key: value}


def examples(n: int, seed: int = 0, vocab: Vocabulary | None = None, chats: Sequence[tuple[str, str]] = (),
             rank: Ranker | None = None, lookalikes: int = 0, ranked: Sequence[str] = RANKED_KINDS,
             general_lessons: float = 0.6) -> Iterator[Example]:  # fmt: skip
    """``n`` training conversations, deterministic per seed (the clock is simulated).

    ``vocab``: the values tasks are made of (default :func:`training_vocabulary`); ``chats``:
    (request, answer) pairs for the ``chat`` kind (none: no chat examples); ``rank``, ``lookalikes``, ``ranked``,
    ``general_lessons``: distractor lessons as retrieval ranks them, and how many general requests see any
    (:class:`ExampleMaker`)."""
    with tempfile.TemporaryDirectory(prefix="whet-sft-") as folder:
        tools = BundledTools(Path(folder))
        try:
            maker = ExampleMaker(tools, seed, vocab or training_vocabulary(), chats, rank, lookalikes, ranked,
                                 general_lessons)  # fmt: skip
            for _ in range(n):
                yield maker.example()
        finally:
            tools.close()
