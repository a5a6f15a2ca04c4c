"""The learner: closed turns -> verdicts -> lessons and LoRA updates -> gate -> live.

A thin async shell around pure parts (judges, objectives, gate) and one
synchronous trainer that runs in its own worker thread. It talks to the world only
through the store and the bus, so it runs inside ``whet serve`` or as ``whet learn``
on another machine alike.

Flow:

1. ``turn.closed`` / ``feedback.added`` (and a periodic catch-up from the store, for
   a learner that was away) -> the judge gives each closed turn a verdict.
2. The verdict on a request's last step is also the verdict on its earlier steps
   that their own next state (a tool result) left neutral: the user's correction of
   an answer is a correction of the tool call that produced it.
3. A hint, or a clear success, becomes a lesson at once (``lesson.added``).
4. When ``batch_size`` trainable verdicts are waiting (or ``batch_timeout_s`` passed
   with at least one), one optimizer step makes a candidate version from the live
   one; the gate replays held-out turns; an accepted candidate is promoted and
   published (``adapter.published``), a rejected one is kept with its reasons. A lineage
   whose candidates the gate turned away waits for more samples before its next step
   (``learner.backoff``).
5. After promotion, when the live version's rolling judged score falls below its
   predecessor's by more than a margin, it is rolled back.

Crash safety: a candidate folder is written completely under a temporary name and
renamed into place, holding the adapter, the optimizer state and ``trainer_state.json``
(batch turn ids, baseline, gate replay). Registering the version and marking its
batch consumed is one store transaction. A restart finishes any version that reached
disk but not the store; a step that never reached disk left nothing behind and its
turns are trained then. So each turn is trained exactly once per lineage.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import re
import shutil
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean, pvariance
from typing import Any, TypeVar

import anyio
import structlog

from whet.config.settings import ConfigError, LearnerConfig, WhetConfig
from whet.learner.clock import PhaseClock
from whet.learner.gate import (
    ANSWER_OPENING,
    PinnedAction,
    PromotionGate,
    Replayed,
    encode_records,
    pinned_turns,
    read_records,
)
from whet.learner.judge import (
    CONTENT_FREE_HINTS,
    TOOL_FAILED,
    ChatModel,
    ComposedJudge,
    Judge,
    LLMJudge,
    NextState,
    OpenAIChat,
    RulesJudge,
    Verdict,
    correction_hint,
    request_asks,
)
from whet.learner.lesson_check import Generate, LessonCheck, narrowed
from whet.learner.lessons import argument_values, ignores_correction, lesson_for
from whet.learner.model import resolve_source, stop_token_ids
from whet.learner.objective import RunningBaseline, objective_from_config
from whet.learner.prompt import (
    IM_START,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    call_opening,
    hinted_prompt_ids,
    last_user_text,
    parse_arguments,
    relessoned,
    shown_lessons,
    split_tool_calls,
    user_texts,
)
from whet.learner.registry import AdapterRegistry
from whet.learner.trainer import (
    Anchor,
    LoraTrainer,
    Sample,
    limited_threads,
    release_memory,
    training_threads,
)
from whet.memory.bus import BUS_RECONNECTED, FEEDBACK_ADDED, LESSON_ADDED, LESSON_DELETED, TURN_CLOSED, Bus
from whet.memory.index import LessonIndex, lesson_said, recall
from whet.memory.store import Store
from whet.memory.tables import UNLEARNED_JUDGE, Adapter, Judgment, Lesson, Turn

# (user id, request) -> the lessons the agent would show it now
Recall = Callable[[str, str], Awaitable[list[str]]]

log = structlog.get_logger()

TRAINER_STATE = "trainer_state.json"
FINAL_KINDS = ("user_message", "feedback")  # next states that judge a whole request
# nats: how far past repair_margin a chat's odds of opening with a call may sit after a step and the chat still be
# read again after each repair pass; a pass that trains replies away from calls moves them a fraction of a step's
# 1-1.5 nats (stop 37), and away from the call
REPAIR_REACH = 2.0


@dataclass
class Progress:
    """What the learner has done since it started (for the CLI and tests)."""

    judged: int = 0
    lessons: int = 0
    lessons_held: int = 0  # lessons the lesson check kept out (they broke pinned turns about as close as their own request)
    lessons_narrowed: int = 0  # lessons it added narrowed (they broke pinned turns less close)
    lessons_misled: int = 0  # lessons narrowed later: a call copied their value into a request the user corrected
    lesson_check_s: float = 0.0  # wall seconds the lesson check took, summed (the served model's greedy replies)
    steps: int = 0
    promoted: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    rolled_back: list[str] = field(default_factory=list)
    last_step: dict[str, Any] = field(default_factory=dict)
    # what the running training step does now (None: no step running), and the units of work steps have done:
    # a phase begun, a rehearsal reply distilled, an optimizer pass. A client that waits on the learner (the
    # bench) sees a long step advance: on one core of an old CPU a first step runs over 15 minutes
    phase: str | None = None
    work: int = 0


class Learner:
    """``trainer`` builds the LoraTrainer on first use (in the training thread); None = no weight updates.
    ``regression``: pinned (prompt ids, response ids) pairs the gate replays; ``pinned``: what each of
    them must do (the same turns in the same order), checked on live's and candidate's greedy replies."""

    def __init__(
        self,
        config: LearnerConfig,
        store: Store,
        bus: Bus,
        judge: Judge,
        registry: AdapterRegistry,
        *,
        trainer: Callable[[], LoraTrainer] | None = None,
        regression: Callable[[Any], list[tuple[list[int], list[int]]]] | None = None,
        pinned: Sequence[PinnedAction] = (),
        rehearsal: Callable[[Any], list[tuple[list[int], list[int]]]] | None = None,
        rehearsal_messages: Sequence[list[dict[str, Any]]] = (),
        lesson_check: LessonCheck | None = None,
        recall: Recall | None = None,
        index: LessonIndex | None = None,
        on_step: Callable[[str], None] | None = None,
    ) -> None:
        if config.scope == "auto":  # WhetConfig resolves auto from server.api_keys; with none in sight, one user
            config = config.model_copy(update={"scope": "global"})
        self.config = config
        self.store = store
        self.bus = bus
        self.judge = judge
        self.registry = registry
        self.gate = PromotionGate(config.gate.tolerance, config.gate.regression_tolerance,
                                  config.gate.regression_item_tolerance, config.gate.regression_actions_lost,
                                  config.gate.holdout_min_turns,
                                  regression_total_tolerance=config.gate.regression_total_tolerance)
        self.progress = Progress()
        self._make_trainer = trainer if config.train else None
        self._trainer: LoraTrainer | None = None
        self._regression_loader = regression
        self._rehearsal_loader = rehearsal
        self._rehearsal: list[tuple[list[int], list[int]]] = []
        self._rehearsal_tools: list[set[str]] = []  # the tools each rehearsal item calls
        self._rehearsal_values: list[set[str]] = []  # ... and the text values its calls pass
        self._rehearsal_reads: list[str | None] = []  # ... and the tool whose result it answers from, if any
        # the rehearsal set's prompts as messages, in the loader's order (for rehearsal.lessons; empty: not known)
        self._rehearsal_given = list(rehearsal_messages)
        self._rehearsal_messages: list[list[dict[str, Any]] | None] = []  # ... of each item kept
        # rehearsal.repair_calls' calls and answers, each with how many of its reply's tokens are watched; read once
        self._watched: list[tuple[tuple[list[int], list[int]], int]] | None = None
        self._regression: list[tuple[list[int], list[int]]] | None = None
        # (live version, the regression set's log-probs, greedy checks and greedy replies under it)
        self._regression_live: tuple[str | None, list[float], list[bool], list[list[int]]] | None = None
        # the same for the last candidate, as it was read after its step (its greedy checks not yet
        # held to the base model's): the live version's when the gate promotes it
        self._regression_candidate: tuple[str, list[float], list[bool], list[list[int]]] | None = None
        self._kept_by_base: list[bool] | None = None  # the pinned turns the base model answers as pinned
        self._regression_base: list[float] | None = None  # the regression set's log-probs under the base model
        self._pinned = list(pinned) if config.gate.regression_actions_lost is not None else []
        self._lesson_check = lesson_check
        self._recall = recall if config.lessons and config.relesson else None
        self._index = index if config.lessons and config.gate.narrow_misled else None  # for :meth:`_narrow_misled`
        self._on_step = on_step  # test hook: called in the training thread at named points
        self._limiter = anyio.CapacityLimiter(1)  # one training thread, never the event loop
        self._judging = anyio.Lock()
        self._training = anyio.Lock()
        self._wake = anyio.Event()
        self._asked: set[str | None] = set()  # lineages whose waiting samples train at the next round (:meth:`train_now`)

    # -- running --------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled: events are the fast path, a periodic store catch-up the safety net.

        A failing round is logged and retried on the next one; the learner never takes serving down."""
        subscription = self.bus.subscribe(TURN_CLOSED, FEEDBACK_ADDED, BUS_RECONNECTED)
        async with subscription as events, anyio.create_task_group() as tg:
            await self._round(self.recover)
            await self._round(self.catch_up)
            task_status.started()
            tg.start_soon(self._follow, events)
            self._wake.set()  # the catch-up may have judged a full batch: train it now, not a poll later
            preparing = False
            while True:
                with anyio.move_on_after(self.config.poll_s):
                    await self._wake.wait()
                self._wake = anyio.Event()
                await self._round(self.catch_up)
                if not preparing and not self.ready and await self._has_samples():
                    preparing = True  # the batch fills meanwhile; its step then waits for the rest only
                    tg.start_soon(self._round, self.prepare)
                await self._round(self.train_ready)

    async def _has_samples(self) -> bool:
        try:
            return bool(await self.store.samples(split="train", untrained=True, limit=1))
        except Exception:  # the store briefly unreachable: the next round asks again
            return False

    @property
    def ready(self) -> bool:
        """Whether a step can start at once: no trainer to load (not training, or loaded already)."""
        return self._make_trainer is None or self._trainer is not None

    async def prepare(self) -> None:
        """Load the trainer now, in the training thread, rather than inside the first step: its model
        and the greedy replies of the rehearsal set (SmolLM2: minutes on a small CPU). The learner
        calls it when the first trainable sample arrives (not at start: a server whose users never
        give it anything to train loads nothing), so it overlaps with the first batch filling up.
        Busy meanwhile (a step waits)."""
        if self._make_trainer is None or self._trainer is not None:
            return
        async with self._training:
            await anyio.to_thread.run_sync(self._prepare_limited, limiter=self._limiter)

    def _prepare_limited(self) -> None:
        try:
            with limited_threads(training_threads(self.config.threads)):
                self._trainer_now()
        finally:
            release_memory()

    async def _round(self, work: Callable[[], Any]) -> None:
        try:
            await work()
        except Exception:  # e.g. the store briefly unreachable, a judge endpoint down
            log.exception("learner round failed; retrying on the next one", work=work.__name__)

    async def _follow(self, events: Any) -> None:
        async for event in events:
            if event.name == BUS_RECONNECTED:  # events may have been lost meanwhile: catch up now
                self._wake.set()
                continue
            turn_id = event.data.get("turn_id")
            if not isinstance(turn_id, str):
                continue
            try:
                await self.judge_turn(turn_id, rejudge=event.name == FEEDBACK_ADDED)
            except Exception as exc:  # the catch-up judges it later
                log.warning("judging failed; the catch-up will retry", turn=turn_id, error=repr(exc))
            self._wake.set()

    async def status(self) -> dict[str, Any]:
        """What the learner has done, and whether it still has work in hand (``busy``).

        Busy while a closed turn waits for its verdict, a verdict is being turned into credit
        and lessons, a trainable sample waits for its step (a partial batch counts: it trains
        ``batch_timeout_s`` after its first sample), or a step is running. Read from the store,
        so a turn closed a moment ago counts before its bus event arrives: a client that sees
        ``busy`` false after its last request knows everything it sent has been learned from; ``deferred``
        samples (a lineage's backoff, :meth:`_need`) wait for more and are learned from with them."""
        waiting = bool(await self.store.unjudged_turns(limit=1))
        deferred = 0  # samples that wait for more of their lineage's (``learner.backoff``): no work in hand
        if self._make_trainer is not None:
            lineages: Counter[str | None] = Counter()  # counted, not read: /health asks this often
            for user_id, n in (await self.store.untrained_counts()).items():
                lineages[self._owner(user_id)] += n
            for owner, n in lineages.items():
                need, backing_off = await self._need(owner)
                if backing_off and n < need and owner not in self._asked:
                    deferred += n
                else:
                    waiting = True
        # the locks are read after the store: work that drained the queue while we read is still in hand
        busy = waiting or self._judging.locked() or self._training.locked()
        p = self.progress
        return {"judged": p.judged, "lessons": p.lessons, "lessons_held": p.lessons_held,
                "lessons_narrowed": p.lessons_narrowed, "lessons_misled": p.lessons_misled,
                "lesson_check_s": round(p.lesson_check_s, 1), "steps": p.steps,
                "promoted": len(p.promoted), "rejected": len(p.rejected), "rolled_back": len(p.rolled_back),
                "deferred": deferred, "phase": p.phase, "work": p.work, "busy": busy}  # fmt: skip

    async def catch_up(self) -> int:
        """Judge every closed turn that has no verdict yet; returns how many were judged."""
        done = 0
        while turns := await self.store.unjudged_turns(limit=256):
            for turn in turns:
                await self._judge_or_mark(turn)
            done += len(turns)
            if len(turns) < 256:
                break
        return done

    # -- judging --------------------------------------------------------------

    async def _judge_or_mark(self, turn: Turn) -> None:
        """Judge one turn; one that fails is logged and marked with a neutral, untrainable verdict,
        so a single bad row never stops the catch-up (nor keeps ``busy`` set for good). Explicit
        feedback later judges it again. When even the mark fails (the store is down), the round fails."""
        try:
            await self.judge_turn(turn.id)
        except Exception as exc:
            log.exception("judging a turn failed; marked unjudged and skipped", turn=turn.id)
            failed = Verdict(0, None, f"judging failed: {type(exc).__name__}", "failed")
            await self._save(turn, failed)

    async def judge_turn(self, turn_id: str, *, rejudge: bool = False) -> Judgment | None:
        """Give a closed turn its verdict (again, when ``rejudge``: explicit feedback arrived)."""
        async with self._judging:
            turn = await self.store.get_turn(turn_id)
            if turn is None or turn.closed_at is None:
                return None
            existing = await self.store.get_judgment(turn_id)
            if existing is not None and (not rejudge or existing.judge == UNLEARNED_JUDGE):
                return None  # judged already; a store: false request's turns stay unlearned, feedback or not
            feedback = tuple(await self.store.list_feedback(turn_id))
            verdict = await self.judge.judge(turn, NextState.of(turn, feedback), turn.prompt_messages)
            row = await self._save(turn, verdict)
            self.progress.judged += 1
            if turn.next_state_kind in FINAL_KINDS or feedback:
                request = await self.store.request_turns(turn.request_id)
                await self._credit(request, turn, verdict)
                await self._credit_asked(request, verdict)
                if self.config.lessons:
                    await self._lesson(request, verdict)
                    await self._narrow_misled(request, verdict)
                await self._watch_live(turn.user_id)
            return row

    async def _save(self, turn: Turn, verdict: Verdict, reason: str | None = None) -> Judgment:
        has_tokens = bool(turn.response_token_ids) and len(turn.response_logprobs) == len(turn.response_token_ids)
        return await self.store.save_judgment(
            Judgment(
                turn_id=turn.id,
                user_id=turn.user_id,
                request_id=turn.request_id,
                policy_version=turn.policy_version,
                score=verdict.score,
                hint=verdict.hint,
                reason=reason or verdict.reason,
                judge=verdict.judge,
                split=await self._split(turn),
                trainable=has_tokens and (verdict.score != 0 or verdict.hint is not None) and self.trains(turn.user_id)
                and (self.config.train_corrections or not answers_correction(turn))
                and (self.config.train_tool_answers or not _reads_tool_results(turn)),
            )
        )

    def trains(self, user_id: str) -> bool:
        """Whether ``user_id``'s turns may train weights: always their own adapter (user scope); the
        shared one (global scope) only when ``learner.trusted_users`` is unset or names them."""
        trusted = self.config.trusted_users
        return self.config.scope == "user" or trusted is None or user_id in trusted

    async def _split(self, turn: Turn) -> str:
        """Held out by request, so all steps of a request land on one side: by a hash of the user and
        the request's place among theirs (its first verdict's side, once it has one). Not by the random
        request id: the same conversation, replayed into a fresh deployment, holds out the same requests."""
        if (split := await self.store.request_split(turn.request_id)) is not None:
            return split
        ordinal = await self.store.request_ordinal(turn.user_id, turn.request_id)
        digest = hashlib.sha256(f"{turn.user_id}\n{ordinal}".encode()).hexdigest()
        bucket = int(digest[:8], 16) / 0xFFFFFFFF
        return "holdout" if bucket < self.config.gate.holdout_fraction else "train"

    async def _credit(self, request: list[Turn], final: Turn, verdict: Verdict) -> None:
        """Earlier steps that their tool results left neutral share the request's outcome; a call
        whose tool failed, not yet trained, takes a correction's hint in place of the tool's error.

        A tool's error says the call was wrong; the user's correction says what was meant
        ("Unknown timezone 'Espresso'" against "The user meant Lisbon time"), which is what the
        hinted teacher needs to write the right call."""
        if verdict.score == 0 and verdict.hint is None:
            return
        for turn in request:
            if turn.step >= final.step or turn.closed_at is None:
                continue
            own = await self.store.get_judgment(turn.id)
            failed = own is not None and own.score < 0 and own.reason.endswith(TOOL_FAILED) and own.judge != "credit"
            if failed and verdict.score < 0 and verdict.hint and not own.trained_in:
                why = f"{own.reason}; the request's correction (turn {final.id}): {verdict.reason}"
                await self._save(turn, Verdict(-1, verdict.hint, why, "credit"))
                continue
            if own is not None and (own.score != 0 or own.hint or own.trained_in):
                continue
            if verdict.score > 0 and ignores_correction(turn):  # the user was pleased by an answer this call did not give
                continue
            why = f"the request's outcome (turn {final.id}): {verdict.reason}"
            await self._save(turn, Verdict(verdict.score, verdict.hint, why, "credit"))

    async def _credit_asked(self, request: list[Turn], verdict: Verdict) -> None:
        """With ``learner.credit_asked``: a correction that names what was meant teaches the earlier askings of
        the request it corrects too.

        "Is it late at home?", called wrong; "Is it late at home? Please answer the question.", answered
        wrong again; "No, I meant Lisbon time.". The first asking's steps were judged when the re-ask came,
        with a hint that names nothing ("The user had to ask again: ..."), which makes no hinted teacher
        (:func:`_taught_hint`); the hint that names Lisbon lands on the re-ask's steps, whose prompt holds the
        failed tries before it. Taught only there, the weights learn Lisbon after a failed exchange, not for
        the question asked afresh, which is how it comes next time: in bench run ED's lora arm (stop 65) three
        of alex's first askings ("Is it late at home?", "What's the time where Mum is?", "I ran 50 km today, how
        far is that?") learnt only their -1 so, beside 22 with a hint of their own.

        The earlier askings are the steps of the conversation's earlier requests whose user messages run up
        to a message of this request's chain (:func:`~whet.learner.judge.request_asks`), on a prompt that ends
        with that message. Each judged wrong with a hint that names nothing, or by its tool's error, and not
        yet trained, takes this verdict's hint. A step already trained keeps what it was trained with."""
        if (not self.config.credit_asked or verdict.score >= 0 or not verdict.hint
                or verdict.hint.startswith(CONTENT_FREE_HINTS)):
            return
        first = request[0]
        said = user_texts(first.prompt_messages)
        asks = request_asks(said)
        start = len(said) - len(asks)  # the chain's first message among the conversation's user messages
        if len(asks) < 2:
            return
        for turn in await self.store.list_turns(session_id=first.session_id, limit=64):
            messages = turn.prompt_messages or []
            own_said = user_texts(messages)
            if (turn.request_id == first.request_id or turn.closed_at is None or turn.created_at > first.created_at
                    or not messages or messages[-1].get("role") != "user"
                    or not start < len(own_said) < len(said) or own_said != said[: len(own_said)]):
                continue
            own = await self.store.get_judgment(turn.id)
            if own is None or own.trained_in or own.score >= 0:
                continue
            if own.hint and not own.hint.startswith(CONTENT_FREE_HINTS) and not own.reason.endswith(TOOL_FAILED):
                continue  # its own correction named what was meant
            why = f"{own.reason}; the correction after it was asked again (turn {request[-1].id}): {verdict.reason}"
            await self._save(turn, Verdict(-1, verdict.hint, why, "credit"))

    async def _lesson(self, request: list[Turn], verdict: Verdict) -> None:
        found = lesson_for(verdict, request)
        if found is None:
            return
        text, kind = found
        user_id = request[-1].user_id
        if any(lesson.text == text for lesson in await self.store.list_lessons(user_id)):
            return
        min_score = None
        if self._lesson_check is not None:
            started = time.perf_counter()
            try:
                broken = await self._lesson_check.broken(user_id, text)
            except Exception as exc:  # the served model unreachable: the lesson is not lost over its guard
                log.warning("lesson check failed; the lesson is added unchecked", lesson=text, error=repr(exc))
                broken = []
            finally:
                self.progress.lesson_check_s += time.perf_counter() - started
            if broken:
                min_score = narrowed(broken, self.config.gate.lesson_scope_margin)
                if min_score is None:
                    log.info("lesson held back: it breaks pinned turns", user=user_id, lesson=text,
                             broken=[str(b) for b in broken])
                    self.progress.lessons_held += 1
                    return
                log.info("lesson narrowed: it breaks pinned turns", user=user_id, lesson=text, min_score=round(min_score, 3),
                         broken=[str(b) for b in broken])
                self.progress.lessons_narrowed += 1
        lesson = await self.store.add_lesson(user_id, text, kind=kind, source_turn_id=request[-1].id, min_score=min_score)
        await self.bus.publish(LESSON_ADDED, {"lesson_id": lesson.id, "user_id": user_id})
        self.progress.lessons += 1

    async def _narrow_misled(self, request: list[Turn], verdict: Verdict) -> None:
        """Narrows each lesson that misled ``request`` (:func:`misled_lessons`; a -1 with the user's hint) as the
        lesson check narrows one that breaks a pinned turn: shown from now on only to requests
        ``learner.gate.lesson_scope_margin`` more similar to it than this one. Sam's city, copied from Sam's
        lesson into "What's the time back home?", keeps reaching the ways of asking about Sam (0.8-0.9) and
        no longer reaches home (bench run BV, bench/results/RUNS.md)."""
        if self._index is None or verdict.score >= 0 or not verdict.hint:
            return
        if not any(turn.tool_calls and shown_lessons(turn.prompt_messages) for turn in request):
            return  # no call was shown a lesson: nothing to read from the store
        user_id = request[-1].user_id
        for lesson, asked in misled_lessons(request, verdict.hint, await self.store.list_lessons(user_id)):
            score = await anyio.to_thread.run_sync(self._index.similarity, asked, lesson.text)
            floor = score + self.config.gate.lesson_scope_margin
            if lesson.id is None or (lesson.min_score is not None and lesson.min_score >= floor):
                continue
            narrowed = await self.store.narrow_lesson(lesson.id, floor)
            if narrowed is None:  # deleted meanwhile
                continue
            await self.bus.publish(LESSON_DELETED, {"lesson_id": lesson.id})
            await self.bus.publish(LESSON_ADDED, {"lesson_id": narrowed.id, "user_id": user_id})
            log.info("lesson narrowed: a call copied it into a request the user corrected", user=user_id,
                     lesson=lesson.text, request=asked, score=round(score, 3), min_score=round(floor, 3))  # fmt: skip
            self.progress.lessons_misled += 1

    # -- training -------------------------------------------------------------

    def _owner(self, user_id: str) -> str | None:
        """The lineage a user's verdict trains: the user's (per-user scope) or the global one (None)."""
        return user_id if self.config.scope == "user" else None

    def train_now(self, user_id: str) -> str | None:
        """Ask for ``user_id``'s lineage to train what it has waiting at the learner's next round, in one
        step, without waiting for a full batch, its timeout or its backoff (``POST /v1/learning/train``:
        "learn from what I said so far"). That step first judges every turn closed before it, and waits for a
        verdict being made, so it takes everything the user sent before asking. Returns the lineage (None: the
        global one)."""
        owner = self._owner(user_id)
        self._asked.add(owner)
        self._wake.set()
        return owner

    async def train_ready(self, *, force: bool = False) -> list[str]:
        """Train one step for every lineage whose batch is ready (``force``: any waiting sample, backoff
        or not). A lineage asked to train now (:meth:`train_now`) trains everything it has waiting, up to
        the most a step ever takes (``batch_size * 2**backoff``). Returns the candidate versions made."""
        if self._make_trainer is None:
            self._asked.clear()
            return []
        made = []
        async with self._training:
            asked, self._asked = self._asked, set()  # taken before the store is read: asked later, trained next round
            if asked:  # every turn closed before the ask judged first, its credit and lessons done (run EZ: a round
                # whose catch-up began before the ask read the samples while the ask's last verdict was being made)
                await self.catch_up()
                async with self._judging:  # a verdict the bus's follower is making now
                    pass
            waiting = await self.store.samples(split="train", untrained=True, limit=100_000)
            owners = sorted({self._owner(j.user_id) for j, _ in waiting}, key=lambda u: u or "")
            for user_id in owners:
                need, backing_off = await self._need(user_id)
                now = user_id in asked
                if now:
                    need = self.config.batch_size * 2**self.config.backoff
                batch = [(j, t) for j, t in waiting if self._owner(j.user_id) == user_id][:need]
                age = time.time() - batch[0][0].created_at.timestamp()
                if force or now or len(batch) >= need or (not backing_off and age >= self.config.batch_timeout_s):
                    try:
                        made.append(await self._train_step(user_id, batch))
                    except BaseException:  # the round is retried: an ask whose step failed stays asked
                        self._asked |= asked
                        raise
                    asked.discard(user_id)
        return made

    async def _need(self, owner: str | None) -> tuple[int, bool]:
        """The samples ``owner``'s lineage's next step waits for, and whether it waits for them with no
        timeout. ``learner.backoff``: after the gate turned away r candidates made from the live version,
        ``batch_size * 2**min(r, backoff)``.

        Why: once a lineage reaches the gate's bound (its drift from the base model), every step it trains
        is turned away, yet each cost minutes of the CPU that serving shares (runs DC and DD, stop 53: 8 of
        12 candidates were trained after their lineage's last promotion, ~2 min each)."""
        rejected = 0
        if self.config.backoff:
            live = await self.store.live_adapter(self.config.scope, owner)
            rejected = await self.store.rejected_children(self.config.scope, owner, live.id if live else None)
        return self.config.batch_size * 2 ** min(rejected, self.config.backoff), rejected > 0

    async def _train_step(self, user_id: str | None, batch: list[tuple[Judgment, Turn]]) -> str:
        scope = self.config.scope
        live = await self.store.live_adapter(scope, user_id)
        version = await self.registry.next_version(scope, user_id)
        folder = self.registry.folder(scope, user_id)
        holdout = await self.store.samples(split="holdout", user_id=user_id, limit=self.config.gate.holdout_max)
        held = [(j.score, t.prompt_token_ids, t.response_token_ids) for j, t in holdout if j.score != 0]
        replayed = await self._replayed_hints(user_id, live)
        # the lessons each request is shown now; None: train on the prompt as recorded
        lessons = [await self._recall(t.user_id, last_user_text(t.prompt_messages)) if self._recall else None
                   for _, t in batch + replayed]
        state = await anyio.to_thread.run_sync(
            self._step_limited, version, folder, live, batch, held, lessons, replayed, limiter=self._limiter
        )
        await self._finish(version, scope, user_id, folder / version, state)
        return version

    def _rehearsal_shown(self, trainer: LoraTrainer, version: str, user_id: str, turns: list[tuple[Judgment, Turn]]
                         ) -> tuple[list[tuple[list[int], list[int]]], int]:  # fmt: skip
        """The rehearsal items the step learns (:meth:`_rehearsal_for`), and how many of them were added showing
        lessons: with ``learner.rehearsal.lessons``, each drawn item whose request ``user_id`` would be shown
        lessons now is learned a second time beside it, on the prompt the agent would build for it with them
        (:func:`relessoned`; one that cannot be rebuilt is not added). The plain prompt stays: it is what the
        gate's pinned turns ask. Learned only with lessons (run FP, stop 79), alex's first step lost a pinned date
        sum and was turned away. Runs in the training thread; the lessons are recalled on the event loop."""
        called = {c["function"]["name"] for _, t in turns for c in t.tool_calls if c.get("function", {}).get("name")}
        passed = {v for _, t in turns for v in turn_call_values(t)}
        picked = self._rehearsal_for(version, called, passed)
        items = [self._rehearsal[i] for i in picked]
        if not (self.config.rehearsal.lessons and self._recall and self._rehearsal_messages):
            return items, 0
        shown: list[tuple[list[int], list[int]]] = []
        for (prompt, reply), i in zip(items, picked, strict=True):
            messages = self._rehearsal_messages[i]
            lessons = anyio.from_thread.run(self._recall, user_id, last_user_text(messages)) if messages else []
            rebuilt = relessoned(trainer.tokenizer, messages, prompt, lessons) if messages and lessons else None
            if rebuilt is not None:
                shown.append((rebuilt[1], reply))
        return items + shown, len(shown)

    async def _replayed_hints(self, user_id: str | None, live: Adapter | None) -> list[tuple[Judgment, Turn]]:
        """The earlier hinted samples of ``user_id``'s lineage a step trains again beside its batch, newest
        first each, none whose hint a sample drops (:func:`_taught_hint`): ``learner.replay_hints`` of those the
        live weights were not trained on (their step rejected, or retired by a rollback), then
        ``learner.replay_taught`` of those they were."""
        if self.config.replay_hints <= 0 and self.config.replay_taught <= 0:
            return []
        # the live version and its ancestors, read in one query (a lineage grows by one a promotion)
        versions = {a.id: a for a in await self.store.list_adapters(self.config.scope, user_id)}
        lineage: set[str] = set()
        adapter = live
        while adapter is not None and adapter.id not in lineage:
            lineage.add(adapter.id)
            adapter = versions.get(adapter.parent) if adapter.parent else None
        spread = self.config.replay_order == "spread"
        found: list[tuple[Judgment, Turn]] = []
        for taught, wanted in ((False, self.config.replay_hints), (True, self.config.replay_taught)):
            these: list[tuple[Judgment, Turn]] = []
            read, enough = 0, max(wanted, self.config.replay_window) if spread else wanted
            while wanted and len(these) < enough:
                page = await self.store.lineage_hints(user_id=user_id, lineage=lineage, taught=taught,
                                                      limit=min(enough - len(these), 64), offset=read)  # fmt: skip
                if not page:
                    break
                read += len(page)
                these += [(j, t) for j, t in page if _taught_hint(j.hint, t) is not None]
            found += spread_by_hint(these, wanted) if spread else these[:wanted]
        return found

    def _trainer_now(self) -> LoraTrainer:
        if self._trainer is None:
            assert self._make_trainer is not None
            self._trainer = self._make_trainer()
            if self._regression_loader is not None:
                # pinned as written: with the small talk replaced by the model's own replies (as rehearsal's
                # are), run K's gate let through steps that took general tasks from 0.94 to 0.62
                self._regression = self._regression_loader(self._trainer.tokenizer)
            if self._rehearsal_loader is not None:
                items = self_distilled(self._trainer, self._rehearsal_loader(self._trainer.tokenizer), tick=self._worked,
                                       keep_empty=True)  # fmt: skip
                given = self._rehearsal_given if len(self._rehearsal_given) == len(items) else [None] * len(items)
                kept = [i for i, (_, response) in enumerate(items) if response]
                self._rehearsal = [items[i] for i in kept]
                self._rehearsal_messages = [given[i] for i in kept]
                self._rehearsal_tools = [_called(self._trainer.tokenizer, r) for _, r in self._rehearsal]
                self._rehearsal_values = [_called_values(self._trainer.tokenizer, r) for _, r in self._rehearsal]
                self._rehearsal_reads = [_reads(self._trainer.tokenizer, p) for p, _ in self._rehearsal]
        return self._trainer

    def _step_limited(self, *args: Any) -> dict[str, Any]:
        """:meth:`_step_sync` on ``learner.threads`` CPU threads, so serving keeps the other cores."""
        try:
            with limited_threads(training_threads(self.config.threads)):
                return self._step_sync(*args)
        finally:
            self.progress.phase = None
            release_memory()

    def _step_sync(self, version: str, folder: Path, live: Adapter | None, batch: list[tuple[Judgment, Turn]],
                   held: list[tuple[int, list[int], list[int]]], lessons: list[list[str] | None],
                   replayed: list[tuple[Judgment, Turn]]) -> dict[str, Any]:  # fmt: skip
        """Runs in the training thread: replay, one step, replay, save atomically. ``lessons``: per
        turn of ``batch`` then ``replayed`` (earlier hints trained again, see :meth:`_replayed_hints`),
        :meth:`_sample`'s."""
        clock = PhaseClock(self._begun)
        with clock("start"):  # the first step's includes loading the model and self-distilling rehearsal
            trainer = self._trainer_now()
        parent = _parent_state(live)
        trainer.reset(Path(live.path) if live else None)
        baseline = (
            RunningBaseline.from_dict(parent["baseline"])
            if "baseline" in parent
            else RunningBaseline(momentum=self.config.objective.baseline_momentum)
        )
        turns = [*batch, *replayed]
        samples = [self._sample(trainer, j, t, shown) for (j, t), shown in zip(turns, lessons, strict=True)]
        regression = self._regression or []
        with clock("replay_before"):
            before = trainer.mean_logprobs([(p, r) for _, p, r in held])
            reg_before, kept_before, live_replies = self._regression_before(trainer, live.id if live else None, regression)
        self._hook("before_step")
        rehearsal, rehearsal_shown = self._rehearsal_shown(trainer, version, batch[0][1].user_id, turns)
        with clock("train"):
            stats = trainer.step(samples, baseline.value, rehearsal, self.config.rehearsal.weight,
                                 self.config.rehearsal.first_token_weight, self._anchor(trainer, rehearsal),
                                 self.config.rehearsal.kl_weight, tick=self._worked)  # fmt: skip
        with clock("repair"):
            repairs = self._repair(trainer, rehearsal)
        baseline.update([s.score for s in samples])
        with clock("replay_after"):
            reg_after = trainer.mean_logprobs(regression)
            # the gate's checks must all pass: once the regression set's likelihood alone turns the candidate
            # away, replaying the held-out turns and decoding the pinned ones cannot change that (runs CT and
            # CU turned 9 and 10 of their 12 steps away so; the pinned turns' greedy check alone took ~30 s a step)
            turned_away = not self.gate.decide(
                [], [Replayed(0, b, a) for b, a in zip(reg_before, reg_after, strict=True)], (),
                self._regression_base or (),
            ).accepted
            after = [] if turned_away else trainer.mean_logprobs([(p, r) for _, p, r in held])
        with clock("pinned_after"):
            kept_after, replies_after = ([], []) if turned_away else self._kept(trainer, regression, live_replies)
        self._regression_candidate = None if turned_away else (version, reg_after, kept_after, replies_after)
        self._hook("after_step")
        state = {
            "version": version,
            "scope": self.config.scope,
            "user_id": self._owner(batch[0][0].user_id),
            "parent": live.id if live else None,
            "batch": [t.id for _, t in batch],
            "replayed": [t.id for _, t in replayed],  # earlier hints taught again, consumed by their own steps
            # samples trained on a prompt with other lessons than they were served with
            "relessoned": sum(s.prompt_ids != t.prompt_token_ids for s, (_, t) in zip(samples, turns, strict=True)),
            "rehearsal_lessoned": rehearsal_shown,  # rehearsal items learned again with lessons shown (rehearsal.lessons)
            "baseline": baseline.to_dict(),
            "train": stats,
            # the rehearsal set's small talk within repair_margin of a call, and its watched calls no longer written
            # (rehearsal.repair_calls), before each repair pass
            "repairs": repairs,
            "holdout": [] if turned_away else [[s, b, a] for (s, _, _), b, a in zip(held, before, after, strict=True)],
            "regression": [[0, b, a] for b, a in zip(reg_before, reg_after, strict=True)],
            "regression_base": self._regression_base or [],  # under the base model: the gate bounds a lineage's drift from it
            "actions": [] if turned_away else [[b, a] for b, a in zip(kept_before, kept_after, strict=True)],
            # checks not run: the regression set's likelihood had already turned the candidate away
            "skipped": ["holdout", "actions"] if turned_away else [],
            "seconds": clock.seconds,  # where the step's time went
        }
        staging = folder / f".{version}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            staging.mkdir(parents=True)
            trainer.save(staging)
            (staging / TRAINER_STATE).write_text(json.dumps(state, indent=1))
        except OSError:  # e.g. a full disk: the step is lost, its turns wait; leave no bytes behind
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self._hook("before_publish")
        staging.rename(folder / version)  # the step exists from here on
        self._hook("after_save")
        return state

    def _rehearsal_for(self, version: str, tools: set[str], passed: set[str]) -> list[int]:
        """Which of the rehearsal set a step learns (:func:`rehearsal_draw`)."""
        return rehearsal_draw(self._rehearsal_tools, self.config.rehearsal.per_step, tools, version,
                              self._rehearsal_values, passed, self._rehearsal_reads)  # fmt: skip

    def _anchor(self, trainer: LoraTrainer, rehearsal: list[tuple[list[int], list[int]]]) -> Anchor | None:
        """``learner.rehearsal.anchor_weight``: the rehearsal set's small talk, whose odds of opening with a tool
        call the step may not raise, and the calls among the step's ``rehearsal`` draw, whose odds of it the
        step may not lower (:class:`~whet.learner.trainer.Anchor`); None when off."""
        weight, talk = self.config.rehearsal.anchor_weight, self._small_talk()
        if not weight:
            return None
        opening = call_opening(trainer.tokenizer)
        calls = [p for p, r in rehearsal if r and r[0] == opening]
        return Anchor([p for p, _ in talk], opening, weight, calls) if talk or calls else None

    def _small_talk(self) -> list[tuple[list[int], list[int]]]:
        """The rehearsal set's items whose reply calls no tool: chats, and answers read off a tool's result."""
        return [item for item, called in zip(self._rehearsal, self._rehearsal_tools, strict=True) if not called]

    def _repair(self, trainer: LoraTrainer, rehearsal: list[tuple[list[int], list[int]]]) -> list[int]:
        """``learner.rehearsal.repair_passes``: while the trained candidate opens any of the rehearsal set's
        small talk within ``repair_margin`` nats of a tool call (the odds of a reply's first token being
        the first token of a call, against the likeliest other), up to that many :meth:`LoraTrainer.repair`
        passes on those chats beside the step's ``rehearsal``; with ``repair_calls``, also while any of the set's
        watched replies (:meth:`_watched_calls`) is no longer what greedy decoding writes, on those items too.
        Returns how many chats were that close (after the first check, of those within reach: below), and watched
        replies lost, before each pass and after the last ([] when off).

        Why: a step that teaches one user's values for short requests moves every short chat towards a
        call by about the same odds (stop 37 measured +1 to +1.5 nats on most of 216 chats); the gate sees
        it when a chat that already sat near the boundary crosses it. A greedy check of the rehearsal
        chats saw nothing (none had crossed), so this reads how near each one came.

        The first check reads every chat; the checks after a repair pass read only the chats it found within
        :data:`REPAIR_REACH` of the line (passes that train replies away from calls do not bring a chat that far
        from a call across it), and every watched reply (those passes can pull a call's tokens down). A check of
        48 chats and 32 replies took ~34 s on one core of a Zen 5, 22 s of it the chats, and a step made two or
        three (run ET: 1262 s of repairs in 9 steps); after run EU's steps no chat sat within reach."""
        passes = self.config.rehearsal.repair_passes
        talk, watched = self._small_talk(), self._watched_calls(trainer) if passes else []
        if not passes or not (talk or watched):
            return []
        opening, margin = call_opening(trainer.tokenizer), self.config.rehearsal.repair_margin
        counts = []
        for n in range(passes + 1):
            odds = trainer.opening_odds([p for p, _ in talk], opening) if talk else []
            near = [item for item, o in zip(talk, odds, strict=True) if o > -margin]
            gaps = trainer.reply_gaps([p for (p, _), _ in watched], [r[:w] for (_, r), w in watched]) if watched else []
            lost = [item for (item, _), g in zip(watched, gaps, strict=True) if min(g) <= 0 and item not in near]
            counts.append(len(near) + len(lost))
            if not (near or lost) or n == passes:
                break
            if n == 0:  # a repair pass mends what the step broke; with the step's momentum it went on teaching the
                trainer.forget_momentum()  # step (run EQ: 4 calls lost, then 6, 10, 10 and 5 after four passes)
                # the checks after a pass read only the chats the step left within REPAIR_REACH of the line
                talk = [item for item, o in zip(talk, odds, strict=True) if o > -margin - REPAIR_REACH]
            trainer.repair(near + lost, rehearsal, self.config.rehearsal.weight, self.config.rehearsal.first_token_weight)
        return counts

    def _watched_calls(self, trainer: LoraTrainer) -> list[tuple[tuple[list[int], list[int]], int]]:
        """``learner.rehearsal.repair_calls`` of the rehearsal set's replies that the base model writes greedily
        by more than ``gate.pinned_tie_margin`` nats at their closest token (the replies the gate's greedy check
        would count; a near tie the noise of any step tips, run EQ, it does not), each with how many of its tokens
        are watched: a tool call whole, an answer read off a tool's result to :func:`_answer_window`. Taken round
        robin over the tools they call or read (a tool's calls and its answers apart, and its answers by the word they
        open with, :func:`_answer_form`), the closest first; read once, under the base weights.

        Answers too, because the gate holds them: run ES turned away three of alex's steps in a row, each for one
        pinned answer (the date that "Which date is 78 days from 2027-01-02?" reads off ``add_to_date``), which
        no watched call would have shown."""
        wanted, margin = self.config.rehearsal.repair_calls, self.config.gate.pinned_tie_margin
        if self._watched is None:
            self._watched = []
            watchable = []  # (item, the tool it calls or answers from, how many of its reply's tokens are watched)
            # with repair_calls 0 nothing is gathered, nor read under the base weights
            rehearsal = zip(self._rehearsal, self._rehearsal_tools, self._rehearsal_reads, strict=True) if wanted else ()
            for item, tools, read in rehearsal:
                if tools:
                    watchable.append((item, min(tools), len(item[1])))
                elif read:
                    form = f"{read}, answered {_answer_form(trainer.tokenizer, item[1])}".rstrip()
                    watchable.append((item, form, _answer_window(trainer.tokenizer, item[1])))
            if watchable:
                with trainer.model.disable_adapter():
                    gaps = trainer.reply_gaps([p for (p, _), _, _ in watchable], [r[:n] for (_, r), _, n in watchable])
                by_kind: dict[str, list[tuple[float, int]]] = {}
                for i, ((_, kind, _), gap) in enumerate(zip(watchable, gaps, strict=True)):
                    if gap and min(gap) > margin:
                        by_kind.setdefault(kind, []).append((min(gap), i))
                order = round_robin(sorted(picks) for _, picks in sorted(by_kind.items()))
                self._watched = [(watchable[i][0], watchable[i][2]) for _, i in order[:wanted]]
        return self._watched

    def _regression_before(self, trainer: LoraTrainer, live: str | None,
                           regression: list[tuple[list[int], list[int]]],
                           ) -> tuple[list[float], list[bool], list[list[int]]]:  # fmt: skip
        """The regression set under the live version (loaded in ``trainer``): its log-probs, and
        :meth:`_kept` with the greedy replies (a candidate's likeliest guesses); the same for every
        candidate made from it, so it is replayed once per live version.

        A pinned turn counts as kept only where the base model keeps it too: the gate holds the skill the
        model came with. A turn the base answers wrong sits near a tie (the warm start left "Note that seat
        14C on the train." answered in words); a promoted step that happened to get it right made every
        later candidate that tipped it back a "loss", and the gate turned away 8 steps in a row for it."""
        if self._regression_live is None or self._regression_live[0] != live:
            candidate = self._regression_candidate
            if candidate is not None and candidate[0] == live:
                # promoted: read after its step, with these very weights (saved in full precision)
                self._regression_live = candidate[0], candidate[1], self._held_to_base(candidate[2]), candidate[3]
                return self._regression_live[1:]
            # the version before's replies are the likeliest guesses; the pinned replies the first time
            guesses = self._regression_live[3] if self._regression_live else [r for _, r in regression]
            kept, replies = self._kept(trainer, regression, guesses)
            logprobs = trainer.mean_logprobs(regression)
            # the base model's checks and log-probs, read once: the live version's when it is the base
            if self._kept_by_base is None and live is None:
                self._kept_by_base = self._surely_kept(trainer, regression, kept, replies)
                self._regression_base = logprobs
            elif self._kept_by_base is None:
                with trainer.model.disable_adapter():
                    self._kept_by_base = self._surely_kept(trainer, regression, *self._kept(trainer, regression, guesses))
                    self._regression_base = trainer.mean_logprobs(regression)
            self._regression_live = (live, logprobs, self._held_to_base(kept), replies)
        return self._regression_live[1:]

    def _held_to_base(self, kept: list[bool]) -> list[bool]:
        """``kept`` (a version's greedy checks of the pinned turns) counting only the turns the base model
        keeps too (:meth:`_regression_before`)."""
        if self._kept_by_base is None or len(self._kept_by_base) != len(kept):
            return kept
        return [k and base for k, base in zip(kept, self._kept_by_base, strict=True)]

    def _surely_kept(self, trainer: LoraTrainer, regression: list[tuple[list[int], list[int]]], kept: list[bool],
                     replies: list[list[int]]) -> list[bool]:  # fmt: skip
        """Of the pinned turns the model in ``trainer`` keeps (``kept``, its greedy ``replies``), those it keeps
        by more than ``gate.pinned_tie_margin``: a pinned call whose reply has a token within that many nats
        of another is a near tie, which any step's noise tips either way, and is left out of the count."""
        margin = self.config.gate.pinned_tie_margin
        calls = [i for i, k in enumerate(kept) if k and self._pinned[i].calls]
        if not margin or not calls:
            return kept
        gaps = trainer.reply_gaps([regression[i][0] for i in calls], [replies[i] for i in calls])
        ties = {i for i, g in zip(calls, gaps, strict=True) if g and min(g) < margin}
        if ties:
            log.info("pinned calls near a tie: not counted by the gate's greedy check", items=sorted(ties),
                     margin=margin)  # fmt: skip
        return [k and i not in ties for i, k in enumerate(kept)]

    def _kept(self, trainer: LoraTrainer, regression: list[tuple[list[int], list[int]]],
              guesses: list[list[int]] | None) -> tuple[list[bool], list[list[int]]]:  # fmt: skip
        """Whether the adapter in ``trainer`` answers each pinned turn, greedily, as it pins
        (:class:`PinnedAction`), and its replies, as long as :meth:`PinnedAction.tokens` reads.
        ``guesses``: replies it likely gives (the live version's), which only save time."""
        if not self._pinned or len(self._pinned) != len(regression):
            return [], []
        return pinned_checks(trainer, self._pinned, regression, guesses)

    def _sample(self, trainer: LoraTrainer, judgment: Judgment, turn: Turn, lessons: list[str] | None) -> Sample:
        """The turn as a training sample; with ``lessons``, on the prompt that shows them instead of
        the lessons it was served with (a prompt that cannot be rebuilt faithfully stays as recorded)."""
        score, hint = judgment.score, _taught_hint(judgment.hint, turn)
        messages, prompt_ids = turn.prompt_messages, turn.prompt_token_ids
        if lessons is not None:
            messages, prompt_ids = relessoned(trainer.tokenizer, messages, prompt_ids, lessons) or (messages, prompt_ids)
        if _reads_tool_results(turn):  # learns from success only (:func:`_taught_hint`)
            score = max(score, 0)
        if score < 0 and copied_from_lessons(trainer.tokenizer, turn.response_token_ids, messages):
            score = 0  # a lesson misled it: its hint, if any, teaches the right call; no negative on copying
        teacher = None
        if hint:
            teacher = hinted_prompt_ids(trainer.tokenizer, messages, prompt_ids, hint)
        return Sample(
            turn_id=turn.id,
            prompt_ids=prompt_ids,
            response_ids=turn.response_token_ids,
            behaviour_logprobs=turn.response_logprobs,
            score=score,
            teacher_prompt_ids=teacher,
        )

    def _hook(self, point: str) -> None:
        if self._on_step is not None:
            self._on_step(point)

    def _begun(self, phase: str) -> None:
        """A step's ``phase`` begins (in the training thread): :meth:`status` shows it, and counts it as work."""
        self.progress.phase = phase
        self._worked()

    def _worked(self) -> None:
        self.progress.work += 1

    async def _finish(self, version: str, scope: str, user_id: str | None, path: Path, state: dict[str, Any]) -> None:
        """Register a saved version with its batch, then gate it: promote or reject."""
        adapter = Adapter(id=version, scope=scope, user_id=user_id if scope == "user" else None, path=str(path),
                          parent=state["parent"], metrics={"train": state["train"], "batch_size": len(state["batch"]),
                                   "replayed": len(state.get("replayed", [])),
                                   "seconds": state.get("seconds"), "repairs": state.get("repairs")})  # fmt: skip
        await self.store.register_candidate(adapter, state["batch"])
        row = await self.store.get_adapter(version)
        if row is None or row.status != "candidate":
            return  # decided before a restart
        decision = self.gate.decide(
            [Replayed(*r) for r in state["holdout"]], [Replayed(*r) for r in state["regression"]],
            [(bool(b), bool(a)) for b, a in state.get("actions", [])], state.get("regression_base", ()),
        )
        gate = {"accepted": decision.accepted, "reason": decision.reason, **decision.metrics}
        if state.get("skipped"):
            gate["skipped"] = state["skipped"]  # not replayed: the regression set had already decided
        self.progress.steps += 1
        self.progress.last_step = {"version": version, **gate}
        if decision.accepted:
            await self.registry.promote(version, gate=gate)
            self.progress.promoted.append(version)
            log.info("adapter promoted", version=version, reason=decision.reason)
        else:
            await self.store.update_adapter(version, status="rejected", metrics={**row.metrics, "gate": gate})
            self.progress.rejected.append(version)
            log.warning("adapter rejected", version=version, reason=decision.reason)

    async def recover(self) -> None:
        """Finish versions a crash left between disk and store, and drop half-written folders."""
        if not self.registry.root.is_dir():
            return
        for state_file in sorted(self.registry.root.rglob(TRAINER_STATE)):
            folder = state_file.parent
            if folder.name.startswith("."):
                continue
            state = json.loads(state_file.read_text())
            row = await self.store.get_adapter(state["version"])
            if row is None or row.status == "candidate":
                log.info("finishing a version a restart interrupted", version=state["version"])
                await self._finish(state["version"], state["scope"], state["user_id"], folder, state)
        for partial in self.registry.root.rglob(".*.partial"):
            shutil.rmtree(partial, ignore_errors=True)

    # -- rollback -------------------------------------------------------------

    async def _watch_live(self, user_id: str) -> None:
        """Roll back a live version whose rolling judged score fell below its predecessor's by more
        than the margin and by more than chance explains: ``rollback_z`` standard errors of the
        difference of the two windows' means. Verdicts are +1 or -1, so two windows of 16 turns (of
        different requests) differ by ~0.35 by chance alone (one standard error); a margin of 0.25 by
        itself rolled back four of the seven steps run O's weights arms promoted (+0.38 then +0.00,
        +0.38 then -0.25, +0.25 then -0.25 twice), none beyond two standard errors (~0.68)."""
        owner = user_id if self.config.scope == "user" else None
        live = await self.store.live_adapter(self.config.scope, owner)
        if live is None:
            return
        window = self.config.gate.rollback_window
        now = await self.store.recent_scores(live.id, window)
        before = await self.store.recent_scores(live.parent, window)
        if len(now) < window or len(before) < window:
            return
        gate = self.config.gate
        mean_now, mean_before = fmean(now), fmean(before)
        noise = gate.rollback_z * math.sqrt((pvariance(now, mean_now) + pvariance(before, mean_before)) / window)
        if mean_now < mean_before - max(gate.rollback_margin, noise):
            reason = f"rolling judged score {mean_now:+.2f} fell below its predecessor's {mean_before:+.2f}"
            await self.registry.rollback(self.config.scope, owner, reason)
            self.progress.rolled_back.append(live.id)
            log.warning("adapter rolled back", version=live.id, reason=reason)


