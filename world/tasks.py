"""The assistant world: tasks over the bundled MCP servers, each with a checker.

A :class:`Task` is one natural request ("What time is it at home?") plus what
doing it right means: the tool call a careful assistant makes (``task.call``)
and what its final answer must say. :meth:`Task.check` decides from the tool
calls the agent made and its final answer whether the task was done right; it
compares meaning, not spelling (``Lisbon`` and ``Europe/Lisbon`` are one zone,
``miles`` and ``mi`` one unit, ``17*23`` and ``17 * 23`` one expression).

*Personal* intents depend on a hidden preference of the user (a
:class:`Profile`): which city "home" is, where a person lives, the units they
think in, the list their reminders go to. *General* intents need none. The
demo policy is trained on the same intents with random preferences
(``whet.world.conversations``), so it can follow a lesson or hint but cannot know
a particular user until it has learned from them.

Profiles are data files (YAML); see ``config/profiles/default.yaml`` for the
format. Everything here is deterministic for a given seed.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import date, timedelta
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from whet.servers import units
from whet.servers.calc import CalcError, evaluate, format_number
from whet.servers.clock import ClockError, resolve_timezone

# ----------------------------------------------------------------------------- vocabulary

CITIES = (
    "Lisbon", "Tokyo", "New York", "London", "Paris", "Berlin", "Sydney", "Chicago", "Denver",
    "Los Angeles", "Singapore", "Seoul", "Cairo", "Nairobi", "Mexico City", "Toronto", "Dubai",
    "Bangkok", "Helsinki", "Athens", "Moscow", "Istanbul", "Auckland", "Honolulu", "Shanghai",
    "Sao Paulo", "Jakarta", "Lagos", "Anchorage", "Vancouver", "Madrid", "Warsaw",
)
DISTANCE_UNITS = ("miles", "kilometers", "meters", "feet", "yards", "nautical miles")
TEMPERATURE_UNITS = ("fahrenheit", "celsius", "kelvin")
LISTS = (
    "errands", "home", "work", "shopping", "groceries", "personal", "family", "garden", "chores",
    "weekend", "health", "travel", "car", "school", "reminders", "inbox", "projects", "admin",
)
PEOPLE = ("Mum", "Dad", "Sam", "Alex", "Grandma", "Maria", "Tom", "Priya", "Leo", "Nina", "Omar", "Kate")
THINGS = (
    "buy milk", "call the bank", "water the plants", "book the dentist", "pay the electricity bill",
    "pick up the parcel", "renew my passport", "send the invoice", "return the library books",
    "buy a birthday card", "fix the bike tyre", "email the landlord", "order new glasses",
    "clean the fridge", "back up my laptop", "take out the recycling", "buy coffee beans",
    "call grandma", "check the tyre pressure", "cancel the gym trial", "print the tickets",
    "buy batteries", "feed the cat", "charge the camera", "wash the car", "pay the rent",
)
NOTES = (
    "the wifi password is on the router", "parking is on level 3", "the door code is 4471",
    "Maria likes tulips", "the meeting moved to Thursday", "my shoe size is 43",
    "the plumber's number is in the drawer", "the spare key is with Tom", "seat 14C on the train",
)
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


@dataclass(frozen=True)
class Vocabulary:
    """The values tasks are made of. :data:`NATURAL` is what users say; the demo policy trains
    on a much wider one (``whet.world.conversations``), so that copying a value from the request,
    a lesson or a tool result is the only way to get it right."""

    cities: Sequence[str] = CITIES
    people: Sequence[str] = PEOPLE
    lists: Sequence[str] = LISTS
    things: Sequence[str] = THINGS
    notes: Sequence[str] = NOTES
    distances: Sequence[int] = (3, 5, 8, 10, 12, 15, 21, 42, 50, 100, 7, 25)
    temperatures: Sequence[int] = (-5, 0, 12, 18, 21, 25, 30, 35, 180, 200, 220, 28)
    amounts: Sequence[int] = (2, 3, 5, 10, 12, 20, 25, 40, 64, 100)
    operands: tuple[int, int] = (2, 99)


NATURAL = Vocabulary()


@dataclass(frozen=True)
class ToolUse:
    """A tool call the agent made: the tool's name and its arguments (a dict)."""

    name: str
    arguments: Mapping[str, Any]


