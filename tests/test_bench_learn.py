"""`whet bench learn`: the runner's bookkeeping on a fake server, the learner's idle signal on
/health, and one quick end-to-end run against real `whet serve` processes."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from whet.config.settings import load_config
from whet.learner.judge import RulesJudge
from whet.learner.learner import Learner
from whet.learner.registry import AdapterRegistry
from whet.memory.bus import MemoryBus
from whet.memory.store import open_store
from whet.memory.tables import Adapter, Judgment, TurnCreate
from whet.world.bench import (
    ARMS,
    ArmResult,
    BenchError,
    Plan,
    Tasks,
    arm_config,
    build_report,
    free_port,
    interactions_to,
    plot,
    run_arm,
    served,
)
from whet.world.tasks import ToolUse


def make_plan(tmp_path: Path, **overrides: Any) -> Plan:
    fields = {"profile": None, "seed": 3, "interactions": 6, "every": 4, "heldout": 2, "general": 2, "chat": 2, "arms": ARMS,
              "model": "smollm2", "json_path": tmp_path / "b.json", "plot_path": tmp_path / "b.png"}  # fmt: skip
    return Plan(**{**fields, **overrides})


# ----------------------------------------------------------------------------- bookkeeping


def test_interactions_to_0_9_is_the_first_checkpoint_reaching_it_or_none():
    curve = [{"interactions": 0, "success": 0.2}, {"interactions": 4, "success": 0.9}, {"interactions": 8, "success": 1.0}]
    assert interactions_to(curve, 0.9) == 4
    assert interactions_to(curve[:1], 0.9) is None


def test_checkpoints_fall_every_k_interactions_and_always_at_the_end(tmp_path):
    assert make_plan(tmp_path, interactions=10, every=4).checkpoints() == [0, 4, 8, 10]
    assert make_plan(tmp_path, interactions=8, every=4).checkpoints() == [0, 4, 8]


class FakeTask:
    def __init__(self, text: str) -> None:
        self.text = text

    def check(self, calls: list[Any], answer: str) -> bool:
        return answer == "right"


class FakeUser:
    def __init__(self, n: int | None = None) -> None:
        self.n = n  # the interaction it replies in

    def satisfied(self, task: Any, answer: str) -> bool:
        return answer == "right"

    def reply(self, task: Any, answer: str) -> str:
        return "Thanks!" if answer == "right" else "No, I meant Lisbon time."

    def interaction(self, n: int) -> FakeUser:
        return FakeUser(n)


class FakeServer:
    """An arm's server as the bench sees it: right once it has heard ``needed`` replies, and its
    learner busy after each reply until /health has been asked once."""

    def __init__(self, needed: int) -> None:
        self.needed, self.replies, self.busy = needed, 0, False
        self.sessions: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        self.asked: list[int] = []  # the interactions served when a step was asked for (POST /v1/learning/train)

    def chat(self, session: str, messages: list[dict[str, str]], **params: Any) -> str:
        evaluating = params.get("temperature") == 0
        assert not (evaluating and self.busy), "evaluated while the learner still had work"
        self.sessions.setdefault(session, []).append((len(messages), params))
        if len(messages) > 1:  # a reply closes the previous answer's turn
            self.replies += 1
            self.busy = True
        return "right" if self.replies >= self.needed else "wrong"

    def tool_calls(self, session: str) -> list[Any]:
        return [ToolUse("now", {"timezone": "Lisbon"})] if self.sessions[session][0][1].get("chat") == "tool" else []

    def health(self) -> dict[str, Any]:
        busy, self.busy = self.busy, False
        learner = {"judged": self.replies, "lessons": self.replies, "lessons_held": 0, "lessons_narrowed": 0, "lessons_misled": 0, "steps": 1, "promoted": 1, "rejected": 0,
                   "rolled_back": 0, "busy": busy}  # fmt: skip
        return {"status": "ok", "adapter": "global-0001", "learner": learner}

    def learning(self) -> dict[str, Any]:
        return {"adapters": [{"id": "global-0001", "seconds": {"train": 1.5, "pinned_after": 0.5}},
                             {"id": "global-0002", "seconds": {"train": 2.0}}]}  # fmt: skip

    def train(self) -> None:
        self.asked.append(sum(len(s) >= 2 for s in self.sessions.values()))
        self.busy = True  # the step it asked for: evaluating now would fail


def test_an_arm_measures_at_every_checkpoint_after_the_learner_is_idle_and_never_learns_from_evaluations(tmp_path):
    plan = make_plan(tmp_path)
    tasks = Tasks([FakeTask(f"t{i}") for i in range(6)], [FakeTask("h0"), FakeTask("h1")], [FakeTask("g0"), FakeTask("g1")],
                  ["Hi!", "Tell me a joke."])  # fmt: skip
    server, steps = FakeServer(needed=3), []
    result = run_arm("memory", server, tasks, FakeUser(), plan, settle_s=0, advance=steps.append)
    assert result.curve == [{"interactions": 0, "success": 0.0}, {"interactions": 4, "success": 1.0},
                            {"interactions": 6, "success": 1.0}]  # fmt: skip
    assert (result.general_before, result.general_after) == (0.0, 1.0)
    assert (result.chat_before, result.chat_after) == (1.0, 1.0)  # answered in words, no tool call
    # each checkpoint says what was done instead, for every task it missed
    assert result.missed[0] == {"interactions": 0, "missed": [{"request": "h0", "calls": [], "answer": "wrong"},
                                                              {"request": "h1", "calls": [], "answer": "wrong"}]}
    assert [m["missed"] for m in result.missed[1:]] == [[], []]
    assert result.general_missed == {"before": [{"request": "g0", "calls": [], "answer": "wrong"},
                                                {"request": "g1", "calls": [], "answer": "wrong"}], "after": []}
    assert result.chat_missed == {"before": [], "after": []}
    assert (result.adapters_promoted, result.lessons, result.adapter) == (1, 8, "global-0001")
    # the learner's steps, and their time by phase summed over them
    assert (result.steps, result.step_seconds) == (2, {"train": 3.5, "pinned_after": 0.5})
    # and where the arm's own wall time went, as the bench spent it
    assert set(result.seconds) == {"interacting", "learner", "measuring"}
    assert sum(result.seconds.values()) <= result.wall_s + 0.01
    assert sum(steps) == plan.units_per_arm("memory") == 6 + 2 * 3 + 2 * 2 + 2 * 2
    trained = [s for s in server.sessions.values() if len(s) >= 2]
    evaluated = [s for s in server.sessions.values() if len(s) == 1]
    # corrected, the user reads the retry and replies again (two replies at most); served right, one
    assert [[n for n, _ in s] for s in trained] == [[1, 3, 5]] * 2 + [[1, 3]] * 4
    assert len(evaluated) == 2 * 3 + 2 * 2 + 2 * 2
    assert all(n == 1 and params == {"temperature": 0, "store": False} for (n, params), in evaluated)


def test_a_weights_arm_asks_for_a_step_at_each_checkpoint_and_waits_for_it_before_measuring(tmp_path):
    plan = make_plan(tmp_path)
    tasks = Tasks([FakeTask(f"t{i}") for i in range(6)], [FakeTask("h0")], [FakeTask("g0")], [])
    lora, memory = FakeServer(needed=3), FakeServer(needed=3)
    result = run_arm("lora", lora, tasks, FakeUser(), plan, settle_s=0, advance=lambda n: None)
    assert lora.asked == [4, 6]  # after the interactions of each block, not before the first measure
    assert [p["interactions"] for p in result.curve] == [0, 4, 6]
    run_arm("memory", memory, tasks, FakeUser(), plan, settle_s=0, advance=lambda n: None)
    assert memory.asked == []  # lessons only: no weights to train


@pytest.mark.parametrize("arm", ["lora", "memory_lora"])
def test_an_arm_without_lessons_runs_a_blocks_interactions_at_once_and_one_with_lessons_one_at_a_time(tmp_path, arm):
    """``lora``'s policy changes only in the step asked for at a checkpoint, so a block's interactions run together
    (the server decodes them in one batch), each with the user of its own index and its own seed; an arm that keeps
    lessons serves each with the lessons of the ones before it, one at a time. Either way the step is asked for
    after the block's last reply, and the block's interactions are the same ones."""

    class Overlapping(FakeServer):
        def __init__(self) -> None:
            super().__init__(needed=100)
            self.lock, self.open, self.most, self.seeds = threading.Lock(), 0, 0, []

        def chat(self, session: str, messages: list[dict[str, str]], **params: Any) -> str:
            with self.lock:
                self.open += 1
                self.most = max(self.most, self.open)
                if len(messages) == 1 and params.get("temperature") != 0:
                    self.seeds.append(params["seed"])
            time.sleep(0.05)  # long enough for the others of a block to arrive
            with self.lock:
                self.open -= 1
                return super().chat(session, messages, **params)

    plan = make_plan(tmp_path, interactions=8, every=4)
    tasks = Tasks([FakeTask(f"t{i}") for i in range(8)], [FakeTask("h0")], [FakeTask("g0")], [])
    users: list[int | None] = []

    class Counted(FakeUser):
        def interaction(self, n: int) -> FakeUser:
            users.append(n)
            return super().interaction(n)

    server = Overlapping()
    run_arm(arm, server, tasks, Counted(), plan, settle_s=0, advance=lambda n: None)
    assert server.asked == [4, 8]  # every interaction of the block had its replies before the step
    assert sorted(users) == list(range(1, 9))
    assert sorted(server.seeds) == [3_000_000 + i for i in range(1, 9)]
    assert (server.most > 1) == (arm == "lora")


def test_a_busy_learner_without_progress_past_the_plans_idle_timeout_stops_the_bench_with_the_flag_to_raise_it(tmp_path):
    class NeverIdle(FakeServer):
        def health(self) -> dict[str, Any]:
            return {**super().health(), "learner": {"judged": 9, "busy": True}}

    plan = make_plan(tmp_path, idle_timeout_s=0.3)
    tasks = Tasks([FakeTask("t0")], [FakeTask("h0")], [FakeTask("g0")], [])
    started = time.monotonic()
    with pytest.raises(BenchError, match=r"busy with no progress for 0s \(judged=9\).*--idle-timeout"):
        run_arm("memory", NeverIdle(needed=1), tasks, FakeUser(), plan, settle_s=0, advance=lambda n: None)
    assert time.monotonic() - started < 5


def test_a_slow_learner_that_keeps_making_progress_is_waited_for_past_the_idle_timeout(tmp_path):
    from whet.world.bench import wait_idle

    class Slow(FakeServer):
        """Busy for 1.2 s, finishing a step every 0.2 s: six times the 0.2 s timeout in all."""

        def __init__(self) -> None:
            super().__init__(needed=0)
            self.started = time.monotonic()

        def health(self) -> dict[str, Any]:
            elapsed = time.monotonic() - self.started
            return {"status": "ok", "learner": {"steps": int(elapsed / 0.2), "busy": elapsed < 1.2}}

    server = Slow()
    wait_idle(server, settle_s=0, timeout_s=0.3)
    assert time.monotonic() - server.started >= 1.2


class StubArm:
    """An arm's server: answers every request after ``delay_s`` (first calling ``before``, if given),
    or fails on its first one."""

    def __init__(self, name: str, delay_s: float = 0.0, fails: bool = False,
                 before: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.name, self.delay_s, self.fails, self.before, self.chats = name, delay_s, fails, before, 0

    def chat(self, session: str, messages: list[dict[str, str]], **params: Any) -> str:
        if self.fails:
            raise BenchError(f"POST /v1/chat/completions failed (500): {self.name} broke\nthe log's tail")
        if self.before is not None:
            self.before()
        self.chats += 1
        time.sleep(self.delay_s)
        return "I am not sure."

    def tool_calls(self, session: str) -> list[Any]:
        return []

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "adapter": None, "learner": None}

    def train(self) -> None:
        pass  # no learner behind a stub: nothing waits


def serve_stubs(monkeypatch: pytest.MonkeyPatch, arms: dict[str, StubArm]) -> list[str]:
    """Make run_bench's arms ``arms`` instead of servers; returns the arms' names as they start."""
    import contextlib
    import threading

    import whet.world.bench as bench

    started: list[str] = []
    lock = threading.Lock()

    @contextlib.contextmanager
    def served(config: dict[str, Any], arm_dir: Path, whet: Any, cores: Any = None):
        with lock:
            started.append(arm_dir.name)
        yield f"http://127.0.0.1:9/{arm_dir.name}"

    monkeypatch.setattr(bench, "served", served)
    monkeypatch.setattr(bench, "HttpArmClient", lambda http, user: arms[http.base_url.path.strip("/")])
    monkeypatch.setattr(bench, "base_model", lambda model, config, prepare: model)
    return started


def test_an_arm_that_fails_stops_the_others_and_the_report_keeps_the_arms_that_finished(tmp_path, monkeypatch, capsys):
    import tempfile

    import whet.world.bench as bench

    # lora is quick and finishes; memory then starts on its core (longest first: it learns, static does
    # not) and fails at once; memory_lora, slow, is still going then and stops; static never gets to start
    arms = {"lora": StubArm("lora"), "memory_lora": StubArm("memory_lora", delay_s=0.02),
            "memory": StubArm("memory", fails=True), "static": StubArm("static")}  # fmt: skip
    started = serve_stubs(monkeypatch, arms)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the arms' scratch folder
    plan = make_plan(tmp_path, interactions=200, every=200, heldout=2, general=2, chat=1, jobs=2)
    with pytest.raises(BenchError, match=r"arm memory failed: POST .*memory broke\nthe log's tail\n\(the arms that finished, lora, are in "):
        bench.run_bench(load_config(), plan, prepare_model=lambda folder: folder, whet=["whet"])
    # without --keep, a failed run keeps its arms' folders (the error names serve.log there) and says where
    [scratch] = tmp_path.glob("whet-bench-learn-*")
    assert (scratch / "memory").is_dir() and not plan.keep
    assert f"keptin{scratch}" in "".join(capsys.readouterr().err.split())  # the console wraps long paths
    # memory_lora stopped long before its 200 interactions (3 requests each, corrected twice)
    assert 0 < arms["memory_lora"].chats < 200
    assert set(started[:2]) == {"lora", "memory_lora"} and started[2:] == ["memory"]
    assert "static" not in started and arms["static"].chats == 0
    report = json.loads(plan.json_path.read_text())
    assert list(report["arms"]) == ["lora"] and len(report["arms"]["lora"]["curve"]) == 2
    assert report["failed"] == {"memory": "POST /v1/chat/completions failed (500): memory broke"}
    assert report["not_finished"] == ["static", "memory_lora"]
    # the stopped arm's curve as far as it got: measured at the start, before its first checkpoint at 200
    assert report["partial"]["memory_lora"]["curve"] == [{"interactions": 0, "success": 0.0}]
    assert set(report["partial"]) == {"memory_lora"}
    assert plan.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sigterm_stops_the_run_as_ctrl_c_does_and_every_arm_server_is_stopped(tmp_path, monkeypatch):
    import os
    import signal
    import tempfile

    import whet.world.bench as bench

    # lora's third request sends the bench a SIGTERM (as `kill` would); memory_lora runs beside it
    def terminate() -> None:
        if arms["lora"].chats == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    arms = {"lora": StubArm("lora", before=terminate, delay_s=0.01), "memory_lora": StubArm("memory_lora", delay_s=0.01)}
    started = serve_stubs(monkeypatch, arms)
    stopped: list[str] = []
    served = bench.served

    @contextlib.contextmanager
    def tracked(config: dict[str, Any], arm_dir: Path, whet: Any, cores: Any = None):
        assert arm_dir.parent.parent == tmp_path  # the scratch folder, as the run made it
        with served(config, arm_dir, whet, cores) as base:
            try:
                yield base
            finally:
                stopped.append(arm_dir.name)

    monkeypatch.setattr(bench, "served", tracked)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the arms' scratch folder
    before = signal.getsignal(signal.SIGTERM)
    plan = make_plan(tmp_path, arms=("lora", "memory_lora"), interactions=200, every=200, heldout=2, general=2, chat=1, jobs=2)
    with pytest.raises(KeyboardInterrupt):
        bench.run_bench(load_config(), plan, prepare_model=lambda folder: folder, whet=["whet"])
    assert sorted(started) == sorted(stopped) == ["lora", "memory_lora"]  # both servers stopped, none left behind
    assert arms["lora"].chats < 200 and arms["memory_lora"].chats < 200
    assert signal.getsignal(signal.SIGTERM) is before  # the process's own handler is back
    assert not list(tmp_path.glob("whet-bench-learn-*"))  # nor are the arms' folders, without --keep
    assert plan.json_path.parent == tmp_path and not plan.keep


def test_arms_start_longest_first_whatever_order_they_are_named_in():
    from whet.world.bench import ARMS, longest_first

    assert longest_first(["static", "memory", "lora", "memory_lora"]) == ["lora", "memory_lora", "memory", "static"]
    assert longest_first(["memory", "static", "memory_lora"]) == ["memory_lora", "memory", "static"]
    assert sorted(longest_first(ARMS)) == sorted(ARMS)


def test_a_running_arms_checkpoints_are_in_the_json_as_they_are_measured(tmp_path, monkeypatch):
    import whet.world.bench as bench

    plan = make_plan(tmp_path, arms=("lora",), interactions=4, every=2, heldout=2, general=2, chat=1, jobs=1)
    chats: list[dict[str, Any]] = []

    def read_at_the_first_interaction() -> None:  # 2 general tasks, 1 chat, 2 held-out, then interaction 1
        chats.append(json.loads(plan.json_path.read_text()) if len(chats) == 5 else {})

    serve_stubs(monkeypatch, {"lora": StubArm("lora", before=read_at_the_first_interaction)})
    assert bench.run_bench(load_config(), plan, prepare_model=lambda folder: folder, whet=["whet"]) == 0
    during = chats[5]
    assert during["arms"] == {} and during["not_finished"] == ["lora"] and during["base_success"] is None
    assert during["partial"]["lora"]["curve"] == [{"interactions": 0, "success": 0.0}]
    report = json.loads(plan.json_path.read_text())
    assert [p["interactions"] for p in report["arms"]["lora"]["curve"]] == [0, 2, 4] and "partial" not in report


def test_each_arm_is_in_the_json_as_soon_as_it_finishes_while_the_others_run(tmp_path, monkeypatch):
    import whet.world.bench as bench

    plan = make_plan(tmp_path, arms=("lora", "memory_lora"), interactions=4, every=4, heldout=2, general=2, chat=1, jobs=2)
    seen: list[dict[str, Any]] = []

    def read_the_json_once() -> None:  # memory_lora waits on its first request until lora's result is written
        if not seen:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                report = json.loads(plan.json_path.read_text()) if plan.json_path.exists() else {}
                if "lora" in report.get("arms", {}):
                    seen.append(report)
                    return
                time.sleep(0.01)

    serve_stubs(monkeypatch, {"lora": StubArm("lora"), "memory_lora": StubArm("memory_lora", before=read_the_json_once)})
    assert bench.run_bench(load_config(), plan, prepare_model=lambda folder: folder, whet=["whet"]) == 0
    assert list(seen[0]["arms"]) == ["lora"] and seen[0]["not_finished"] == ["memory_lora"]
    assert "failed" not in seen[0] and "partial" not in seen[0]  # memory_lora has measured nothing yet
    report = json.loads(plan.json_path.read_text())
    assert list(report["arms"]) == ["lora", "memory_lora"] and "not_finished" not in report
    assert plan.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_arm_without_a_learner_skips_its_interactions_and_is_measured_at_the_start_and_the_end(tmp_path):
    plan = make_plan(tmp_path, heldout=1, general=1, chat=1)
    tasks = Tasks([FakeTask(f"t{i}") for i in range(6)], [FakeTask("h0")], [FakeTask("g0")], ["Hi!"])
    server, steps = FakeServer(needed=0), []
    result = run_arm("static", server, tasks, FakeUser(), plan, settle_s=0, advance=steps.append)
    assert result.curve == [{"interactions": 0, "success": 1.0}, {"interactions": 6, "success": 1.0}]
    assert server.replies == 0 and all(len(s) == 1 for s in server.sessions.values())
    assert sum(steps) == plan.units_per_arm("static")


def test_the_chat_probe_counts_an_answer_that_called_a_tool_as_a_miss():
    from whet.world.bench import chat_rate

    server = FakeServer(needed=0)
    original = server.chat
    server.chat = lambda session, messages, **params: original(session, messages, chat="tool", **params)
    rate, missed = chat_rate(server, ["Hi!", "Tell me a joke."], lambda n: None)
    assert rate == 0.0
    call = {"name": "now", "arguments": {"timezone": "Lisbon"}}
    assert missed == [{"request": "Hi!", "calls": [call], "answer": "right"},
                      {"request": "Tell me a joke.", "calls": [call], "answer": "right"}]


def test_the_report_has_every_field_and_the_plot_is_a_png(tmp_path):
    plan = make_plan(tmp_path, arms=("static", "memory_lora"))
    curve = [{"interactions": 0, "success": 0.5}, {"interactions": 4, "success": 0.75}, {"interactions": 6, "success": 1.0}]
    results = [ArmResult("static", curve[:1] * 3, 0.5, 0.5), ArmResult("memory_lora", curve, 0.5, 0.5, 1.0, 0.75, 2, 5,
                                                                        "global-0002")]  # fmt: skip
    report = build_report(plan, "default", results, wall_s=12.3, heldout_distinct=2)
    assert report["heldout_distinct"] == 2
    assert {"profile", "seed", "interactions", "every", "base_success", "general_before", "general_after", "command",
            "machine", "wall_s", "arms"} <= set(report)  # fmt: skip
    assert report["base_success"] == 0.5 and report["profile"] == "default"
    assert report["machine"]["cpu_count"] >= 1
    import torch

    from whet.learner.trainer import use_bfloat16

    # the precision the arms' learners train in, as they pick it; a set precision is what they train in
    assert report["machine"]["cpu_trains_bfloat16"] == use_bfloat16("auto", torch.device("cpu"))
    for precision, bf16 in (("float32", False), ("bfloat16", True)):
        assert build_report(plan, "default", results, wall_s=1.0, precision=precision)["machine"]["cpu_trains_bfloat16"] is bf16
    assert report["machine"]["cpu"]  # the CPU's model name where the OS gives one, else its architecture
    assert report["command"].startswith("whet bench learn ") and "--arms static,memory_lora" in report["command"]
    assert report["config_file"] is None
    overrides = {"learner": {"rehearsal": {"repair_passes": 2}}}
    with_file = make_plan(tmp_path, config_path=tmp_path / "f.yaml", config_file=overrides)
    assert build_report(with_file, "default", results, wall_s=1.0)["config_file"] == overrides
    headline = report["arms"]["memory_lora"]
    assert headline["interactions_to_0_9"] == 6 and headline["final_success"] == 1.0
    assert report["arms"]["static"]["interactions_to_0_9"] is None
    assert {"curve", "final_success", "interactions_to_0_9", "general_before", "general_after", "chat_before",
            "chat_after", "adapters_promoted", "lessons"} <= set(headline)  # fmt: skip
    assert (report["chat_before"], report["chat_after"]) == (1.0, 0.75)
    assert report["learner"]["lora"]["learning_rate"] == plan.lora_lr
    json.dumps(report)
    plot(report, plan.plot_path)
    assert plan.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # before any arm has finished there are curves so far and no general skill after yet
    early = tmp_path / "early.png"
    plot({"profile": "default", "seed": 0, "partial": {"lora": {"curve": curve[:2], "general_before": 0.5}}}, early)
    assert early.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("arm", ARMS)
def test_each_arm_serves_the_shared_model_from_its_own_store_with_only_its_learning_switched_on(tmp_path, arm):
    base = load_config(overrides={"store": {"url": "postgresql+psycopg://x@db/whet"}, "bus": {"url": "mqtt://b:1883"},
                                  "server": {"api_keys": {"sk-1": "alice"}}, "learner": {"lora": {"rank": 4}}})  # fmt: skip
    settings = arm_config(base, arm, tmp_path / arm, "/models/tiny", 4321)
    path = tmp_path / "arm.yaml"
    path.write_text(yaml.safe_dump(settings))
    config = load_config(path)  # what the arm's `whet serve` will read
    assert config.data_path == tmp_path / arm and config.server.port == 4321 and not config.server.api_keys
    assert config.store_url == f"sqlite:///{tmp_path / arm / 'whet.db'}" and config.bus.url is None
    assert config.model.id == "/models/tiny" and config.learner.lora.rank == 4
    learned = (config.learner.enabled, config.learner.enabled and config.learner.train,
               config.learner.enabled and config.learner.lessons)  # fmt: skip
    assert learned == {"static": (False, False, False), "memory": (True, False, True), "lora": (True, True, False),
                       "memory_lora": (True, True, True)}[arm]  # fmt: skip
    assert (config.learner.batch_size, config.learner.batch_timeout_s, config.learner.poll_s) == (32, 900, 0.5)


# ----------------------------------------------------------------------------- the learner's idle signal


@pytest.mark.anyio
async def test_the_learner_is_busy_until_every_closed_turn_is_judged_and_every_trainable_one_trained(tmp_path):
    store = open_store(f"sqlite:///{tmp_path / 'whet.db'}")
    bus = MemoryBus()
    await bus.start()
    settings = {"batch_size": 8, "batch_timeout_s": 3600, "gate": {"holdout_fraction": 0.0}}
    config = load_config(overrides={"learner": settings}).learner
    learner = Learner(config, store, bus, RulesJudge(), AdapterRegistry(store, bus, tmp_path / "adapters"),
                      trainer=lambda: pytest.fail("status() must not build a trainer"))  # fmt: skip
    try:
        assert (await learner.status())["busy"] is False
        session = await store.create_session("alice")
        turn = await store.add_turn(TurnCreate(
            session_id=session.id, user_id="alice", request_id="req-1", step=0, model="tiny",
            prompt_messages=[{"role": "user", "content": "What time is it at home?"}], response_text="It is 10:00.",
            response_token_ids=[3, 4], response_logprobs=[-0.3, -0.2],
        ))  # fmt: skip
        assert (await learner.status())["busy"] is False, "an open turn is nothing to learn from yet"
        await store.close_turn(turn.id, "user_message", {"messages": [{"role": "user", "content": "No, I meant Lisbon time"}]})
        assert (await learner.status())["busy"] is True
        await learner.catch_up()
        assert (await store.get_judgment(turn.id)).trainable
        assert (await learner.status())["busy"] is True, "a judged sample waits for its training step"
        await store.register_candidate(Adapter(id="global-0001", path=str(tmp_path)), [turn.id])
        status = await learner.status()
        assert status == {"judged": 1, "lessons": 1, "lessons_held": 0, "lessons_narrowed": 0, "lessons_misled": 0, "lesson_check_s": 0.0, "steps": 0, "promoted": 0, "rejected": 0, "rolled_back": 0, "deferred": 0,
                          "phase": None, "work": 0, "busy": False}  # fmt: skip
    finally:
        await bus.aclose()
        await store.aclose()


@pytest.mark.anyio
async def test_a_split_holdout_verdict_never_keeps_the_learner_busy(tmp_path):
    store = open_store(f"sqlite:///{tmp_path / 'whet.db'}")
    bus = MemoryBus()
    learner = Learner(load_config().learner, store, bus, RulesJudge(), AdapterRegistry(store, bus, tmp_path),
                      trainer=lambda: pytest.fail("status() must not build a trainer"))  # fmt: skip
    try:
        session = await store.create_session("alice")
        turn = await store.add_turn(TurnCreate(session_id=session.id, user_id="alice", request_id="r", step=0,
                                               model="tiny", response_token_ids=[1], response_logprobs=[-0.1]))  # fmt: skip
        await store.close_turn(turn.id, "feedback", {"score": 1})
        await store.save_judgment(Judgment(turn_id=turn.id, user_id="alice", request_id="r", score=1, reason="t",
                                           judge="t", split="holdout", trainable=True))  # fmt: skip
        assert (await learner.status())["busy"] is False
    finally:
        await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("enabled", [True, False], ids=["learner", "no-learner"])
async def test_health_reports_the_learners_counters_and_whether_it_is_busy(tmp_path, enabled):
    from test_api import chat_body, serve

    from whet.runtime.scripted import ScriptedBackend

    backend = ScriptedBackend(["It is 10:00.", "Sorry: it is 11:00 in Lisbon."])
    async with serve(tmp_path, backend, learner={"enabled": enabled, "train": False}) as (client, _):
        if not enabled:
            assert (await client.get("/health")).json()["learner"] is None
            return
        await client.post("/v1/chat/completions", json=chat_body("What time is it at home?", user="alice"))
        await client.post("/v1/chat/completions", json=chat_body("What time is it at home?", "It is 10:00.",
                                                                 "No, I meant Lisbon time", user="alice"))  # fmt: skip
        with anyio.fail_after(30):
            while (learner := (await client.get("/health")).json()["learner"])["busy"]:
                await anyio.sleep(0.01)  # the learner runs in the background of the app
    assert (learner["judged"], learner["lessons"], learner["steps"]) == (1, 1, 0)


# ----------------------------------------------------------------------------- real processes


@pytest.mark.loopback
def test_a_server_that_cannot_start_is_one_error_with_the_tail_of_its_log(tmp_path):
    settings = arm_config(load_config(), "static", tmp_path / "data", str(tmp_path / "no-such-model"), free_port())
    with pytest.raises(BenchError) as failed, served(settings, tmp_path, [sys.executable, "-m", "whet.runtime.cli"]):
        pytest.fail("a server without a model must not become ready")
    message = str(failed.value)
    assert "exited with code 1" in message and "serve.log" in message and "no-such-model" in message


def test_arms_at_once_get_disjoint_core_shares_and_a_server_runs_on_its_share_only(tmp_path, monkeypatch):
    from whet.learner.tiny import build_tiny_model
    from whet.world import bench

    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert bench.core_shares(2) == [[0, 2, 4], [1, 3]] and bench.core_shares(1) == [[0, 1, 2, 3, 4]]
    monkeypatch.undo()

    model = build_tiny_model(tmp_path / "m")
    share = bench.usable_cores()[-1:]
    settings = arm_config(load_config(), "static", tmp_path / "data", str(model), free_port())
    with served(settings, tmp_path, [sys.executable, "-m", "whet.runtime.cli"], share):
        config = str(tmp_path / "whet.yaml")
        pids = [p.name for p in Path("/proc").iterdir() if p.name.isdigit()
                and config in (p / "cmdline").read_bytes().decode(errors="replace")]  # fmt: skip
        assert pids, "the server process was not found"
        status = (Path("/proc") / pids[0] / "status").read_text()
        allowed = next(line.split(":")[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list"))
        assert allowed == str(share[0])


def _run_in_own_group(command: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run ``command`` in a process group of its own, so a timeout also ends the servers it started
    (about 2 minutes alone on 2 cores; the limit leaves room for a busy machine)."""
    import os
    import signal

    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)


