"""``whet bench learn``: does whet get better by being used, and does it forget what it knew?

A simulated user (``whet.world.user``) with one profile of preferences drives a
live ``whet serve`` through its public HTTP API for N interactions: ask, read the
answer, reply (thanks, a correction or a re-ask), so the real judge, learner, gate and
hot-swaps do the learning. After every k interactions, held-out tasks (phrasings and
values the user never asked) are answered at temperature 0 in fresh sessions, sent with
``store: false`` so evaluation is never learned from, and the tool calls the agent
made are checked against the profile. General tasks that need no preference are
checked before and after, to show learning cost no general skill.

Four arms start from the same base model and differ only in what the learner may
change: ``static`` (no learner), ``memory`` (lessons only), ``lora`` (weights only) and
``memory_lora`` (both). Each arm gets its own server process and data directory, one
after the other, so no arm sees another's experience.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from statistics import fmean
from typing import Any, Protocol

import httpx
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from whet.config.settings import ConfigError, WhetConfig, read_config_file
from whet.learner.clock import PhaseClock
from whet.learner.prompt import parse_arguments

# what each arm lets the learner change: (learner runs, weights train, lessons kept)
ARM_LEARNING = {
    "static": (False, False, False),
    "memory": (True, False, True),
    "lora": (True, True, False),
    "memory_lora": (True, True, True),
}
ARMS = tuple(ARM_LEARNING)
# The learner as the bench runs it: a weights arm asks for a step at each checkpoint (POST
# /v1/learning/train), which trains every verdict of the interactions since the last in one step;
# no batch fills or times out before that (a batch as large as a block of interactions gives; a
# timeout longer than a block takes on a slow CPU, which only a lost ask would reach); a store
# catch-up twice a second. Every other learner setting comes from the base config.
# Why: with batches of 8 flushed a second after their first sample, a block's ~20 verdicts
# went in 3-4 steps of 5.6-8.3 min each, whatever their size (run EW, stop 73).
LEARNER_OVERRIDES: dict[str, Any] = {"batch_size": 32, "batch_timeout_s": 900, "poll_s": 0.5}
# A few dozen interactions give about a dozen optimizer steps: the LoRA learning rate is raised
# from the default (tuned for billion-parameter models) to one that moves the demo policy. At 5e-4
# a step turned pinned chats into tool calls and the gate rejected it (bench/results/RUNS.md, stop 34),
# until the rehearsal's anchor held small talk's odds of a call (learner.rehearsal.anchor_weight, stops 39-41);
# 2e-3 with the hold to the base model (learner.rehearsal.kl_weight) and the repair since stop 68 (run EO on).
LORA_OVERRIDES: dict[str, Any] = {"learning_rate": 2e-3}
DEFAULTS = {"interactions": 32, "every": 8, "heldout": 24, "general": 16, "chat": 12}
QUICK = {"interactions": 4, "every": 2, "heldout": 3, "general": 3, "chat": 2}  # CI scale
THRESHOLD = 0.9
EVAL_CONCURRENCY = 8  # held-out, general and chat-probe requests in flight at once
REPLIES = 2  # the user's replies in one interaction: to the answer, and to the retry after a correction
START_TIMEOUT_S = 300.0  # model load and MCP servers starting
IDLE_TIMEOUT_S = 900.0  # a busy learner showing no progress (no verdict, lesson or step) this long has stalled
REQUEST_TIMEOUT_S = 600.0  # one chat request, every agent step included
POLL_S = 0.1
ANSI = re.compile(r"\x1b\[[0-9;]*m")


class BenchError(Exception):
    """The bench cannot go on; the message says why (and, for a server, ends with its log tail)."""


class ArmStopped(BenchError):
    """An arm stopped early because another arm failed: the run is over, its time is not spent."""


def _go_on(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise ArmStopped("stopped: another arm failed")


class ArmClient(Protocol):
    """What the bench needs from one arm's server (HTTP in the bench, a fake in tests)."""

    def chat(self, session: str, messages: list[dict[str, str]], **params: Any) -> str:
        """The final answer to ``messages`` in ``session``."""
        ...

    def tool_calls(self, session: str) -> list[Any]:
        """Every tool call the agent made in ``session``, oldest first, as ``ToolUse``."""
        ...

    def health(self) -> dict[str, Any]:
        """The server's ``/health`` body."""
        ...

    def learning(self) -> dict[str, Any]:
        """The server's ``/v1/learning`` body for the bench's user (its adapters, each step's seconds)."""
        ...

    def train(self) -> None:
        """Ask the learner to train what the bench's user has waiting now, in one step."""
        ...


class Task(Protocol):
    text: str

    def check(self, calls: list[Any], answer: str) -> bool: ...


class User(Protocol):
    def satisfied(self, task: Any, answer: str) -> bool: ...

    def reply(self, task: Any, answer: str) -> str: ...

    def interaction(self, n: int) -> User: ...  # the user as they reply in interaction n, with draws of their own