# ----------------------------------------------------------------------------- profiles


@dataclass(frozen=True)
class Profile:
    """A simulated user's hidden preferences (see config/profiles/default.yaml)."""

    name: str
    user: str
    home: str
    people: Mapping[str, str]
    distance_unit: str
    temperature_unit: str
    reminders_list: str
    requery_rate: float = 0.15
    thanks_rate: float = 0.7
    wrong_feedback_rate: float = 0.0  # share of replies that ignore what was right (random thanks or corrections)
    description: str = ""


DEFAULT_PROFILE = "default.yaml"
_PROFILE_KEYS = {
    "name", "user", "description", "home", "people", "distance_unit", "temperature_unit",
    "reminders_list", "behaviour",
}


def load_profile(path: str | Path | None = None) -> Profile:
    """The profile in ``path`` (YAML), or the shipped default; ValueError says what is wrong."""
    if path is None:
        text = resources.files("whet.config").joinpath("profiles", DEFAULT_PROFILE).read_text()
        where = f"whet/config/profiles/{DEFAULT_PROFILE}"
    else:
        where = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"cannot read profile {where}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"profile {where} is not valid YAML: {exc}") from None
    return parse_profile(data, where)


def parse_profile(data: Any, where: str = "profile") -> Profile:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping of preference keys, got {type(data).__name__}")
    unknown = sorted(set(data) - _PROFILE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown keys {', '.join(unknown)}; allowed: {', '.join(sorted(_PROFILE_KEYS))}")
    missing = [k for k in ("name", "home", "people", "distance_unit", "temperature_unit", "reminders_list")
               if not data.get(k)]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    people = data["people"]
    if not isinstance(people, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in people.items()):
        raise ValueError(f"{where}: people must map nicknames to cities, e.g. {{Sam: Tokyo}}")
    for city in [data["home"], *people.values()]:
        _zone_or_error(city, where)
    for key, dimension in (("distance_unit", "length"), ("temperature_unit", "temperature")):
        _unit_or_error(str(data[key]), dimension, f"{where}: {key}")
    behaviour = data.get("behaviour") or {}
    rates = {}
    for key in ("requery_rate", "thanks_rate", "wrong_feedback_rate"):
        if key in behaviour:
            value = behaviour[key]
            if not isinstance(value, int | float) or not 0 <= value <= 1:
                raise ValueError(f"{where}: behaviour.{key} must be a number from 0 to 1, got {value!r}")
            rates[key] = float(value)
    return Profile(
        name=str(data["name"]), user=str(data.get("user") or data["name"]), home=str(data["home"]),
        people=dict(people), distance_unit=str(data["distance_unit"]),
        temperature_unit=str(data["temperature_unit"]), reminders_list=str(data["reminders_list"]),
        description=str(data.get("description") or ""), **rates,
    )


def _zone_or_error(city: str, where: str) -> str:
    try:
        return resolve_timezone(city)[0]
    except ClockError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _unit_or_error(name: str, dimension: str, where: str) -> str:
    try:
        unit = units.find_unit(name)
    except units.UnitError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if unit.dimension != dimension:
        raise ValueError(f"{where}: {name!r} is a unit of {unit.dimension}, not {dimension}")
    return unit.symbol


# ----------------------------------------------------------------------------- tasks

_TIME = re.compile(r"\b\d{1,2}:\d{2}\b")


@dataclass(frozen=True)
class Task:
    """One request and what doing it right means.

    ``call``: the tool call that does it (arguments as a careful assistant would write them).
    ``answer``: what the final answer must contain (``shows``: any one of these strings, case
    folded; ``pattern``: a regex). ``preference``: the hidden value a personal task turns on,
    and ``correction``: what the user says when the answer misses it.
    """

    intent: str
    text: str
    call: ToolUse
    personal: bool = False
    shows: tuple[str, ...] = ()
    pattern: str | None = None
    preference: str | None = None
    correction: str | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)

    def check(self, calls: Sequence[ToolUse], answer: str) -> bool:
        """Done right: one of ``calls`` matches :attr:`call` and ``answer`` says what it must."""
        return any(calls_match(self.call, c) for c in calls) and self.answer_ok(answer)

    def answer_ok(self, answer: str) -> bool:
        """What the user can see: the answer states the result (and the preference, if any)."""
        text = answer.casefold()
        if self.shows and not any(s.casefold() in text for s in self.shows):
            return False
        return self.pattern is None or re.search(self.pattern, answer) is not None

    def mentions_preference(self, answer: str) -> bool:
        return self.preference is None or any(
            s.casefold() in answer.casefold() for s in _aliases(self.intent, self.preference)
        )


