"""The lesson check: a new lesson that breaks a pinned turn is narrowed, or else not added.

Weights reach users only through the promotion gate; a lesson reaches the very next request. The
check holds lessons to the gate's greedy rule (:class:`~whet.learner.gate.PinnedAction`): for each
pinned turn of the regression set whose request would be shown the new lesson (the agent's
retrieval rule, :func:`~whet.memory.index.shown`, over the user's lessons and this one), the
served model answers it greedily with the lesson in its prompt. A turn answered wrong with the
lesson and right without it is a turn the lesson broke. Such a lesson is added narrowed
(:func:`narrowed`): shown only to requests closer to it, by a margin, than any turn it broke; one
that broke a turn about as close as its own request is not added. Beside the pinned turns, the check can ask
the few lesson probes (more general calls, ``learner.gate.lesson_probes_asked``; off by default) most similar to
the lesson. Its replies are asked all at once.

What it guards (both seen in bench runs): a user who thanks at random makes "calling add_note(...)
was right" a lesson for a sum (one that put the note on a list: a call of the request's own words
teaches none, :func:`~whet.learner.lessons.says_more`), and the next sum is noted instead of added;
"the time at home: now(Lisbon) was right" made the model call the clock for "Which weekday is
2027-02-15?". Pinned turns that would not be shown the lesson cost nothing: most lessons are
checked against no turn or a few. A request pinned at two steps (its call, then the answer read off
the call's result) is checked at both.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

import anyio
import numpy as np

from whet.config.settings import AgentConfig
from whet.learner.gate import PinnedTurn
from whet.learner.prompt import last_user_text, prompt_with_lessons
from whet.memory.index import LessonHit, LessonIndex, agent_shown

# (user id, messages, tools, max new tokens) -> the served model's greedy reply, tool-call markup included
Generate = Callable[[str, list[dict[str, Any]], list[dict[str, Any]] | None, int], Awaitable[str]]


class Broken(NamedTuple):
    """A pinned turn a lesson broke: its request, the reply with the lesson shown, and the lesson's
    similarity to the request."""

    request: str
    reply: str
    score: float

    def __str__(self) -> str:
        return f"{self.request} -> {self.reply} ({self.score:.2f})"


def narrowed(broken: Sequence[Broken], margin: float) -> float | None:
    """The similarity a lesson that broke ``broken`` (not empty) needs to be shown: ``margin`` above the closest
    of them, so that it reaches the requests it was written for and not the look-alikes it
    misleads; None when nothing is left below 1 (it broke a turn about as close as its own request).

    Why it pays: a lesson about the time at home scores 0.83-0.89 against the other ways of asking
    it and 0.57-0.61 against the pinned "What's the time in Moscow right now?" it made the model
    answer with the home city (MiniLM; bench/results/RUNS.md, stop 46). Held back, as every such
    lesson once was, it helps no one."""
    floor = max(b.score for b in broken) + margin
    return floor if floor < 1.0 else None


class LessonCheck:
    """``probes``: more general turns (the lesson probes, ``learner.gate.lesson_probes``), of which only the
    ``nearest`` most similar to a lesson are asked beside the pinned turns: a wide net of look-alikes at the
    cost of a few greedy replies a lesson."""

    def __init__(self, pinned: Sequence[PinnedTurn], index: LessonIndex, agent: AgentConfig, generate: Generate,
                 probes: Sequence[PinnedTurn] = (), nearest: int = 0) -> None:  # fmt: skip
        self.pinned = list(pinned)
        self.probes = list(probes)
        self.nearest = nearest if self.probes else 0
        self.index = index
        self.agent = agent
        self.generate = generate
        self._turns = self.pinned + self.probes
        self._requests = [last_user_text(turn.messages) for turn in self._turns]
        self._vectors: np.ndarray | None = None  # the pinned and probe requests embedded, once

    async def broken(self, user_id: str, text: str) -> list[Broken]:
        """The pinned turns that lesson ``text`` (not yet added) breaks for ``user_id``, closest first;
        empty when it breaks none."""
        if not self._turns or self.agent.lessons_k == 0:
            return []
        scores = await anyio.to_thread.run_sync(self._scores, text)
        asked = list(range(len(self.pinned)))
        if self.nearest:  # the probes nearest the lesson, closest first
            asked += sorted(range(len(self.pinned), len(self._turns)), key=lambda i: -scores[i])[: self.nearest]
        shown = []  # (turn, request, score, lessons with the new one, lessons without it)
        for i in asked:
            turn, request, score = self._turns[i], self._requests[i], float(scores[i])
            if score < self.agent.lessons_min_score or not request:
                continue
            hits = await anyio.to_thread.run_sync(self.index.search, user_id, request, self.agent.lessons_k)
            new = LessonHit(-1, user_id, text, score)
            with_it = agent_shown(self.agent, sorted([*hits, new], key=lambda h: -h.score)[: self.agent.lessons_k])
            if new in with_it:
                shown.append((turn, request, score, with_it, agent_shown(self.agent, hits)))
        # asked together, as the server decodes concurrent requests in one batch: with the lesson, then,
        # where that went wrong, without it
        replies = await self._answers(user_id, [(turn, with_it) for turn, _, _, with_it, _ in shown])
        wrong = [(s, reply) for s, reply in zip(shown, replies, strict=True) if not s[0].action.kept(reply)]
        alone = await self._answers(user_id, [(s[0], s[4]) for s, _ in wrong])
        broken = [Broken(s[1], reply.strip(), s[2])
                  for (s, reply), without in zip(wrong, alone, strict=True) if s[0].action.kept(without)]  # fmt: skip
        return sorted(broken, key=lambda b: -b.score)

    def _scores(self, text: str) -> np.ndarray:
        """Cosine similarity of lesson ``text``, as the index stores it, to each pinned and probe request, as
        the index scores a search."""
        if self._vectors is None:
            self._vectors = self.index.embedder.embed(self._requests)  # [n, d], unit rows
        return self.index.scores(self._vectors, text)  # [n]

    async def _answers(self, user_id: str, asked: Sequence[tuple[PinnedTurn, Sequence[LessonHit]]]) -> list[str]:
        """:meth:`_answer` of each (turn, lessons) of ``asked``, all at once; in ``asked``'s order."""
        replies = [""] * len(asked)

        async def one(i: int) -> None:
            replies[i] = await self._answer(user_id, *asked[i])

        async with anyio.create_task_group() as group:
            for i in range(len(asked)):
                group.start_soon(one, i)
        return replies

    async def _answer(self, user_id: str, turn: PinnedTurn, lessons: Sequence[LessonHit]) -> str:
        """The served model's greedy reply to ``turn`` with ``lessons`` in its system prompt, as the agent
        would send them; as long as the gate's greedy check reads (:meth:`PinnedAction.tokens` of the
        pinned reply, at about three characters a token)."""
        prompt = prompt_with_lessons(turn.messages, [h.text for h in lessons], self.agent.system_prompt)
        return await self.generate(user_id, prompt, turn.tools, turn.action.tokens(len(turn.response) // 3 + 8))