@dataclass(frozen=True)
class Plan:
    """One bench run, every choice resolved (``--quick`` and defaults applied)."""

    profile: Path | None
    seed: int
    interactions: int
    every: int
    heldout: int
    general: int
    chat: int
    arms: tuple[str, ...]
    model: str
    json_path: Path
    plot_path: Path
    config_path: Path | None = None
    config_file: dict[str, Any] | None = None  # what --config set, as read when the run began
    lora_lr: float = LORA_OVERRIDES["learning_rate"]
    keep: bool = False  # keep each arm's data directory
    idle_timeout_s: float = IDLE_TIMEOUT_S  # the longest wait for the learner at a checkpoint
    jobs: int = 1  # arms run at once, each on its own share of the CPU cores

    @classmethod
    def from_args(cls, args: argparse.Namespace, config: WhetConfig) -> Plan:
        """Flags given win, then ``--quick``'s scale, then the full-scale defaults."""
        scale = {**DEFAULTS, **(QUICK if args.quick else {})}
        scale.update({key: getattr(args, key) for key in scale if getattr(args, key) is not None})
        return cls(
            profile=args.profile, seed=args.seed, arms=tuple(args.arms), model=args.model or config.model.id,
            json_path=args.json_path, plot_path=args.plot, config_path=args.config,
            config_file=read_config_file(args.config) if args.config else None,
            lora_lr=args.lora_lr if args.lora_lr is not None else LORA_OVERRIDES["learning_rate"],
            keep=args.keep, idle_timeout_s=args.idle_timeout or IDLE_TIMEOUT_S,
            jobs=min(getattr(args, "jobs", None) or len(usable_cores()), len(args.arms), len(usable_cores())),
            **scale,
        )  # fmt: skip

    def checkpoints(self) -> list[int]:
        """Where held-out success is measured: 0, k, 2k, ... and always N."""
        return sorted({*range(0, self.interactions, self.every), self.interactions})

    def command(self) -> str:
        """The command line that reproduces this run."""
        argv = ["whet", "bench", "learn"]
        if self.config_path is not None:
            argv += ["--config", str(self.config_path)]
        if self.profile is not None:
            argv += ["--profile", str(self.profile)]
        argv += ["--seed", str(self.seed), "--interactions", str(self.interactions), "--every", str(self.every),
                 "--heldout", str(self.heldout), "--general", str(self.general), "--chat", str(self.chat),
                 "--lora-lr", f"{self.lora_lr:g}", "--model", self.model, "--arms", ",".join(self.arms),
                 "--jobs", str(self.jobs)]  # fmt: skip
        return shlex.join(argv)

    def units_per_arm(self, arm: str) -> int:
        """Progress units of one arm: each interaction and each evaluated task."""
        if not ARM_LEARNING[arm][0]:  # nothing can change it: measured at the start and the end only
            return self.heldout * 2 + 2 * (self.general + self.chat)
        return self.interactions + self.heldout * len(self.checkpoints()) + 2 * (self.general + self.chat)


@dataclass(frozen=True)
class Tasks:
    """The same tasks for every arm."""

    training: list[Any]
    heldout: list[Any]
    general: list[Any]
    chat: list[str]  # requests no tool answers (the chat probe)


@dataclass
class ArmResult:
    name: str
    curve: list[dict[str, float]] = field(default_factory=list)
    general_before: float = 0.0
    general_after: float = 0.0
    chat_before: float = 0.0  # share of the chat probe answered without a tool call
    chat_after: float = 0.0
    adapters_promoted: int = 0
    lessons: int = 0
    lessons_held: int = 0  # lessons the lesson check kept out (they broke pinned turns about as close as their own request)
    lessons_narrowed: int = 0  # lessons it added narrowed (shown only to requests closer than the turns they broke)
    lessons_misled: int = 0  # lessons narrowed later, away from a request they misled (the user corrected the copy)
    lesson_check_s: float = 0.0  # wall seconds the lesson check took (learner.gate.check_lessons)
    adapter: str | None = None  # the version serving at the end (None = base weights)
    wall_s: float = 0.0
    steps: int = 0  # training steps made (candidates, whatever the gate decided)
    deferred: int = 0  # samples untrained at the end: their lineage waits for more (learner.backoff)
    step_seconds: dict[str, float] = field(default_factory=dict)  # their time by phase, summed
    # the arm's wall time as the bench spent it: interacting (the user's requests and replies), waiting for the
    # learner at the checkpoints (judging, lessons, the steps), measuring (held-out, general, chat probe)
    seconds: dict[str, float] = field(default_factory=dict)
    # what was missed: the held-out tasks at each checkpoint; the general tasks and the chat probe
    # before and after (what learning broke is what is missed after and was not before)
    missed: list[dict[str, Any]] = field(default_factory=list)  # [{"interactions": n, "missed": [...]}]
    general_missed: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # {"before": [...], "after": [...]}
    chat_missed: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def measure(self, interactions: int, score: tuple[float, list[dict[str, Any]]]) -> None:
        """One checkpoint: its held-out success on the curve, its misses beside it."""
        self.curve.append({"interactions": interactions, "success": score[0]})
        self.missed.append({"interactions": interactions, "missed": score[1]})

    def so_far(self) -> dict[str, Any]:
        """What an arm that has not finished has measured: its curve, its general skill before, and
        the held-out tasks it missed (copies: the arm's thread may be adding to them)."""
        return {"curve": list(self.curve), "general_before": self.general_before, "chat_before": self.chat_before,
                "missed": {"heldout": list(self.missed)}}  # fmt: skip

    @property
    def final_success(self) -> float:
        return self.curve[-1]["success"]

    def to_json(self) -> dict[str, Any]:
        return {
            "curve": self.curve,
            "final_success": self.final_success,
            "interactions_to_0_9": interactions_to(self.curve, THRESHOLD),
            "general_before": self.general_before,
            "general_after": self.general_after,
            "chat_before": self.chat_before,
            "chat_after": self.chat_after,
            "adapters_promoted": self.adapters_promoted,
            "lessons": self.lessons,
            "lessons_held": self.lessons_held,
            "lessons_narrowed": self.lessons_narrowed,
            "lessons_misled": self.lessons_misled,
            "lesson_check_s": self.lesson_check_s,
            "adapter": self.adapter,
            "wall_s": round(self.wall_s, 1),
            "steps": self.steps,
            "deferred": self.deferred,
            "step_seconds": self.step_seconds,
            "seconds": {phase: round(value, 1) for phase, value in self.seconds.items()},
            "missed": {"heldout": self.missed, "general": self.general_missed, "chat": self.chat_missed},
        }