def spread_by_hint(samples: Sequence[tuple[Judgment, Turn]], n: int) -> list[tuple[Judgment, Turn]]:
    """Up to ``n`` of ``samples`` (newest first), taken round robin over their distinct hints: the newest sample
    of each hint in the order the hints were last given, then the second newest of each, and so on."""
    groups: dict[str, list[tuple[Judgment, Turn]]] = {}
    for sample in samples:
        groups.setdefault(" ".join((sample[0].hint or "").split()).casefold(), []).append(sample)
    return round_robin(groups.values())[:n]


T = TypeVar("T")
_NONE: Any = object()  # a gap in round_robin's rows, never an item


def round_robin(groups: Iterable[Sequence[T]]) -> list[T]:
    """The first item of each group in turn, then the second of each, and so on."""
    return [item for row in itertools.zip_longest(*groups, fillvalue=_NONE) for item in row if item is not _NONE]



def _taught_hint(hint: str | None, turn: Turn) -> str | None:
    """The hint a sample of ``turn`` learns from (shown to its hinted teacher), or None.

    An answer written from tool results said what the tools returned: a correction of it is a
    correction of the call that fed it, which gets the verdict by credit. So such an answer learns
    from success only; taught "not Paris" after a Paris result, or given a hinted teacher that says
    Lisbon over it, it would learn to misreport.

    A hint that names nothing ("The user had to ask again: Is it late at home?") says the action was
    wrong, not what was right: shown it, the teacher wrote another made-up answer ("It is 12:15 in
    Ashton."), and learning that taught answering in words where a tool was wanted (two pinned calls
    went to text). Such a sample learns from its score alone, as lessons do."""
    if not hint or _reads_tool_results(turn) or hint.startswith(CONTENT_FREE_HINTS):
        return None
    return hint


