"""Judges: what the next state says about the action that came before it.

A judge reads one closed turn - the model's action and the *next state* that
followed it (a tool's result, the user's next message, explicit feedback) - and
returns a :class:`Verdict`: an *evaluative* score in {-1, 0, +1} (did the action
help?) and, when the next state says how the action should have been, a
*directive* hint, which hindsight distillation adds to the teacher's context and
memory keeps as a lesson.

- :class:`RulesJudge` is pure and deterministic: explicit feedback, tool errors,
  and corrections, re-queries and thanks recognised in the user's reply (English
  heuristics, an ordered table of regexes: :data:`CORRECTIONS`).
- :class:`LLMJudge` is a process-reward prompt on any chat model, majority over
  ``votes`` sampled answers, plus one greedy call that extracts the hint. It
  reaches the model through the small :class:`ChatModel` seam
  (:class:`OpenAIChat` over HTTP), not the runtime's policy backends, because
  the learner never imports the runtime.
- :class:`ComposedJudge` asks a second judge only where the first had nothing to say.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import anyio
import httpx
import structlog

from whet.learner.prompt import content_text, user_texts
from whet.memory.store import Feedback, Turn

HINT_LIMIT = 200  # characters; a hint is a directive, not a transcript


class JudgeError(Exception):
    """A judge could not reach a verdict (its model failed, timed out or answered nonsense)."""


@dataclass(frozen=True)
class NextState:
    """What followed a turn: ``kind`` and ``data`` are the turn's ``next_state_kind`` and
    ``next_state``; ``feedback`` holds the explicit feedback rows on the turn, oldest first,
    which may arrive after another next state closed it."""

    kind: str  # tool_result | user_message | feedback
    data: dict[str, Any]
    feedback: tuple[Feedback, ...] = ()

    @classmethod
    def of(cls, turn: Turn, feedback: Sequence[Feedback] = ()) -> NextState:
        """The next state of ``turn``. An open turn with feedback rows counts as closed by
        feedback; an open turn without any raises ``ValueError``."""
        rows = tuple(sorted(feedback, key=lambda row: row.created_at))  # stable: ties keep their order
        if turn.next_state_kind is None:
            if not rows:
                raise ValueError(f"turn {turn.id!r} is still open: it has no next state to judge yet")
            return cls("feedback", {}, rows)
        return cls(turn.next_state_kind, dict(turn.next_state or {}), rows)


@dataclass(frozen=True)
class Verdict:
    """A judge's decision on one turn. ``hint`` is a short directive (how the action should
    have been) or None; ``reason`` is one line for people reading the store; ``judge`` names
    the judge that decided."""

    score: int
    hint: str | None
    reason: str
    judge: str

    def __post_init__(self) -> None:
        if isinstance(self.score, bool) or self.score not in (-1, 0, 1):
            raise ValueError(f"a verdict's score is -1, 0 or +1, got {self.score!r}")


@runtime_checkable
class Judge(Protocol):
    name: str

    async def judge(self, turn: Turn, next_state: NextState, context: list[dict[str, Any]]) -> Verdict:
        """Judge ``turn`` given what followed it; ``context`` is the conversation the action was
        taken in (normally ``turn.prompt_messages``). May raise :class:`JudgeError`."""
        ...


# ----------------------------------------------------------------------------- rules

# Where a correction may start inside a reply: "thanks, but not Paris, Lisbon".
_CLAUSE = r"(?:^|[,.;:!?]\s*|\b(?:but|no|nope)\s+)"

CORRECTIONS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), template)
    for pattern, template in (
        # "No, I meant Lisbon time" -> 'The user meant "Lisbon time"'
        (r"\bi\s+meant\b[\s,:]*(?P<x>.+)", 'The user meant "{x}"'),
        # "I said Celsius" -> 'The user said "Celsius"'
        (r"\bi\s+said\b[\s,:]*(?P<x>.+)", 'The user said "{x}"'),
        # "that's wrong, it is on Friday" / "wrong" / "not helpful"
        (rf"{_CLAUSE}(?:(?:that|this|it)(?:'s|\s+is|\s+was)\s+)?(?:wrong|incorrect|not\s+(?:right|correct"
         r"|it|good|great|helpful|useful|what\s+i\s+(?:wanted|meant|needed)))\b[\s,.;:!-]*(?P<x>.*)",
         'The user corrected: "{x}"'),
        # "not Paris, Lisbon" / "not Paris but Lisbon" ("not bad, thanks" is praise)
        (rf"{_CLAUSE}not\s+(?!bad\b)(?P<x>[^,]+?)(?:\s*,\s*(?:but\s+)?|\s+but\s+)(?P<y>.+)",
         'The user wants "{y}", not "{x}"'),
        # "Actually, make it 3pm"
        (rf"{_CLAUSE}actually\b[\s,:]*(?P<x>.+)", 'The user clarified: "{x}"'),
        # "No. Use Celsius" (but not "no thanks", which declines an offer)
        (r"^(?:no|nope)\b(?!\s*,?\s*(?:thanks|thank|problem|worries))[\s,.;:!-]+(?P<x>.+)",
         'The user corrected: "{x}"'),
    )
)
"""Correction patterns, tried in order on the user's reply (``re.search``); the first that
matches gives the hint: its template filled with the captured text in the third person. An
empty capture falls back to the whole reply.