def step_time(adapters: Sequence[dict[str, Any]]) -> tuple[int, dict[str, float]]:
    """How many training steps the adapters are, and their seconds by phase, summed (where the
    learner's time went: an arm's wall time is mostly its steps on a CPU)."""
    total: dict[str, float] = {}
    for adapter in adapters:
        for phase, seconds in (adapter.get("seconds") or {}).items():
            total[phase] = total.get(phase, 0.0) + seconds
    return len(adapters), {phase: round(seconds, 1) for phase, seconds in total.items()}


def interactions_to(curve: Sequence[dict[str, float]], threshold: float) -> int | None:
    """The first measured interaction count whose success reaches ``threshold``; None if none does."""
    return next((int(p["interactions"]) for p in curve if p["success"] >= threshold), None)


# -- one arm ------------------------------------------------------------------


def run_arm(name: str, client: ArmClient, tasks: Tasks, user: User, plan: Plan, *,
            settle_s: float, advance: Callable[[int], None], stop: threading.Event | None = None,
            measured: Callable[[ArmResult], None] | None = None) -> ArmResult:  # fmt: skip
    """Drive one arm's server: measure, then interact and measure at every checkpoint.

    An arm without a learner cannot change (nothing it is told is kept), so its interactions
    are skipped and it is measured at the start and after N only: the same numbers, an arm's
    worth of time saved. ``settle_s``: how long to wait after the learner is idle, for the
    server to take in what it published (lessons into the index, adapters loaded).
    ``advance(n)``: progress. ``stop``: once set, the arm ends at its next step with :class:`ArmStopped`.
    ``measured(result)``: called after every checkpoint with the result so far.

    An arm that trains weights and keeps no lessons (``lora``) has one policy from one checkpoint to the next: its
    weights change only in the step asked for at a checkpoint, and nothing else it is told is used. So a block's
    interactions run at once (up to :data:`EVAL_CONCURRENCY`), each with the user's own draws for it
    (``user.interaction(i)``) and its own sampling seed, as one after another would give them, and the server
    decodes them together. An arm that keeps lessons serves each interaction with the lessons of the ones before
    it, so its interactions go one at a time. Run FB (stop 75) spent about 20 of its 95 minutes outside the
    learner's steps, most of it in 32 interactions decoded one at a time on one core."""

    def tick(n: int) -> None:
        advance(n)
        _go_on(stop)

    def checkpoint(interactions: int) -> None:
        with timed("measuring"):
            result.measure(interactions, success_rate(client, tasks.heldout, tick))
        if measured is not None:
            measured(result)

    def one(i: int, task: Task) -> None:
        interact(client, task, user.interaction(i), seed=plan.seed * 1_000_000 + i)
        tick(1)

    started = time.perf_counter()
    result = ArmResult(name)
    timed = PhaseClock()
    result.seconds = timed.seconds
    learns, trains, keeps = ARM_LEARNING[name]
    at_once = EVAL_CONCURRENCY if trains and not keeps else 1
    with timed("learner"):
        wait_idle(client, settle_s, plan.idle_timeout_s, stop)
    with timed("measuring"):
        result.general_before, result.general_missed["before"] = success_rate(client, tasks.general, tick)
        result.chat_before, result.chat_missed["before"] = chat_rate(client, tasks.chat, tick)
    checkpoint(0)
    done = 0
    for end in plan.checkpoints()[1:] if learns else []:
        block = list(enumerate(tasks.training[done:end], start=done + 1))
        with timed("interacting"):
            if at_once > 1:
                with ThreadPoolExecutor(at_once, thread_name_prefix=f"whet-bench-{name}") as pool:
                    list(pool.map(lambda item: one(*item), block))
            else:
                for i, task in block:
                    one(i, task)
        done = end
        with timed("learner"):
            if trains:
                client.train()
            wait_idle(client, settle_s, plan.idle_timeout_s, stop)
        checkpoint(end)
    if not learns:
        checkpoint(plan.interactions)
    with timed("measuring"):
        result.general_after, result.general_missed["after"] = success_rate(client, tasks.general, tick)
        result.chat_after, result.chat_missed["after"] = chat_rate(client, tasks.chat, tick)
    health = client.health()
    learner = health.get("learner") or {}
    result.adapters_promoted = learner.get("promoted", 0)
    result.lessons = learner.get("lessons", 0)
    result.lessons_held = learner.get("lessons_held", 0)
    result.lessons_narrowed = learner.get("lessons_narrowed", 0)
    result.lessons_misled = learner.get("lessons_misled", 0)
    result.lesson_check_s = learner.get("lesson_check_s", 0.0)
    result.deferred = learner.get("deferred", 0)
    result.adapter = health.get("adapter")
    if learner:
        result.steps, result.step_seconds = step_time(client.learning().get("adapters") or [])
    result.wall_s = time.perf_counter() - started
    return result