def _reads_tool_results(turn: Turn) -> bool:
    """Whether the turn's prompt ends with tool results: the step after a tool call."""
    messages = turn.prompt_messages or []
    return bool(messages) and messages[-1].get("role") == "tool"


def answers_correction(turn: Turn) -> bool:
    """Whether ``turn`` is the first step of a request that corrects the one before it: its user message
    is one the judge reads a correction from (:func:`correction_hint`)."""
    return turn.step == 0 and correction_hint(last_user_text(turn.prompt_messages)) is not None


def pinned_checks(trainer: LoraTrainer, pinned: Sequence[PinnedAction], regression: list[tuple[list[int], list[int]]],
                  guesses: list[list[int]] | None = None) -> tuple[list[bool], list[list[int]]]:  # fmt: skip
    """Whether the model in ``trainer`` answers each of the ``regression`` set's turns, greedily, as its
    ``pinned`` action says (:meth:`PinnedAction.kept`), and its replies, as long as :meth:`PinnedAction.tokens`
    reads. ``guesses``: replies it likely gives, which only save time."""
    limits = [action.tokens(len(r)) for action, (_, r) in zip(pinned, regression, strict=True)]
    replies = trainer.greedy_actions([p for p, _ in regression], limits, guesses)
    stops = stop_token_ids(trainer.tokenizer, trainer.model)
    texts = [trainer.tokenizer.decode(r[:-1] if r and r[-1] in stops else r) for r in replies]
    return [action.kept(text) for action, text in zip(pinned, texts, strict=True)], replies


