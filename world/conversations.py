"""Supervised conversations for the demo policy, in exactly the format whet serves.

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
- ``thanks``: an answer, the user's thanks, a short reply.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from whet.config.settings import AgentConfig
from whet.learner.judge import correction_hint
from whet.learner.lessons import lesson_text
from whet.learner.prompt import openai_tool_spec, render_tool_result, with_hint, with_lessons
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

TRAINING = NATURAL
"""What the demo policy trains on: the values users of the assistant world say. (Hundreds of
values per kind, so that only copying would get them right, taught a model of this size no
copying at all in five minutes on 2 CPU cores; see the closing note of issue #4.)"""

KINDS = {"general": 0.27, "guess": 0.1, "lesson": 0.37, "hint": 0.1, "correction": 0.1, "thanks": 0.06}
THANKS_REPLIES = ("You're welcome!", "Glad to help.", "Any time!")


@dataclass
class Example:
    kind: str
    messages: list[dict[str, Any]]  # system first; assistant messages are the targets
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
        result = self.loop.run_until_complete(self.owner[use.name].call_tool(use.name, dict(use.arguments)))
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
    def __init__(self, tools: BundledTools, seed: int, vocab: Vocabulary) -> None:
        self.tools = tools
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.system = AgentConfig().system_prompt

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
        call = {"name": task.call.name, "arguments": json.dumps(dict(task.call.arguments))}
        return lesson_text(task.text, calls=[call])

    def _distractors(self, n: int, avoid: Task | None) -> list[str]:
        out = []
        while len(out) < n:
            intent = self.rng.choice(PERSONAL + GENERAL)
            other = make_task(intent, self.rng, random_profile(self.rng, self.vocab), vocab=self.vocab)
            if avoid is not None and other.intent == avoid.intent and other.call == avoid.call:
                continue
            if other.personal or self.rng.random() < 0.5:
                out.append(self._lesson(other))
        return out

    def example(self) -> Example:
        kind = self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        profile = random_profile(self.rng, self.vocab)
        personal = kind in ("guess", "lesson", "hint", "correction") or (kind == "thanks" and self.rng.random() < 0.5)
        intent = self.rng.choice(PERSONAL if personal else GENERAL)
        task = make_task(intent, self.rng, profile, heldout=self.rng.random() < 0.2, vocab=self.vocab)
        lessons: list[str] = []
        user = task.text
        if kind == "general" and self.rng.random() < 0.4:
            lessons = self._distractors(self.rng.randint(1, 3), None)
        elif kind == "lesson":
            # the lesson came from an earlier request of the same intent (and person), phrased differently
            same = replace(profile, people={task.meta["person"]: profile.people[task.meta["person"]]}) \
                if "person" in task.meta else profile
            lesson = self._lesson(make_task(intent, self.rng, same, vocab=self.vocab))
            lessons = self._distractors(self.rng.randint(0, 3), task)
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
            messages.append({"role": "user", "content": self.rng.choice(("Thanks!", "Great, thanks.", "Thank you!"))})
            messages.append({"role": "assistant", "content": self.rng.choice(THANKS_REPLIES)})
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


def examples(n: int, seed: int = 0, vocab: Vocabulary | None = None) -> Iterator[Example]:
    """``n`` training conversations, deterministic per seed (the clock is simulated).

    ``vocab``: the values tasks are made of (default :data:`TRAINING`)."""
    with tempfile.TemporaryDirectory(prefix="whet-sft-") as folder:
        tools = BundledTools(Path(folder))
        try:
            maker = ExampleMaker(tools, seed, vocab or TRAINING)
            for _ in range(n):
                yield maker.example()
        finally:
            tools.close()