def interact(client: ArmClient, task: Task, user: User, *, seed: int) -> None:
    """One interaction: the task, the answer, the user's reply (which closes the answer's turn).

    A user who had to correct the assistant reads its second try too, and replies to that
    (thanks, or another correction): up to :data:`REPLIES` replies, as a person would."""
    session = f"train-{uuid.uuid4().hex[:12]}"
    messages = [{"role": "user", "content": task.text}]
    answer = client.chat(session, messages, seed=seed)
    for _ in range(REPLIES):
        satisfied = user.satisfied(task, answer)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": user.reply(task, answer)}]
        answer = client.chat(session, messages, seed=seed)
        if satisfied:
            return


def success_rate(client: ArmClient, tasks: Sequence[Task], advance: Callable[[int], None]) -> tuple[float, list[dict[str, Any]]]:
    """Share of ``tasks`` done right, and what was done instead for each one missed (the request, the
    tool calls, the answer): each in a fresh session, greedy, sent with ``store: false`` so the server
    never learns from it (a failed tool call would otherwise be judged at once, and its verdict
    trained and kept as a lesson: evaluation leaking into learning)."""

    def done(task: Task) -> dict[str, Any] | None:
        session = f"eval-{uuid.uuid4().hex[:12]}"
        answer = client.chat(session, [{"role": "user", "content": task.text}], temperature=0, store=False)
        calls = client.tool_calls(session)
        return None if task.check(calls, answer) else _missed(task.text, calls, answer)

    return _count(tasks, done, advance)


def chat_rate(client: ArmClient, requests: Sequence[str], advance: Callable[[int], None]) -> tuple[float, list[dict[str, Any]]]:
    """Share of ``requests`` (none needs a tool) answered in words without calling a tool, and the misses."""

    def done(request: str) -> dict[str, Any] | None:
        session = f"eval-{uuid.uuid4().hex[:12]}"
        answer = client.chat(session, [{"role": "user", "content": request}], temperature=0, store=False)
        calls = client.tool_calls(session)
        return None if answer.strip() and not calls else _missed(request, calls, answer)

    return _count(requests, done, advance)


def _missed(request: str, calls: Sequence[Any], answer: str, width: int = 240) -> dict[str, Any]:
    """One missed evaluation as the report keeps it: what was asked, what the agent called, what it said."""
    shown = [{"name": c.name, "arguments": dict(c.arguments)} for c in calls]
    return {"request": request, "calls": shown, "answer": answer[:width]}


def _count(items: Sequence[Any], done: Callable[[Any], dict[str, Any] | None],
           advance: Callable[[int], None]) -> tuple[float, list[dict[str, Any]]]:  # fmt: skip
    """The share of ``items`` that ``done`` passes (it returns None, or what was missed; none: all), with up to
    :data:`EVAL_CONCURRENCY` evaluations in flight: they are independent sessions at temperature 0,
    and the server decodes concurrent requests together, so an evaluation costs a fraction of its
    sequential time."""

    def one(item: Any) -> dict[str, Any] | None:
        missed = done(item)
        advance(1)
        return missed

    if not items:
        return 1.0, []
    with ThreadPoolExecutor(EVAL_CONCURRENCY) as pool:
        misses = [m for m in pool.map(one, items) if m is not None]
    return (len(items) - len(misses)) / len(items), misses


def wait_idle(client: ArmClient, settle_s: float, timeout_s: float = IDLE_TIMEOUT_S,
              stop: threading.Event | None = None) -> None:  # fmt: skip
    """Return once the learner has judged and trained everything sent so far (at once without one).

    ``timeout_s`` bounds the wait *without progress*: a slow machine's learner that still judges,
    writes lessons and finishes steps is waited for, however long its queue; one whose counters
    stand still that long while busy has stalled, and the bench stops with what it saw."""
    seen: dict[str, Any] | None = None
    deadline = time.monotonic() + timeout_s
    while (learner := client.health().get("learner")) and learner["busy"]:
        counters = {k: v for k, v in learner.items() if k != "busy"}
        if counters != seen:
            seen, deadline = counters, time.monotonic() + timeout_s
        elif time.monotonic() > deadline:
            shown = ", ".join(f"{k}={v}" for k, v in counters.items())
            raise BenchError(f"the learner was busy with no progress for {timeout_s:.0f}s ({shown}); on a slow "
                             "machine one training step can take longer: give it more with --idle-timeout SECONDS")
        _go_on(stop)
        time.sleep(POLL_S)  # another process: there is no event to wait on
    if learner is not None:
        time.sleep(settle_s)


# -- one arm's server ---------------------------------------------------------