The captured words are quoted, so that a value reads in a hint the way it is written in a tool
call's arguments: tokenized, prose has " Honolulu" (one token, after a space) where a call has
'"Hon' 'olulu' (after a quote). Beside the unquoted hint the model began a call's value with
another word's first token ("H"... "Houston", "Se"... "Seychelles"); beside the quoted one it
copied the value (bench/results/RUNS.md, stop 44)."""

_REQUERY = re.compile(
    r"^(?:again\b|i\s+(?:already\s+)?asked\b|please\s+answer\b|answer\s+(?:the|my)\s+question\b"
    r"|that'?s\s+not\s+what\s+i\s+asked\b|you\s+didn'?t\s+answer\b)",
    re.IGNORECASE,
)
_PRAISE = re.compile(
    r"(?<!\bnot\s)\b(?:thanks|thank\s+you|thx|ty|great|perfect|awesome|nice|cool|excellent|exactly"
    r"|correct|brilliant|that'?s\s+right|well\s+done|good\s+job|(?:it|that)\s+works?)\b",
    re.IGNORECASE,
)
# Replies that say nothing about the action yet; a bare "no" may answer the assistant's question.
_UNCLEAR = re.compile(
    r"^(?:|what|huh|h+m+|eh|sorry|pardon|come\s+again|what\s+do\s+you\s+mean|no|nope"
    r"|i\s+don'?t\s+(?:understand|get\s+it))$",
    re.IGNORECASE,
)
_FIRST_PERSON = re.compile(r"\b(?:i'm|i\s+am|i've|i'd|i'll|myself|mine|my|me|i)\b", re.IGNORECASE)
_THIRD_PERSON = {
    "i'm": "the user is", "i am": "the user is", "i've": "the user has", "i'd": "the user would",
    "i'll": "the user will", "myself": "the user", "mine": "the user's", "my": "the user's",
    "me": "the user", "i": "the user",
}  # fmt: skip
REQUERY_SIMILARITY = 0.6  # word-set Jaccard above which a new request repeats the last one
REQUERY_CONTAINS = 0.8  # ...or the share of the last request's words the reply repeats ("{q} Please answer.")
REQUERY_HINT = "The user had to ask again: "
WRONG_HINT = "The user said it was wrong: "  # a correction that names nothing ("That's wrong.")
CONTENT_FREE_HINTS = (REQUERY_HINT, WRONG_HINT)  # hints that say only that the action was wrong


TOOL_FAILED = "returned an error"  # in the reason of a call's verdict from its tool's error


class RulesJudge:
    """Deterministic verdicts from the next state alone; never raises for well-formed turns.

    Explicit feedback wins (the latest row: its sign is the score, a negative one's text the
    hint). A held call's approval comes next: rejected -1 (its reason in the hint), approved +1,
    expired 0. A tool result with an ``error:`` is -1; otherwise 0. The user's next message is
    read in this order: a correction (-1, hint from :data:`CORRECTIONS`), a re-query (-1),
    thanks or praise (+1), an unclear reply such as "?" or "huh" (0), else the user moved on (+1).
    """

    name = "rules"

    async def judge(self, turn: Turn, next_state: NextState, context: list[dict[str, Any]]) -> Verdict:
        return self.decide(turn, next_state, context)

    def decide(self, turn: Turn, next_state: NextState, context: list[dict[str, Any]]) -> Verdict:
        """The verdict, synchronously: the rules need no I/O."""
        if next_state.feedback:
            latest = next_state.feedback[-1]
            return self._feedback(latest.score, latest.text)
        if next_state.kind == "feedback":
            return self._feedback(float(next_state.data.get("score") or 0.0), next_state.data.get("text"))
        if next_state.kind == "tool_result":
            return self._tool_result(turn, next_state.data)
        if next_state.kind == "user_message":
            return self._user_message(next_state.data, context or turn.prompt_messages)
        return self._verdict(0, None, f"nothing to judge in a {next_state.kind!r} next state")

    def _verdict(self, score: int, hint: str | None, reason: str) -> Verdict:
        return Verdict(score, hint, reason, self.name)

    def _feedback(self, score: float, text: str | None) -> Verdict:
        sign = (score > 0) - (score < 0)
        hint = None
        if sign < 0 and text and text.strip():
            hint = correction_hint(text) or _clip(f"The user said: {_third_person(_tidy(text))}")
        return self._verdict(sign, hint, f"explicit feedback {score:+.2f}")

    def _tool_result(self, turn: Turn, data: dict[str, Any]) -> Verdict:
        approval = data.get("approval") or {}
        if approval.get("decision") == "rejected":  # a person said the action was wrong
            reason = " ".join((approval.get("reason") or "").split())
            hint = f"The user rejected calling {_call_list(turn, approval)}" + (f": {reason}" if reason else "")
            return self._verdict(-1, _clip(hint), "the user rejected the call")
        if approval.get("decision") == "expired":  # nobody looked: says nothing about the action
            return self._verdict(0, None, "the approval expired undecided")
        results = data.get("results") or []
        for result in results:
            content = content_text(result.get("content")).strip()
            if content.lower().startswith("error:"):
                name = result.get("name") or _call_name(turn, result.get("tool_call_id")) or "the tool"
                message = _clip(" ".join(content[len("error:"):].split()))
                return self._verdict(-1, f"Calling {name} failed: {message}", f"tool {name} {TOOL_FAILED}")
        if approval.get("decision") == "approved":  # a person agreed the action was right
            return self._verdict(1, None, "the user approved the call")
        return self._verdict(0, None, "tool ran without error" if results else "no tool results")

    def _user_message(self, data: dict[str, Any], context: list[dict[str, Any]]) -> Verdict:
        replies = user_texts(data.get("messages") or [])
        if not replies:
            return self._verdict(0, None, "no user message followed")
        reply = " ".join(replies[0].replace("\u2019", "'").split())
        hint = correction_hint(reply)
        if hint is not None:
            return self._verdict(-1, hint, "the user corrected the answer")
        # the request as asked and as corrected since: "What date is 60 days after 2026-05-11?", answered wrong,
        # "That's not what I asked.", answered wrong again, then the request word for word is a re-ask of the
        # first, not a new request (bench run DZ: read as moving on, it thanked a call to add_note)
        if any(is_requery(reply, asked) for asked in request_asks(user_texts(context), acknowledged=False)):
            hint = _clip(REQUERY_HINT + _third_person(_tidy(reply)))
            return self._verdict(-1, hint, "the user asked again")
        if _PRAISE.search(reply):
            return self._verdict(1, None, "the user said thanks")
        if _UNCLEAR.match(_tidy(reply)):
            return self._verdict(0, None, "the user's reply is unclear")
        return self._verdict(1, None, "the user moved on")


def correction_hint(text: str) -> str | None:
    """The hint for a correction in ``text`` (first matching row of :data:`CORRECTIONS`), or None."""
    text = " ".join(text.replace("\u2019", "'").split())
    for pattern, template in CORRECTIONS:
        match = pattern.search(text)
        if match is None:
            continue
        parts = {key: _third_person(_tidy(value)) for key, value in match.groupdict().items()}
        if not all(parts.values()):  # nothing after "wrong": the reply says only that
            return _clip(WRONG_HINT + _third_person(_tidy(text)))
        return _clip(template.format(**parts))
    return None


def _tidy(text: str) -> str:
    return " ".join(text.split()).rstrip(" .!?,;:")


def _third_person(text: str) -> str:
    return _FIRST_PERSON.sub(lambda m: _THIRD_PERSON[" ".join(m.group(0).lower().split())], text)


def _clip(text: str, limit: int = HINT_LIMIT) -> str:
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "\u2026"


def _call_list(turn: Turn, approval: dict[str, Any]) -> str:
    """The held calls as ``name(arguments)``, the way the turn made them."""
    held = set(approval.get("calls") or [])
    calls = [c["function"] for c in turn.tool_calls if not held or c["function"]["name"] in held]
    return ", ".join(f"{c['name']}({c.get('arguments', '')})" for c in calls) or "the tool"


def _call_name(turn: Turn, call_id: str | None) -> str | None:
    return next((c.get("function", {}).get("name") for c in turn.tool_calls if c.get("id") == call_id), None)


def request_asks(asks: Sequence[str], *, acknowledged: bool = True) -> Sequence[str]:
    """The user messages of the request ``asks`` ends in: what was asked, then its corrections and
    re-asks (earlier requests of the conversation left out); ``acknowledged``: an acknowledgement
    ("Thanks!") belongs to the request before it too."""
    for i in range(len(asks) - 1, 0, -1):
        follows = correction_hint(asks[i]) is not None or is_requery(asks[i], asks[i - 1])
        if not follows and not (acknowledged and is_acknowledgement(asks[i])):
            return asks[i:]
    return asks


def is_requery(reply: str, asked: str) -> bool:
    """Whether ``reply`` asks ``asked`` again: a re-ask marker, nearly the same words, or the whole
    request repeated inside a longer reply ("Is it late at home? Please answer the question.")."""
    if _REQUERY.match(reply) or _similarity(reply, asked) >= REQUERY_SIMILARITY:
        return True
    words = set(re.findall(r"\w+", asked.lower()))
    return len(words) >= 3 and len(words & set(re.findall(r"\w+", reply.lower()))) / len(words) >= REQUERY_CONTAINS


_ACKNOWLEDGED = re.compile(
    r"^(?:ok(?:ay)?|alright|all\s+right|got\s+it|good\s+to\s+know|i\s+see|fine|sure|noted|understood)$",
    re.IGNORECASE,
)
ACKNOWLEDGEMENT_WORDS = 4  # thanks longer than this may carry a new request ("Great, now note that I'm out")


def is_acknowledgement(reply: str) -> bool:
    """Whether ``reply`` only thanks or acknowledges ("Thank you!", "Perfect, thank you.", "Got it."):
    feedback on the answer before it, not a request of its own. A question ("Thanks! And in
    Paris?") or a longer sentence is a request, whatever thanks it opens with."""
    text = _tidy(reply.replace("\u2019", "'"))  # _tidy collapses the whitespace
    if not text or "?" in reply or len(re.findall(r"\w+", text)) > ACKNOWLEDGEMENT_WORDS:
        return False
    return bool(_ACKNOWLEDGED.match(text)) or (bool(_PRAISE.search(text)) and correction_hint(reply) is None)


def _similarity(a: str, b: str) -> float:
    """Jaccard similarity of the two texts' lowercase word sets (punctuation dropped)."""
    words_a, words_b = set(re.findall(r"\w+", a.lower())), set(re.findall(r"\w+", b.lower()))
    if not words_a or not words_b:
        return 0.0
    return len(words_a & words_b) / len(words_a | words_b)


# ----------------------------------------------------------------------------- chat model seam


@runtime_checkable
class ChatModel(Protocol):
    async def complete(self, messages: list[dict[str, Any]], *, temperature: float, max_tokens: int) -> str:
        """The assistant's reply text to ``messages``; raises :class:`JudgeError` on failure."""
        ...


class OpenAIChat:
    """A :class:`ChatModel` on any OpenAI-compatible endpoint (``base_url`` as for the OpenAI
    SDK, e.g. ``http://127.0.0.1:8001/v1``). ``transport`` is for tests (``httpx.MockTransport``)."""

    def __init__(self, base_url: str, api_key: str | None = None, *, model: str, timeout: float = 60.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:  # fmt: skip
        self.base_url, self.model, self.timeout = base_url.rstrip("/"), model, timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport)

    async def complete(self, messages: list[dict[str, Any]], *, temperature: float, max_tokens: int) -> str:
        url = f"{self.base_url}/chat/completions"
        body = {"model": self.model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens}
        try:
            response = await self._client.post("chat/completions", json=body)
        except httpx.TimeoutException as exc:
            raise JudgeError(f"{url} timed out after {self.timeout}s") from exc
        except httpx.HTTPError as exc:
            raise JudgeError(f"cannot reach {url}: {exc}") from exc
        if response.is_error:
            raise JudgeError(f"{url} answered HTTP {response.status_code}: {response.text[:300]}")
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise JudgeError(f"{url} answered without choices[0].message.content: {response.text[:200]}") from exc
        return content or ""

    async def aclose(self) -> None:
        await self._client.aclose()


# ----------------------------------------------------------------------------- llm judge

_SCORE = re.compile(r"SCORE:\s*([+-]?[01])(?![0-9])", re.IGNORECASE)
_VOTE_MAX_TOKENS = 512  # room to reason before the SCORE line
_HINT_MAX_TOKENS = 96
_MESSAGE_LIMIT = 1500  # characters of one message shown to the judge

_REWARD_SYSTEM = (
    "You evaluate one step taken by an AI assistant. You see the conversation so far, the "
    "assistant's action, and what happened next: a tool's result, the user's next message, or "
    "the user's explicit feedback. Decide whether the action helped the user, judging by what "
    "followed it. Think briefly, then end with a last line that is exactly one of:\n"
    "SCORE: +1  (the action helped)\nSCORE: 0  (unclear or neutral)\nSCORE: -1  (the action was wrong or unhelpful)"
)
_HINT_SYSTEM = (
    "You read one step taken by an AI assistant and what followed it. If what followed shows how "
    "the assistant should have acted, answer with ONE short, actionable instruction to the "
    "assistant (what it should have done differently), e.g. 'Give times in Lisbon time zone.' "
    "If it shows nothing to change, answer exactly NONE."
)


class LLMJudge:
    """Process reward on any chat model: ``votes`` samples at ``temperature`` answer whether
    the action helped given what followed (``SCORE: +1|0|-1`` on the last line); the majority
    of the parseable votes is the score, a tie or no parseable vote is 0. When the score is
    -1, or the user replied or commented, one greedy call extracts the hint (``NONE``: no hint).

    A :class:`JudgeError` from the model propagates: the caller decides (see :class:`ComposedJudge`).
    """

    name = "llm"

    def __init__(self, model: ChatModel, votes: int = 3, temperature: float = 0.7, max_context_messages: int = 8):
        if votes < 1:
            raise ValueError(f"votes must be at least 1, got {votes}")
        self.model, self.votes, self.temperature = model, votes, temperature
        self.max_context_messages = max_context_messages

    async def judge(self, turn: Turn, next_state: NextState, context: list[dict[str, Any]]) -> Verdict:
        episode = self.render(turn, next_state, context)
        prompt = [{"role": "system", "content": _REWARD_SYSTEM}, {"role": "user", "content": episode}]
        answers = await self._sample(prompt)
        votes = [vote for vote in map(parse_vote, answers) if vote is not None]
        score = majority(votes)
        counts = Counter(votes)
        reason = f"llm votes +1:{counts[1]} 0:{counts[0]} -1:{counts[-1]}"
        if len(votes) < len(answers):
            reason += f" unparsed:{len(answers) - len(votes)}"
        hint = None
        if score == -1 or next_state.kind == "user_message" or _feedback_text(next_state):
            hint = await self._hint(episode)
        return Verdict(score, hint, reason, self.name)

    async def _sample(self, prompt: list[dict[str, Any]]) -> list[str]:
        """``votes`` answers drawn concurrently; the first JudgeError cancels the rest and propagates."""
        answers = [""] * self.votes

        async def vote(i: int) -> None:
            answers[i] = await self.model.complete(prompt, temperature=self.temperature, max_tokens=_VOTE_MAX_TOKENS)

        try:
            async with anyio.create_task_group() as group:
                for i in range(self.votes):
                    group.start_soon(vote, i)
        except ExceptionGroup as errors:
            failed, rest = errors.split(JudgeError)
            if failed is None or rest is not None:
                raise
            raise failed.exceptions[0] from None
        return answers

    async def _hint(self, episode: str) -> str | None:
        prompt = [{"role": "system", "content": _HINT_SYSTEM}, {"role": "user", "content": episode}]
        answer = await self.model.complete(prompt, temperature=0.0, max_tokens=_HINT_MAX_TOKENS)
        lines = [line.strip().strip("\"'`") for line in answer.strip().splitlines() if line.strip()]
        if not lines or lines[0].rstrip(".").upper() == "NONE":
            return None
        return _clip(lines[0]) or None

    def render(self, turn: Turn, next_state: NextState, context: list[dict[str, Any]]) -> str:
        """The episode as the judge model reads it: conversation, action, next state."""
        shown = context[-self.max_context_messages:] if self.max_context_messages > 0 else []
        conversation = "\n".join(_render_message(m) for m in shown) or "(empty)"
        action = turn.response_text.strip() or "\n".join(_render_call(c) for c in turn.tool_calls) or "(empty)"
        return (
            f"## Conversation so far\n{conversation}\n\n"
            f"## The assistant's action\n{_clip(action, _MESSAGE_LIMIT)}\n\n"
            f"## What happened next\n{_render_next_state(next_state)}"
        )


def parse_vote(answer: str) -> int | None:
    """The last ``SCORE: +1|0|-1`` in a judge's answer, or None when there is none."""
    found = _SCORE.findall(answer)
    return int(found[-1]) if found else None


def majority(votes: Sequence[int]) -> int:
    """The most common vote; 0 on a tie for first place or when there are no votes."""
    ranked = Counter(votes).most_common()
    if not ranked or (len(ranked) > 1 and ranked[0][1] == ranked[1][1]):
        return 0
    return ranked[0][0]


def _feedback_text(next_state: NextState) -> bool:
    texts = [row.text for row in next_state.feedback]
    if next_state.kind == "feedback":
        texts.append(next_state.data.get("text"))
    return any(text and text.strip() for text in texts)


def _render_call(call: dict[str, Any]) -> str:
    function = call.get("function", call)
    return f"[calls {function.get('name')}({function.get('arguments', '')})]"


def _render_message(message: dict[str, Any]) -> str:
    role = message.get("role", "?")
    if role == "tool" and message.get("name"):
        role = f"tool ({message['name']})"
    parts = [_clip(content_text(message.get("content")).strip(), _MESSAGE_LIMIT)]
    parts += [_render_call(call) for call in message.get("tool_calls") or []]
    return f"{role}: " + " ".join(part for part in parts if part)


def _render_next_state(next_state: NextState) -> str:
    data, lines = next_state.data, []
    if next_state.kind == "tool_result":
        lines = ["The tools returned:", *map(_render_message, data.get("results") or [])]
    elif next_state.kind == "user_message":
        lines = ["The user's next message:", *map(_render_message, data.get("messages") or [])]
    feedback = [(row.score, row.text) for row in next_state.feedback]
    if not feedback and next_state.kind == "feedback" and "score" in data:
        feedback = [(float(data["score"]), data.get("text"))]
    lines += [f"The user's feedback: score {score:+.2f}, comment: {text or '(none)'}" for score, text in feedback]
    return "\n".join(lines) or "(nothing)"


# ----------------------------------------------------------------------------- composition


class ComposedJudge:
    """``first`` decides; ``then`` is asked only when ``first`` gave score 0 and no hint. If
    ``then`` fails with :class:`JudgeError`, the first verdict stands (a warning is logged)."""

    def __init__(self, first: Judge, then: Judge) -> None:
        self.first = first
        self.then = then
        self.name = f"{first.name}+{then.name}"

    async def judge(self, turn: Turn, next_state: NextState, context: list[dict[str, Any]]) -> Verdict:
        verdict = await self.first.judge(turn, next_state, context)
        if verdict.score != 0 or verdict.hint is not None:
            return verdict
        try:
            return await self.then.judge(turn, next_state, context)
        except JudgeError as exc:
            structlog.get_logger().warning("judge_failed", judge=self.then.name, turn_id=turn.id, error=str(exc))
            return verdict