@pytest.mark.loopback
@pytest.mark.timeout(560)
def test_bench_learn_quick_runs_end_to_end(tmp_path):
    from whet.learner.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "m")
    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump({"data_dir": str(tmp_path / "data"), "memory": {"embedder": "hashing"},
                                      "model": {"max_new_tokens": 16}}))  # fmt: skip
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    done = _run_in_own_group(
        [sys.executable, "-m", "whet.runtime.cli", "bench", "learn", "--quick", "--config", str(config),
         "--model", str(model), "--json", str(out_json), "--plot", str(out_png)], timeout_s=520,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out_json.read_text())
    assert (report["interactions"], report["every"], report["seed"]) == (4, 2, 0)
    assert set(report["arms"]) == set(ARMS)
    for name, arm in report["arms"].items():
        # without a learner nothing can change: measured at the start and the end only
        assert [p["interactions"] for p in arm["curve"]] == ([0, 4] if name == "static" else [0, 2, 4])
        assert 0.0 <= arm["chat_before"] <= 1.0 and 0.0 <= arm["chat_after"] <= 1.0
        assert all(0.0 <= p["success"] <= 1.0 for p in arm["curve"])
        assert arm["final_success"] == arm["curve"][-1]["success"]
    assert report["arms"]["static"]["lessons"] == 0 and report["arms"]["static"]["adapters_promoted"] == 0
    # the weights arms' steps, read back from each server's /v1/learning with their time by phase
    phases = {"start", "replay_before", "train", "repair", "replay_after", "pinned_after"}
    for name in ("lora", "memory_lora"):
        arm = report["arms"][name]
        assert arm["steps"] >= arm["adapters_promoted"]
        assert arm["steps"] == 0 or (set(arm["step_seconds"]) == phases and arm["step_seconds"]["train"] > 0)
    assert report["arms"]["static"]["steps"] == 0 and report["arms"]["memory"]["steps"] == 0
    assert report["arms"]["memory"]["adapters_promoted"] == 0 and report["arms"]["lora"]["lessons"] == 0
    # an untrained model serves the user badly: its corrections became lessons where lessons are kept
    assert report["arms"]["memory"]["lessons"] > 0 and report["arms"]["memory_lora"]["lessons"] > 0
    assert "--interactions 4 --every 2" in report["command"]
    assert report["config_file"] == yaml.safe_load(config.read_text())  # what the command's --config set
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "memory_lora" in done.stdout and str(out_json) in done.stdout.replace("\n", "")