def calls_match(expected: ToolUse, actual: ToolUse) -> bool:
    """The same tool with the same meaning of every expected argument."""
    if actual.name != expected.name or not isinstance(actual.arguments, Mapping):
        return False
    for key, want in expected.arguments.items():
        if key not in actual.arguments:
            return False
        if not _SAME[_KIND.get(key, "text")](want, actual.arguments[key]):
            return False
    return True


def _same_zone(a: Any, b: Any) -> bool:
    try:
        return resolve_timezone(str(a))[0] == resolve_timezone(str(b))[0]
    except ClockError:
        return False


def _same_unit(a: Any, b: Any) -> bool:
    try:
        return units.find_unit(str(a)).symbol == units.find_unit(str(b)).symbol
    except units.UnitError:
        return False


def _same_number(a: Any, b: Any) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9)
    except (TypeError, ValueError):
        return False


def _same_expression(a: Any, b: Any) -> bool:
    try:
        return math.isclose(float(evaluate(str(a))), float(evaluate(str(b))), rel_tol=1e-9)
    except (CalcError, ValueError, TypeError, OverflowError):
        return False


def _same_text(a: Any, b: Any) -> bool:
    return _words(str(a)) == _words(str(b))


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.casefold())


_SAME: dict[str, Callable[[Any, Any], bool]] = {
    "zone": _same_zone, "unit": _same_unit, "number": _same_number, "expression": _same_expression,
    "text": _same_text,
}
_KIND = {
    "timezone": "zone", "from_unit": "unit", "to_unit": "unit", "value": "number", "days": "number",
    "expression": "expression",
}


def _aliases(intent: str, value: str) -> list[str]:
    """Ways an answer may name a preference value: Lisbon / Europe/Lisbon, miles / mi."""
    if intent in ("time_home", "time_person"):
        return [value, _zone_or_error(value, "preference")]
    if intent in ("distance", "temperature"):
        return [value, units.find_unit(value).symbol]
    return [value]


# ----------------------------------------------------------------------------- intents