def rehearsal_draw(items: list[set[str]], n: int, tools: set[str], seed: str,
                   values: list[set[str]] | None = None, passed: set[str] = frozenset(),
                   reads: list[str | None] | None = None) -> list[int]:  # fmt: skip
    """Which rehearsal items (each given as the tools it calls) a step whose batch called ``tools``
    rehearses: ``n`` of them. A third (where there are such) are calls of those same tools, what a
    batch that teaches one user's value for a tool is most likely to disturb (the same tool called
    with the value a request names); a third are small talk (no tool), what a batch made only of
    calls pushes towards a call (run M's gate rejected 8 of 10 weights-arm steps for a tool called
    on "Hello!"); a sixth are answers read off a tool's result, one tool's in turn (``reads``: the
    tool whose result each item answers from, None for the rest), because a batch that teaches a
    user's clock answers rewrites the answers read off other tools' results in their shape (run DX:
    "It is a Saturday in August 2026." for a date sum) and one answer a step, drawn as small talk,
    did not hold them; the rest are drawn from all. Seeded (by the version's name), so a step redone
    after a crash draws the same.

    ``values`` (the text values each item's calls pass) and ``passed`` (those the batch's calls
    passed): the same-tool third comes first from items that pass one of the batch's values, one
    for each such value in turn, so that a value few items pass is not crowded out. They
    are the contrast a user's preference needs: a batch teaching that "How hot is 12 °C?" means
    kelvin called ``convert(from_unit="celsius", ...)``, and "Convert 12 celsius to fahrenheit."
    keeps the unit a request names (run BH's steps learnt kelvin and lost that pinned turn). Alone it
    did not keep it: in run BN the turn was lost to the momentum a step carries from the version
    before (``learner.lora.carry_momentum``)."""
    rng = random.Random(seed)
    n = min(n, len(items))
    reads = reads or [None] * len(items)
    same = [i for i, called in enumerate(items) if called & tools]
    talk = [i for i, called in enumerate(items) if not called and not reads[i]]
    k = min(len(same), n // 3)
    # one item for each value the batch passed that some item passes too, in turns, then any
    pools = [pool for v in sorted(passed) if (pool := [i for i in same if values and v in values[i]])]
    rng.shuffle(pools)
    picked: list[int] = []
    while len(picked) < k and pools:
        pools = [left for pool in pools if (left := [i for i in pool if i not in picked])]
        for pool in pools[: k - len(picked)]:
            if (i := rng.choice(pool)) not in picked:
                picked.append(i)
    taken = set(picked)
    picked += rng.sample([i for i in same if i not in taken], k - len(picked))
    picked += rng.sample(talk, min(len(talk), n // 3))
    picked += _spread(rng, {i: tool for i, tool in enumerate(reads) if tool and not items[i]}, n // 6)
    taken = set(picked)
    rest = [i for i in range(len(items)) if i not in taken]
    return picked + rng.sample(rest, n - len(picked))


def _spread(rng: random.Random, groups: Mapping[int, str], k: int) -> list[int]:
    """Up to ``k`` of ``groups``' items (item -> its group), one of each group in turn, the groups in a
    random order."""
    pools: dict[str, list[int]] = {}
    for i, group in groups.items():
        pools.setdefault(group, []).append(i)
    order = sorted(pools)
    rng.shuffle(order)
    for pool in pools.values():
        rng.shuffle(pool)
    picked: list[int] = []
    while len(picked) < k and any(pools.values()):
        picked += [pools[group].pop() for group in order if pools[group]][: k - len(picked)]
    return picked


_NUMBER = re.compile(r"[-+]?[\d.,]+")


def call_values(arguments: Any) -> set[str]:
    """The text values of a call's ``arguments`` (a dict; anything else has none), casefolded: what a
    call names ("celsius", "Honolulu", "work"). Numbers are left out: every sum and date has them."""
    if not isinstance(arguments, Mapping):
        return set()
    return {v.strip().casefold() for v in argument_values(arguments) if v.strip() and not _NUMBER.fullmatch(v.strip())}


def turn_call_values(turn: Turn) -> set[str]:
    """The text values the calls a recorded ``turn`` made pass (:func:`call_values`)."""
    return {v for call in turn.tool_calls
            for v in call_values(parse_arguments((call.get("function") or {}).get("arguments")))}  # fmt: skip


_CALLED = re.compile(r'"name":\s*"([^"]+)"')


def _called(tokenizer: Any, response: list[int]) -> set[str]:
    """The tools a rehearsal reply calls (none for small talk)."""
    text = tokenizer.decode(response)
    return set(_CALLED.findall(text)) if TOOL_CALL_OPEN in text else set()


def _reads(tokenizer: Any, prompt: list[int]) -> str | None:
    """The tool whose result a rehearsal prompt ends with (its reply an answer read off it), or None: the
    last call's name, where nothing but the result came after it."""
    text = tokenizer.decode(prompt)
    before, _, after = text.rpartition(TOOL_RESPONSE_CLOSE)
    if not before or TOOL_CALL_OPEN in after or after.count(IM_START) > 1:
        return None
    names = _CALLED.findall(before.rpartition(TOOL_CALL_OPEN)[2])
    return names[0] if names else None


def _answer_window(tokenizer: Any, reply: list[int]) -> int:
    """How many tokens of an answer read off a tool's result the repair watches: its opening
    (:data:`~whet.learner.gate.ANSWER_OPENING`, where the gate decides an answer with no number), and on to its last
    token that writes a digit (an answer's numbers are what the gate's greedy check holds it to)."""
    digits = [i for i, token in enumerate(reply) if any(c.isdigit() for c in tokenizer.decode([token]))]
    return max(min(len(reply), ANSWER_OPENING), digits[-1] + 1 if digits else 0)


def _answer_form(tokenizer: Any, reply: list[int]) -> str:
    """The word an answer read off a tool's result opens with, lower-cased, or "" when it holds a digit (a
    value, not a form): a tool's answers take a few forms, and the repair watches each, because a step
    can move one form into another's place. Run FJ's ``memory_lora`` answered an ``add_note`` call that put
    a reminder on the errands list "Saved the note: pick up the parcel." (a note's form), which does not
    name the list; its two watched ``add_note`` answers could both be of one form."""
    words = tokenizer.decode(reply).split(maxsplit=1)
    word = words[0].strip(".,:;!?\"'").lower() if words else ""
    return "" if any(c.isdigit() for c in word) else word


def _called_values(tokenizer: Any, response: list[int]) -> set[str]:
    """The text values a rehearsal reply's calls pass (:func:`call_values`)."""
    _, calls, _ = split_tool_calls(tokenizer.decode(response))
    return {v for _, arguments in calls for v in call_values(arguments)}


def copied_from_lessons(tokenizer: Any, response: list[int], messages: Sequence[dict[str, Any]]) -> set[str]:
    """The text values ``response``'s calls pass that a lesson shown in ``messages`` spells, as a whole word.

    A -1 on such a call says that the lesson it copied was another request's, not that copying a lesson is
    wrong; but its evaluative negative pushes down the copied tokens in a prompt whose lesson spells them,
    and what the weights learn from that is not to read lessons. Seen in ``whet bench learn`` (run BV,
    bench/results/RUNS.md): a -1 on "What's the time back home?" answered with Sam's city, copied from
    Sam's lesson, and from the next step on "What time is it at Sam's place?" was written
    ``Sam's place`` beside three lessons saying Tokyo. Such a sample is trained with score 0
    (:meth:`Learner._sample`): no RL term; its hint, when it has one, still teaches the right call."""
    lessons = shown_lessons(messages)
    return {v for v in _called_values(tokenizer, response) if _spells(lessons, v)} if lessons else set()


_QUOTED = re.compile(r'"([^"]+)"')  # the user's own words in a hint (learner.judge.CORRECTIONS quotes them)
_WORD = re.compile(r"\w+")


def _spells(text: str, value: str) -> bool:
    """Whether ``text`` holds ``value`` (casefolded, as :func:`call_values` gives it) as a whole word or words."""
    return re.search(rf"(?<!\w){re.escape(value)}(?!\w)", text.casefold()) is not None


def misled_lessons(request: Sequence[Turn], hint: str, lessons: Sequence[Lesson]) -> list[tuple[Lesson, str]]:
    """The lessons among ``lessons`` that misled ``request``, which the user corrected with ``hint``, each with
    the request's text: shown in the prompt of one of its calls, what the lesson says (:func:`lesson_said`)
    spells, as a whole word, a value the call passed that neither the request nor the hint spells (so the
    value came from the lesson, and it was not what the user meant), and none of the words the hint adds to
    the request and the call (what the user meant instead: a lesson that says it agrees with them).

    Two of a reminder's lessons spell ``"kind": "todo"`` beside its list: one says the list the call wrote and
    misled it, the other says the list the user meant and did not. A request that is itself a correction
    is left alone (what it was shown was chosen for the correction's words), and a -1 without a hint says
    nothing of where the wrong value came from."""
    meant = set(_WORD.findall((" ".join(_QUOTED.findall(hint)) or hint).casefold()))
    found: dict[int, tuple[Lesson, str]] = {}
    for turn in request:
        if answers_correction(turn):
            continue
        values = turn_call_values(turn)
        asked = last_user_text(turn.prompt_messages)
        copied = {v for v in values if not _spells(f"{asked}\n{hint}", v)}
        instead = meant - set(_WORD.findall(f"{asked} {' '.join(values)}".casefold()))
        shown = f"\n{shown_lessons(turn.prompt_messages)}\n"
        for lesson in lessons:
            said = lesson_said(lesson.text)
            if (lesson.id is not None and lesson.id not in found and f"\n- {lesson.text}\n" in shown
                    and any(_spells(said, v) for v in copied) and not any(_spells(said, w) for w in instead)):
                found[lesson.id] = (lesson, asked)
    return list(found.values())


def self_distilled(trainer: LoraTrainer, items: list[tuple[list[int], list[int]]], max_tokens: int = 64,
                   tick: Callable[[], None] | None = None, keep_empty: bool = False) -> list[tuple[list[int], list[int]]]:  # fmt: skip
    """The rehearsal set with each reply that is not a tool call replaced by the base model's own
    (greedy, before any training): rehearsal then keeps how this model already talks instead of
    teaching it the set's wording, which moved the gate's pinned small talk ("Hello!" fell 0.69
    nats/token in one step). Tool calls keep the set's text: the right call is the skill. The replies are
    decoded together (:meth:`LoraTrainer.greedy_actions`, the prompts' shared prefix read once); ``tick``: called
    after each reply the model wrote (the set holds dozens; a batch is seconds to a minute on one slow core).
    An item the model answers with nothing is left out (``keep_empty``: kept, its reply empty, so the result lines
    up with ``items``)."""
    asked = [i for i, (_, response) in enumerate(items) if TOOL_CALL_OPEN not in trainer.tokenizer.decode(response)]
    written = dict(zip(asked, trainer.greedy_actions([items[i][0] for i in asked], [max_tokens] * len(asked), tick=tick),
                       strict=True))  # fmt: skip
    out = [(prompt, written.get(i, list(response))) for i, (prompt, response) in enumerate(items)]
    return out if keep_empty else [(prompt, response) for prompt, response in out if response]


def _parent_state(live: Adapter | None) -> dict[str, Any]:
    if live is None:
        return {}
    path = Path(live.path) / TRAINER_STATE
    return json.loads(path.read_text()) if path.is_file() else {}


def regression_path(setting: str | None, bundled: str = "regression.jsonl") -> Path | None:
    """``learner.gate.regression_set`` (or ``learner.rehearsal.set``, with ``bundled="rehearsal.jsonl"``)
    as a file: ``bundled`` is the shipped set of general skill."""
    if setting is None:
        return None
    if setting == "bundled":
        from importlib import resources

        return Path(str(resources.files("whet.config").joinpath(bundled)))
    return Path(setting).expanduser()


def rehearsal_path(setting: str | None) -> Path | None:
    """``learner.rehearsal.set`` as a file: ``bundled`` is the shipped rehearsal set."""
    return regression_path(setting, "rehearsal.jsonl")


def lesson_probes_path(setting: str | None) -> Path | None:
    """``learner.gate.lesson_probes`` as a file: ``bundled`` is the shipped lesson probes."""
    return regression_path(setting, "lesson_probes.jsonl")


def check_config(config: WhetConfig, *, standalone: bool) -> None:
    """Raise ConfigError for learner settings that cannot work (checked before a server binds).

    ``standalone``: the learner runs without the server, so an LLM judge needs its own endpoint."""
    learner = config.learner
    if learner.judge.kind == "rules+llm" and standalone and not learner.judge.base_url:
        raise ConfigError("learner.judge.base_url", "the LLM judge has no model to ask when the learner runs "
                          "without the server", "set learner.judge.base_url to an OpenAI-compatible endpoint")  # fmt: skip
    regression = regression_path(learner.gate.regression_set)
    if regression is not None and not regression.is_file():
        raise ConfigError("learner.gate.regression_set", f"{regression} does not exist", "point it at a JSONL file or null")
    rehearsal = rehearsal_path(learner.rehearsal.set)
    if rehearsal is not None and not rehearsal.is_file():
        raise ConfigError("learner.rehearsal.set", f"{rehearsal} does not exist", "point it at a JSONL file or null")
    probes = lesson_probes_path(learner.gate.lesson_probes)
    if probes is not None and not probes.is_file():
        raise ConfigError("learner.gate.lesson_probes", f"{probes} does not exist", "point it at a JSONL file or null")


def open_learner(config: WhetConfig, store: Store, bus: Bus, *, chat: ChatModel | None = None,
                 index: LessonIndex | None = None, generate: Generate | None = None) -> Learner:  # fmt: skip
    """The learner ``config`` describes. ``chat``: the served model, for an LLM judge without its own endpoint;
    ``index`` and ``generate``: the agent's lessons and the served model's greedy replies, for the lesson
    check (``learner.gate.check_lessons``; without them lessons are added unchecked).

    Raises ConfigError for a setting that cannot work (an LLM judge with no model to ask,
    a regression set that does not exist).
    """
    check_config(config, standalone=chat is None)
    learner = config.learner
    judge: Judge = RulesJudge()
    if learner.judge.kind == "rules+llm":
        j = learner.judge
        if j.base_url:
            chat = OpenAIChat(j.base_url, j.api_key, model=j.model or config.model.name)
        assert chat is not None  # check_config
        judge = ComposedJudge(judge, LLMJudge(chat, votes=j.votes, temperature=j.temperature))
    regression = regression_path(learner.gate.regression_set)
    rehearsal = rehearsal_path(learner.rehearsal.set)
    rehearsed = read_records(rehearsal, "learner.rehearsal.set") if rehearsal else []  # read once, at start
    trainer = None
    if config.model.backend == "openai":
        log.info("the openai backend cannot change weights: the learner keeps lessons only")
    else:
        objective = objective_from_config(learner.objective)

        def trainer() -> LoraTrainer:
            source = resolve_source(config.model.id, config.data_path)
            return LoraTrainer.load(source, learner.lora, objective, device=learner.device, dtype=config.model.dtype)

    records = read_records(regression) if regression else []  # read once: the gate's set and the lesson check's turns
    pinned = pinned_turns(records)
    check = None
    if learner.gate.check_lessons and learner.lessons and pinned:
        if index is not None and generate is not None:
            probes = lesson_probes_path(learner.gate.lesson_probes)
            asked = learner.gate.lesson_probes_asked
            probe_turns = pinned_turns(read_records(probes, "learner.gate.lesson_probes")) if probes and asked else []
            check = LessonCheck(pinned, index, config.agent, generate, probe_turns, asked)
        else:
            log.info("lessons are added unchecked: the lesson check needs the served model (whet serve)")
    return Learner(
        learner,
        store,
        bus,
        judge,
        AdapterRegistry(store, bus, config.data_path / "adapters"),
        trainer=trainer,
        regression=(lambda tokenizer: encode_records(records, tokenizer)) if regression else None,
        pinned=[turn.action for turn in pinned],
        rehearsal=(lambda tokenizer: encode_records(rehearsed, tokenizer)) if rehearsal else None,
        rehearsal_messages=[r["messages"] for r in rehearsed],
        lesson_check=check,
        recall=(lambda user_id, query: recall(index, config.agent, user_id, query)) if index is not None else None,
        index=index,
    )