class HttpArmClient:
    """An arm's server over its OpenAI-compatible API, as ``user``."""

    def __init__(self, http: httpx.Client, user: str) -> None:
        self.http = http
        self.user = user
        self.model = _body(http.get("/v1/models"))["data"][0]["id"]

    def chat(self, session: str, messages: list[dict[str, str]], **params: Any) -> str:
        body = {"model": self.model, "messages": messages, "user": self.user, **params}
        response = self.http.post("/v1/chat/completions", json=body, headers={"X-Whet-Session": session})
        return _body(response)["choices"][0]["message"]["content"] or ""

    def tool_calls(self, session: str) -> list[Any]:
        from whet.world.tasks import ToolUse

        turns = _body(self.http.get("/v1/turns", params={"session": session, "limit": 500}))
        calls = [call["function"] for turn in reversed(turns) for call in turn["tool_calls"]]
        return [ToolUse(name=f["name"], arguments=_arguments(f.get("arguments"))) for f in calls]

    def health(self) -> dict[str, Any]:
        return _body(self.http.get("/health"))

    def learning(self) -> dict[str, Any]:
        return _body(self.http.get("/v1/learning", params={"user": self.user}))

    def train(self) -> None:
        _body(self.http.post("/v1/learning/train", params={"user": self.user}))


def _body(response: httpx.Response) -> Any:
    if response.is_success:
        return response.json()
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:300]
    raise BenchError(f"{response.request.method} {response.request.url.path} failed ({response.status_code}): {message}")


def _arguments(raw: Any) -> dict[str, Any]:
    """A tool call's arguments as a dict; what a weak model wrote that is not a JSON object counts as none."""
    parsed = parse_arguments(raw)
    return parsed if isinstance(parsed, dict) else {}


def arm_config(base: WhetConfig, arm: str, data_dir: Path, model: str, port: int,
               lora_lr: float = LORA_OVERRIDES["learning_rate"]) -> dict[str, Any]:  # fmt: skip
    """The config one arm's server runs with: the base config, a private SQLite store and
    in-process bus in ``data_dir``, auth off (the bench names its user), and the arm's learner."""
    enabled, train, lessons = ARM_LEARNING[arm]
    data = base.model_dump(mode="json")
    data["data_dir"] = str(data_dir)
    data["server"].update(host="127.0.0.1", port=port, api_keys={})
    data["model"]["id"] = model
    data["store"]["url"] = None
    data["bus"]["url"] = None
    data["learner"].update(enabled=enabled, train=train, lessons=lessons, **LEARNER_OVERRIDES)
    data["learner"]["lora"].update(LORA_OVERRIDES, learning_rate=lora_lr)
    return data


@contextlib.contextmanager
def served(config: dict[str, Any], arm_dir: Path, whet: Sequence[str], cores: list[int] | None = None) -> Iterator[str]:
    """``whet serve`` with ``config`` as a child process; yields its base URL once healthy.

    ``whet``: the command line that runs the ``whet`` CLI (the CLI passes its own). ``cores``: the
    CPU cores the server (and the tool servers it starts) may use, and as many torch threads.

    Stopped (SIGINT, then kill) however the block ends; a failure inside the block, or the
    server's own, ends as a BenchError carrying the tail of the server's log."""
    port = config["server"]["port"]
    config_path, log_path = arm_dir / "whet.yaml", arm_dir / "serve.log"
    config_path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHET_")}  # the base config already has them
    pin = None
    if cores is not None:
        env["OMP_NUM_THREADS"] = str(len(cores))

        def pin() -> None:  # in the child, before it runs whet
            os.sched_setaffinity(0, cores)

    command = [*whet, "serve", "--config", str(config_path)]
    base = f"http://127.0.0.1:{port}"
    with log_path.open("w") as server_log:
        process = subprocess.Popen(command, stdout=server_log, stderr=subprocess.STDOUT, env=env, preexec_fn=pin)
        try:
            _wait_healthy(base, process)
            yield base
        except (BenchError, httpx.HTTPError) as exc:
            raise BenchError(_server_failure(str(exc) or type(exc).__name__, port, log_path)) from None
        finally:
            _stop(process)