# Each intent: (name, personal, phrasings). A phrasing's fields come from the intent's maker.
# The last phrasing of every intent is held out: training interactions never use it.
PHRASINGS: dict[str, tuple[str, ...]] = {
    "time_home": (
        "What time is it at home?", "What's the time back home right now?", "Is it late at home?",
        "Tell me the time at home.", "What time is it back home now?",
    ),
    "time_person": (
        "What time is it for {person}?", "Is it late for {person} right now?", "What's the time where {person} is?",
        "Can I call {person} now, what time is it there?", "What time is it at {person}'s place?",
    ),
    "distance": (
        "I ran {value} km today, how far is that?", "How far is {value} km?", "The trail is {value} km long. How long is that?",
        "The hotel is {value} km from the airport, how far is that?", "How much is {value} km?",
    ),
    "temperature": (
        "The forecast says {value} degrees Celsius. How warm is that?", "It's {value} °C outside, what is that?",
        "The oven recipe says {value} °C. What's that?", "The pool is {value} degrees Celsius, how warm is that?",
        "How hot is {value} °C?",
    ),
    "reminder": (
        "Remind me to {thing}.", "Please remind me to {thing}.", "Don't let me forget to {thing}.",
        "I need a reminder to {thing}.", "Can you remind me to {thing}?",
    ),
    "time_city": (
        "What time is it in {city}?", "What's the time in {city} right now?", "Tell me the current time in {city}.",
        "Is it night in {city}? What time is it there?",
    ),
    "calculate": (
        "What is {a} times {b}?", "What's {a} plus {b}?", "Calculate {a} minus {b}.", "What is {a} * {b}?",
        "How much is {a} + {b}?",
    ),
    "convert": (
        "Convert {value} {source} to {target}.", "How many {target} is {value} {source}?",
        "What is {value} {source} in {target}?", "{value} {source} in {target}, please.",
    ),
    "add_todo": (
        "Add {thing} to my {list} list.", "Put {thing} on the {list} list.", "Add a todo to my {list} list: {thing}.",
        "On my {list} list, add {thing}.",
    ),
    "add_note": (
        "Take a note: {note}.", "Note that {note}.", "Please write down that {note}.", "Save a note: {note}.",
    ),
    "weekday": (
        "What day of the week is {date}?", "Which weekday is {date}?", "What weekday does {date} fall on?",
    ),
    "days_between": (
        "How many days are there from {start} to {end}?", "How many days between {start} and {end}?",
        "Count the days from {start} until {end}.",
    ),
    "add_days": (
        "What date is {days} days after {date}?", "Which date is {days} days from {date}?",
        "Add {days} days to {date}.",
    ),
}
# Requests no tool answers, for the bench's chat probe: general skill includes answering these
# without calling a tool. None of them is in the warm start's training chats
# (whet.world.conversations.CHAT_PROMPTS), so the probe measures chat the model was not trained on.
CHAT_PROBE = (
    "What's your favourite colour?", "Can you write a limerick about a cat?", "How do I tie a tie?",
    "What is the tallest mountain in the world?", "Give me three ideas for a rainy day.",
    "What's the difference between a virus and bacteria?", "Write a two-line poem about the sun.",
    "How are you today?", "Recommend a movie for tonight.", "What does 'carpe diem' mean?",
    "Tell me something interesting about space.", "How can I be more productive?",
)
PERSONAL = ("time_home", "time_person", "distance", "temperature", "reminder")
GENERAL = ("time_city", "calculate", "convert", "add_todo", "add_note", "weekday", "days_between", "add_days")
_OPS = (("times", "*"), ("plus", "+"), ("minus", "-"), ("*", "*"), ("+", "+"))


def make_task(intent: str, rng: random.Random, profile: Profile, *, heldout: bool = False,
              vocab: Vocabulary = NATURAL) -> Task:
    """A random task of ``intent`` for ``profile``: training phrasings, or the held-out one."""
    phrasings = PHRASINGS[intent]
    phrasing = phrasings[-1] if heldout else rng.choice(phrasings[:-1])
    return _MAKERS[intent](phrasing, rng, profile, vocab)


def _time_home(phrasing: str, rng: random.Random, p: Profile, v: Vocabulary) -> Task:
    return Task("time_home", phrasing, ToolUse("now", {"timezone": p.home}), personal=True, pattern=_TIME.pattern,
                shows=tuple(_aliases("time_home", p.home)), preference=p.home, correction=f"No, I meant {p.home} time.")


def _time_person(phrasing: str, rng: random.Random, p: Profile, v: Vocabulary) -> Task:
    person = rng.choice(sorted(p.people))
    city = p.people[person]
    return Task("time_person", phrasing.format(person=person), ToolUse("now", {"timezone": city}), personal=True,
                pattern=_TIME.pattern, shows=tuple(_aliases("time_person", city)), preference=city,
                correction=f"No, I meant {city} time, {person} lives in {city}.", meta={"person": person})


def _conversion(intent: str, phrasing: str, value: float, source: str, target: str, pref: str | None) -> Task:
    result = units.convert(value, units.find_unit(source), units.find_unit(target))
    args = {"value": value, "from_unit": source, "to_unit": target}
    correction = f"No, I meant in {pref}." if pref else None
    return Task(intent, phrasing, ToolUse("convert", args), personal=pref is not None,
                pattern=_number_pattern(result), preference=pref, correction=correction)


def _distance(phrasing: str, rng: random.Random, p: Profile, v: Vocabulary) -> Task:
    value = rng.choice(v.distances)
    return _conversion("distance", phrasing.format(value=value), value, "km", p.distance_unit, p.distance_unit)


def _temperature(phrasing: str, rng: random.Random, p: Profile, v: Vocabulary) -> Task:
    value = rng.choice(v.temperatures)
    return _conversion("temperature", phrasing.format(value=value), value, "celsius", p.temperature_unit,
                       p.temperature_unit)


def _reminder(phrasing: str, rng: random.Random, p: Profile, v: Vocabulary) -> Task:
    thing = rng.choice(v.things)
    args = {"text": thing, "list_name": p.reminders_list, "kind": "todo"}
    return Task("reminder", phrasing.format(thing=thing), ToolUse("add_note", args), personal=True,
                shows=(p.reminders_list,), pattern=_saying(thing), preference=p.reminders_list,
                correction=f"No, I meant on my {p.reminders_list} list.")


def _time_city(phrasing: str, rng: random.Random, p: Profile, v: Vocabulary) -> Task:
    city = rng.choice(v.cities)
    return Task("time_city", phrasing.format(city=city), ToolUse("now", {"timezone": city}), pattern=_TIME.pattern)


def _calculate(phrasing: str, rng: random.Random, p: Profile, v: Vocabulary) -> Task:
    a, b = rng.randint(*v.operands), rng.randint(*v.operands)
    word = re.search(r"\{a\} (\S+) \{b\}", phrasing).group(1)
    symbol = dict(_OPS)[word]
    expression = f"{a} {symbol} {b}"
    value = format_number(evaluate(expression))
    return Task("calculate", phrasing.format(a=a, b=b), ToolUse("calculate", {"expression": expression}),
                shows=(value,), pattern=rf"(?<![\d.]){re.escape(value)}(?![\d])")


_CONVERSIONS = (
    ("km", "miles"), ("miles", "km"), ("kg", "pounds"), ("pounds", "kg"), ("liters", "gallons"),
    ("feet", "meters"), ("inches", "cm"), ("celsius", "fahrenheit"), ("fahrenheit", "celsius"), ("hours", "minutes"),
    ("GB", "MB"), ("meters", "feet"), ("ounces", "grams"), ("cup", "ml"),
)


def _convert(phrasing: str, rng: random.Random, p: Profile, v: Vocabulary) -> Task:
    source, target = rng.choice(_CONVERSIONS)
    value = rng.choice(v.amounts)
    return _conversion("convert", phrasing.format(value=value, source=source, target=target), value, source, target,
                       None)


def _add_todo(phrasing: str, rng: random.Random, p: Profile, v: Vocabulary) -> Task:
    thing, name = rng.choice(v.things), rng.choice(v.lists)
    args = {"text": thing, "list_name": name, "kind": "todo"}
    return Task("add_todo", phrasing.format(thing=thing, list=name), ToolUse("add_note", args), shows=(name,),
                pattern=_saying(thing))


def _saying(thing: str) -> str:
    """An answer that says what was saved: "Saved the note: my errands list." names the list, but a
    person who asked to be reminded to cancel the gym trial does not take it as done."""
    return rf"(?i){re.escape(thing)}"


def _add_note(phrasing: str, rng: random.Random, p: Profile, v: Vocabulary) -> Task:
    note = rng.choice(v.notes)
    return Task("add_note", phrasing.format(note=note), ToolUse("add_note", {"text": note}), shows=("note",))