def usable_cores() -> list[int]:
    """The CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def core_shares(jobs: int) -> list[list[int]]:
    """The usable cores dealt into ``jobs`` disjoint shares of (nearly) equal size."""
    cores = usable_cores()
    return [cores[i::jobs] for i in range(jobs)] if jobs > 1 else [cores]


def _wait_healthy(base: str, process: subprocess.Popen[bytes], timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BenchError(f"whet serve exited with code {process.returncode} before it was ready")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        time.sleep(POLL_S)  # a starting process: there is no event to wait on
    raise BenchError(f"whet serve was not ready after {timeout_s:.0f}s")


def _server_failure(what: str, port: int, log_path: Path, lines: int = 12, width: int = 300) -> str:
    text = ANSI.sub("", log_path.read_text(errors="replace"))  # the console log renderer colours even a file
    tail = [line if len(line) <= width else line[:width] + " ..." for line in text.splitlines()[-lines:]]
    if any("address already in use" in line.lower() for line in tail):
        what = f"port {port} is busy (another process took it after the bench chose it; run again)"
    return f"{what}; last lines of {log_path}:\n" + "\n".join(f"  {line}" for line in tail)


def _stop(process: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown: the learner and MCP servers close
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the whole run ------------------------------------------------------------


def longest_first(arms: Sequence[str]) -> list[str]:
    """``arms`` in the order the bench starts them: the arms that train (a step costs minutes), then
    those that only learn lessons, then ``static`` (measured twice, nothing learned). Run AA (alex, 2 cores):
    memory_lora 47 min, lora 57, memory 13, static 3; with static before memory the run took 64 minutes,
    where longest first would end at about 61."""
    return sorted(arms, key=lambda arm: (not ARM_LEARNING[arm][1], not ARM_LEARNING[arm][0]))


def run_bench(config: WhetConfig, plan: Plan, *, prepare_model: Callable[[Path], Path], whet: Sequence[str]) -> int:
    """Run every arm of ``plan``, write the JSON and the plot, print the table. Raises BenchError.

    ``prepare_model(folder)`` builds the default model there if it is not built yet (see
    :func:`base_model`); ``whet`` is the command line that runs the ``whet`` CLI (see :func:`served`).
    The CLI passes both, so that this package never imports the runtime.
    """
    from whet.world.tasks import CHAT_PROBE, World, load_profile
    from whet.world.user import SimulatedUser

    try:
        profile = load_profile(plan.profile)
    except (ValueError, OSError) as exc:
        raise ConfigError("--profile", str(exc), "pass a valid profile file, or leave --profile out for the default") from None
    world = World(profile, plan.seed)
    tasks = Tasks(world.training_tasks(plan.interactions), world.heldout_tasks(plan.heldout),
                  world.general_tasks(plan.general), list(CHAT_PROBE[: plan.chat]))  # fmt: skip
    console = Console(stderr=True)
    with console.status(f"preparing the base model {plan.model}"):
        model = base_model(plan.model, config, prepare_model)
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="whet-bench-learn-"))  # kept with --keep or when an arm fails (_scratch_folder)
    # arms at once, each server on its own cores: one sequence's decoding hardly gains from a second
    # core, a second arm does. Longest first, so that the short ones fill the cores the long ones free.
    shares = core_shares(plan.jobs)
    free: queue.Queue[list[int]] = queue.Queue()
    for share in shares:
        free.put(share)
    order = longest_first(plan.arms)
    stop = threading.Event()  # set when an arm fails: the others end at their next step, none starts
    done: dict[str, Future[ArmResult]] = {}
    so_far: dict[str, ArmResult] = {}  # each arm's result as of its last checkpoint
    writing = threading.Lock()

    def write() -> dict[str, Any] | None:
        with writing:
            return _write_report(plan, profile.name, tasks, config, started, _ended(done, plan.arms), so_far)
    with _sigterm_as_interrupt(), _scratch_folder(scratch, plan.keep, console) as folder, _progress(console) as progress:
        bars = {arm: progress.add_task(arm, total=plan.units_per_arm(arm)) for arm in plan.arms}

        def measured(arm: str, result: ArmResult) -> None:
            with writing:  # another arm's thread may be writing the report, reading so_far
                so_far[arm] = result
            write()

        def one(arm: str) -> ArmResult:
            cores = free.get()
            try:
                _go_on(stop)
                arm_dir = scratch / arm
                arm_dir.mkdir()
                settings = arm_config(config, arm, arm_dir / "data", model, free_port(), plan.lora_lr)
                with served(settings, arm_dir, whet, cores if plan.jobs > 1 else None) as base, \
                        httpx.Client(base_url=base, timeout=REQUEST_TIMEOUT_S) as http:  # fmt: skip
                    client = HttpArmClient(http, profile.user)
                    return run_arm(arm, client, tasks, SimulatedUser(profile, plan.seed), plan,
                                   settle_s=2 * LEARNER_OVERRIDES["poll_s"],
                                   advance=lambda n: progress.advance(bars[arm], n), stop=stop,
                                   measured=lambda result: measured(arm, result))  # fmt: skip
            except BaseException as exc:
                if not isinstance(exc, ArmStopped):
                    stop.set()  # before its cores are free: the next arm must not start on them
                raise
            finally:
                free.put(cores)

        with ThreadPoolExecutor(max_workers=plan.jobs, thread_name_prefix="whet-bench-arm") as pool:
            for arm in order:
                done[arm] = pool.submit(one, arm)
            try:
                pending = set(done.values())
                while pending:  # each arm that ends is in the JSON at once, as is each checkpoint measured
                    _, pending = wait(pending, return_when=FIRST_COMPLETED)
                    write()
            finally:  # all ended, an arm failed, or Ctrl-C: arms not started never start, running ones stop at their next step
                stop.set()
                for future in done.values():
                    future.cancel()
        ended = _ended(done, plan.arms)  # every arm has ended by now
        failed = _failures(ended)
        folder.failed = sorted(failed)  # a failed arm's serve.log, store and adapters are what tells why
    results = [outcome for outcome in ended.values() if isinstance(outcome, ArmResult)]
    if failed and not results:
        raise next(iter(failed.values()))
    report = write()
    assert report is not None  # an arm finished
    _print_table(report, plan)
    if failed:
        arm, exc = next(iter(failed.items()))
        finished = ", ".join(r.name for r in results)
        if isinstance(exc, BenchError):
            raise BenchError(f"arm {arm} failed: {exc}\n(the arms that finished, {finished}, are in {plan.json_path})")
        raise exc
    return 0


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """While the arms run, a SIGTERM (``kill``, a CI timeout, a service manager) stops the run as
    Ctrl-C does: running arms stop at their next step and their servers, with the tool servers those
    started, are stopped. Python's default for SIGTERM ends the process at once and leaves every arm's
    ``whet serve`` running. Only the main thread can set a handler; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class _Scratch:
    """What :func:`_scratch_folder` decides by: the arms that failed, set once every arm has ended."""

    failed: list[str] = field(default_factory=list)