def _day(rng: random.Random) -> date:
    return date(2026, 1, 1) + timedelta(days=rng.randrange(730))


def _weekday(phrasing: str, rng: random.Random, p: Profile, v: Vocabulary) -> Task:
    day = _day(rng)
    return Task("weekday", phrasing.format(date=day.isoformat()), ToolUse("weekday", {"date": day.isoformat()}),
                shows=(WEEKDAYS[day.weekday()],))


def _days_between(phrasing: str, rng: random.Random, p: Profile, v: Vocabulary) -> Task:
    start = _day(rng)
    end = start + timedelta(days=rng.randint(2, 120))
    args = {"start": start.isoformat(), "end": end.isoformat()}
    days = str((end - start).days)
    return Task("days_between", phrasing.format(**args), ToolUse("days_between", args),
                pattern=rf"(?<!\d){days}(?!\d)")


def _add_days(phrasing: str, rng: random.Random, p: Profile, v: Vocabulary) -> Task:
    day, days = _day(rng), rng.randint(2, 90)
    args = {"date": day.isoformat(), "days": days}
    return Task("add_days", phrasing.format(**args), ToolUse("add_to_date", args),
                shows=((day + timedelta(days=days)).isoformat(),))


def _number_pattern(value: float) -> str:
    """A regex for the value as an answer may write it: in full, or rounded to 2 decimals (not less)."""
    forms = {format_number(value, 12), format_number(round(value, 2), 12)}
    alternatives = "|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True))
    return rf"(?<![\d.])(?:{alternatives})(?![\d])"


_MAKERS: dict[str, Callable[[str, random.Random, Profile, Vocabulary], Task]] = {
    "time_home": _time_home, "time_person": _time_person, "distance": _distance, "temperature": _temperature,
    "reminder": _reminder, "time_city": _time_city, "calculate": _calculate, "convert": _convert,
    "add_todo": _add_todo, "add_note": _add_note, "weekday": _weekday, "days_between": _days_between,
    "add_days": _add_days,
}
INTENTS = tuple(_MAKERS)


# ----------------------------------------------------------------------------- the world


class World:
    """Task streams for one profile, deterministic per seed.

    ``training_tasks``: what the user asks during use (mostly personal, some general).
    ``heldout_tasks``: personal tasks in the phrasings training never uses, for measuring.
    ``general_tasks``: tasks that need no preference, for measuring forgetting.
    """

    def __init__(self, profile: Profile, seed: int = 0, *, personal_share: float = 0.75) -> None:
        self.profile = profile
        self.seed = seed
        self.personal_share = personal_share

    def _rng(self, stream: str) -> random.Random:
        return random.Random(f"{self.seed}:{stream}:{self.profile.name}")

    def training_tasks(self, n: int) -> list[Task]:
        """The user's requests in order. Their first personal requests touch each preference once
        (each person's city is one, as is home), in :data:`PERSONAL`'s order; after that intents are
        drawn at random. A checkpoint after the first round then measures learning from what the
        user has said, not whether the draw happened to ask about everyone yet."""
        rng = self._rng("training")
        each_person = [replace(self.profile, people={person: city}) for person, city in sorted(self.profile.people.items())]
        first = [(intent, profile) for intent in PERSONAL
                 for profile in (each_person if intent == "time_person" else [self.profile])]  # fmt: skip
        out = []
        for _ in range(n):
            if rng.random() < self.personal_share:
                intent, profile = first.pop(0) if first else (rng.choice(PERSONAL), self.profile)
            else:
                intent, profile = rng.choice(GENERAL), self.profile
            out.append(make_task(intent, rng, profile))
        return out

    def heldout_tasks(self, n: int) -> list[Task]:
        rng = self._rng("heldout")
        return [make_task(PERSONAL[i % len(PERSONAL)], rng, self.profile, heldout=True) for i in range(n)]

    def general_tasks(self, n: int) -> list[Task]:
        rng = self._rng("general")
        return [make_task(GENERAL[i % len(GENERAL)], rng, self.profile) for i in range(n)]