@contextlib.contextmanager
def _scratch_folder(scratch: Path, keep: bool, console: Console) -> Iterator[_Scratch]:
    """The arms' data directories once the block ends (every arm ended, its server stopped): kept with
    ``--keep``, and said where, else removed. A run in which an arm failed keeps them too, and says
    where: the error names that arm's ``serve.log`` in it, and its store and adapters show what it had
    done. An interrupted run (Ctrl-C, SIGTERM) leaves none behind unless ``--keep``."""
    state = _Scratch()
    try:
        yield state
    except KeyboardInterrupt:
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    kept = f"each arm's data directory (store, adapters, serve.log) is kept in {scratch}"
    if keep:
        console.print(kept)
    elif state.failed:
        arms = f"arm {state.failed[0]}" if len(state.failed) == 1 else f"arms {', '.join(state.failed)}"
        console.print(f"{arms} failed: {kept}; remove it when done")
    else:
        shutil.rmtree(scratch, ignore_errors=True)


_RUNNING = object()  # an arm still running (or waiting for cores) in :func:`_ended`


def _ended(done: dict[str, Future[ArmResult]], arms: Sequence[str]) -> dict[str, Any]:
    """Each arm's outcome: its result, its error, None (cancelled before it started), or _RUNNING
    (also an arm not submitted yet)."""

    def outcome(future: Future[ArmResult] | None) -> Any:
        if future is None:
            return _RUNNING
        if future.cancelled():
            return None
        return (future.exception() or future.result()) if future.done() else _RUNNING

    return {arm: outcome(done.get(arm)) for arm in arms}


def _failures(ended: dict[str, Any]) -> dict[str, BaseException]:
    """The arms that failed (not those stopped because another did), with their errors."""
    return {arm: outcome for arm, outcome in ended.items()
            if isinstance(outcome, BaseException) and not isinstance(outcome, ArmStopped)}  # fmt: skip


def _write_report(plan: Plan, profile: str, tasks: Tasks, config: WhetConfig, started: float,
                  ended: dict[str, Any], so_far: dict[str, ArmResult]) -> dict[str, Any] | None:  # fmt: skip
    """Write the JSON and the plot of the arms that finished so far, and the curves measured so far of
    those that did not (``partial``: still running, or stopped); nothing before the first checkpoint.
    ``failed`` names the arms that failed (arm -> first line of its error), ``not_finished`` those that
    did not end with a result: stopped, never started, or (while the run goes on) still running."""
    results = [outcome for outcome in ended.values() if isinstance(outcome, ArmResult)]
    partial = {arm: result.so_far() for arm, result in so_far.items() if not isinstance(ended.get(arm), ArmResult)}
    if not results and not partial:
        return None
    report = build_report(plan, profile, results, time.perf_counter() - started,
                          heldout_distinct=len({task.text for task in tasks.heldout}),
                          precision=config.learner.lora.precision)  # fmt: skip
    if partial:
        report["partial"] = partial
    failed = _failures(ended)
    if failed:
        report["failed"] = {arm: str(exc).splitlines()[0] for arm, exc in failed.items()}
    not_finished = [arm for arm, outcome in ended.items() if not isinstance(outcome, ArmResult) and arm not in failed]
    if not_finished:
        report["not_finished"] = not_finished
    # whole files only: someone (a test, a person) may read them while the run goes on
    _replace(plan.json_path, lambda tmp: tmp.write_text(json.dumps(report, indent=2) + "\n"))
    _replace(plan.plot_path, lambda tmp: plot(report, tmp))
    return report


def _replace(path: Path, write: Callable[[Path], None]) -> None:
    """Write ``path`` through a temporary file beside it, then rename it into place (atomic)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def base_model(model_id: str, config: WhetConfig, prepare: Callable[[Path], Path]) -> str:
    """The model every arm serves, resolved once, as an absolute folder when it is local so no
    arm builds or guesses. The default model (``smollm2``) is built first with ``prepare(folder)``
    into the base config's data dir, here with its progress bars rather than behind the first
    arm's start; ``tiny`` is built by resolving it."""
    from whet.learner.model import DEFAULT_MODEL, ModelLoadError, model_dir, resolve_source

    try:
        if model_id == DEFAULT_MODEL:
            prepare(model_dir(config.data_path, DEFAULT_MODEL))
        source = resolve_source(model_id, config.data_path)
    except ModelLoadError as exc:  # a folder in the way
        raise BenchError(f"cannot prepare the model {model_id}: {exc}") from None
    path = Path(source).expanduser()
    return str(path.resolve()) if path.exists() else source


def build_report(plan: Plan, profile: str, results: Sequence[ArmResult], wall_s: float, *,
                 heldout_distinct: int | None = None, precision: str = "auto") -> dict[str, Any]:  # fmt: skip
    """The JSON the bench writes. Top-level general skill is the arm that changes most
    (``memory_lora`` when it ran); ``base_success`` is the shared start, averaged over arms.
    ``heldout_distinct``: how many different requests the held-out tasks are (a request drawn
    twice is answered the same way twice at temperature 0, so it weighs twice). ``precision``: the
    arms' ``learner.lora.precision``, for what the machine trains in."""
    arms = {r.name: r.to_json() for r in results}
    headline = next((r for r in results if r.name == "memory_lora"), results[-1] if results else None)
    return {
        "profile": profile,
        "seed": plan.seed,
        "interactions": plan.interactions,
        "every": plan.every,
        "heldout": plan.heldout,
        "heldout_distinct": heldout_distinct,
        "general": plan.general,
        "model": plan.model,
        "base_success": fmean(r.curve[0]["success"] for r in results) if results else None,
        "general_before": headline.general_before if headline else None,
        "general_after": headline.general_after if headline else None,
        "chat_before": headline.chat_before if headline else None,
        "chat_after": headline.chat_after if headline else None,
        "command": plan.command(),
        "config_file": plan.config_file,  # the settings --config overrode (the command names only the file)
        "machine": _machine(precision),
        "wall_s": round(wall_s, 1),
        "learner": {**LEARNER_OVERRIDES, "lora": {**LORA_OVERRIDES, "learning_rate": plan.lora_lr}},
        "arms": arms,
    }


@functools.cache  # the same all run long; the report is written at every checkpoint
def _machine(precision: str) -> dict[str, Any]:
    import torch

    from whet.learner.trainer import cpu_name, use_bfloat16

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        # what the arms' learners train in on this CPU (learner.lora.precision; auto: bfloat16 where the
        # CPU has native bfloat16 matmuls, AVX512-BF16 or AMX, about twice as fast): arm times turn on it
        "cpu_trains_bfloat16": use_bfloat16(precision, torch.device("cpu")),
        "python": platform.python_version(),
        "torch": metadata.version("torch"),
    }


def plot(report: dict[str, Any], path: Path) -> None:
    """Left: held-out success against interactions, one line per arm, the 0.9 bar dashed. Right: what
    learning must keep, each finished arm's general tasks and chat probe before (pale) and after."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(figure)  # Agg, without pyplot's global state
    axes, kept = figure.subplots(1, 2, width_ratios=(3, 2))
    # arms not finished: dotted, as far as they got
    for key, style, suffix in (("arms", "-", ""), ("partial", ":", " (not finished)")):
        for arm, result in report.get(key, {}).items():
            xs = [p["interactions"] for p in result["curve"]]
            axes.plot(xs, [p["success"] for p in result["curve"]], marker="o", linestyle=style, label=arm + suffix)
    axes.axhline(THRESHOLD, linestyle="--", color="grey", linewidth=1, label=f"{THRESHOLD:.0%}")
    axes.set(xlabel="interactions", ylabel="held-out success", ylim=(-0.02, 1.02),
             title=f"whet bench learn: profile {report['profile']}, seed {report['seed']}")  # fmt: skip
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.legend(loc="best")
    axes.grid(alpha=0.3)
    _plot_kept(kept, report.get("arms", {}))
    figure.savefig(path, dpi=120)


def _plot_kept(axes: Any, arms: dict[str, dict[str, Any]]) -> None:
    """Grouped bars, one group per finished arm: general tasks and the chat probe, before and after."""
    axes.set(ylabel="share right", ylim=(0, 1.3), title="kept: general tasks and chat (before → after)")
    axes.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    if not arms:
        axes.text(0.5, 0.5, "no arm has finished yet", ha="center", va="center", transform=axes.transAxes)
        axes.set_xticks([])
        return
    width = 0.2
    for i, (measure, colour) in enumerate((("general", "tab:blue"), ("chat", "tab:orange"))):
        for j, (when, alpha) in enumerate((("before", 0.35), ("after", 1.0))):
            values = [result[f"{measure}_{when}"] for result in arms.values()]
            xs = [k + (2 * i + j - 1.5) * width for k in range(len(arms))]
            bars = axes.bar(xs, values, width, color=colour, alpha=alpha, label=f"{measure} {when}")
            axes.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    axes.set_xticks(range(len(arms)), list(arms))
    axes.legend(loc="upper center", fontsize=8, ncols=2)
    axes.grid(alpha=0.3, axis="y")


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description:>12}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console)  # fmt: skip


def _print_table(report: dict[str, Any], plan: Plan) -> None:
    distinct = report.get("heldout_distinct")
    tasks = f"{report['heldout']} tasks" + (f", {distinct} distinct requests" if distinct is not None else "")
    table = Table(title=f"held-out success ({tasks}), profile {report['profile']}, seed {report['seed']}")
    for column in ("arm", "base", "final", "interactions\nto 0.9", "general", "chat\n(no tool)", "adapters\npromoted",
                   "lessons"):
        table.add_column(column, no_wrap=True)
    for arm, r in report["arms"].items():
        reached = r["interactions_to_0_9"]
        table.add_row(arm, f"{r['curve'][0]['success']:.2f}", f"{r['final_success']:.2f}",
                      "-" if reached is None else str(reached),
                      f"{r['general_before']:.2f}→{r['general_after']:.2f}",
                      f"{r['chat_before']:.2f}→{r['chat_after']:.2f}",
                      str(r["adapters_promoted"]), str(r["lessons"]))  # fmt: skip
    console = Console(width=None if sys.stdout.isatty() else 120)  # a log or a pipe gets every column
    console.print(table)
    console.print(f"wrote {plan.json_path} and {plan.plot_path} ({report['wall_s']:.0f}s)")
