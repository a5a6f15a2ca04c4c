"""Faults survived: real processes, real sockets, real signals.

Each test breaks one thing under a running ``whet serve`` or ``whet learn`` (the broker, the
database link, the disk, the process itself) and checks three things: what a client sees
while it is broken (a clear status, never a hang or a 500), that the service recovers on its
own, and that nothing it acknowledged was lost. (MCP servers that die, hang or write garbage
are in test_tools.py.)
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import anyio
import httpx
import pytest
import yaml
from sqlalchemy import create_engine, text

from whet.learner.tiny import build_tiny_model
from whet.memory.bus import MemoryBus
from whet.memory.store import open_store

from test_bus import Proxy
from test_learner import BAD, GOOD, LORA, QUESTIONS, judged_turn, learner_config, make_learner, new_trainer
from test_loopback import free_port, wait_healthy

pytestmark = pytest.mark.loopback

MOSQUITTO = "/usr/sbin/mosquitto"
TRAINING = {  # one optimizer step per 4 judged turns, every candidate accepted (no held-out turns)
    "batch_size": 4, "batch_timeout_s": 3600, "poll_s": 1.0, "device": "cpu", "lora": LORA.model_dump(),
    "gate": {"holdout_fraction": 0.0, "tolerance": 0.0, "regression_set": None},
    # no repair passes and no hold to the base model (the shipped setting's): on the tiny model they are minutes
    # of reading the rehearsal set a step, and these tests are about processes dying, not general skill
    "rehearsal": {"repair_passes": 0, "kl_weight": 0.0},
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def unavailable(reason: str) -> None:
    """Skip on a machine without what the fault needs; under CI=true the fault tests must run."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: the fault tests must run)")
    pytest.skip(reason)


def write_config(tmp_path: Path, tiny_model: Path, data_dir: Path | None = None, **sections) -> Path:
    """A whet.yaml for the tiny model with no MCP servers (the faults here are elsewhere)."""
    mcp = tmp_path / "mcp.json"
    mcp.write_text(json.dumps({"mcpServers": {}}))
    config = {
        "data_dir": str(data_dir or tmp_path / "data"),
        "memory": {"embedder": "hashing"},
        "model": {"id": str(tiny_model), "max_new_tokens": 4},
        "mcp": {"config": str(mcp)},
        "learner": {"enabled": False},
        **sections,
    }
    path = tmp_path / "whet.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def whet(*args: str) -> list[str]:
    return [sys.executable, "-m", "whet.runtime.cli", *args]


@contextmanager
def process(command: list[str], log_path: Path) -> Iterator[subprocess.Popen]:
    """A child process, ended (terminate, then kill) however the test ends."""
    with log_path.open("a") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@contextmanager
def serving(config: Path, *flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    port = free_port()
    log = config.parent / "serve.log"
    with process(whet("serve", "--config", str(config), "--port", str(port), *flags), log) as proc:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc, log)
        yield proc, base


def chat(client: httpx.Client, text_: str, **fields) -> httpx.Response:
    """One chat, one turn: no tools here, and markup the untrained tiny model writes by chance
    is not acted on (``tool_choice: none``), so a chat never grows a second step."""
    body = {
        "model": "tiny",
        "tool_choice": "none",
        "messages": [{"role": "user", "content": text_}],
        **fields,
    }
    return client.post("/v1/chat/completions", json=body)


# a learner process's steps on the tiny model with the bundled rehearsal and pinned sets: about a minute each
# on one old 2-core CPU (a Zen 1 EPYC, stop 66: `learn --once`'s three steps overran 120 s there). What is
# checked is that it ends, and how; a hang still fails, after this long
LEARN_TIMEOUT_S = 600


def wait_for(condition: Callable[[], bool], what: str, deadline_s: float = 120) -> None:
    """Poll another process's state (a database, a port): there is no event to wait on. The deadline
    holds a child's start (torch, the model) on a loaded machine: at 60 s, "the first batch trained"
    was missed once with a benchmark running beside the suite on 2 cores (the test passed alone)."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {deadline_s}s: {what}")
        time.sleep(0.2)


def sqlite_rows(db: Path, query: str) -> list[tuple]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as connection:
        return connection.execute(query).fetchall()


# ----------------------------------------------------------------------------- the bus


@contextmanager
def mosquitto(port: int, log_path: Path) -> Iterator[subprocess.Popen]:
    with process([MOSQUITTO, "-p", str(port)], log_path) as broker:
        wait_for(lambda: _listening(port), f"mosquitto listening on {port}", 10)
        yield broker


def _listening(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def test_serving_goes_on_while_the_broker_is_down_and_every_turn_is_trained_after_it_returns(
    tmp_path, tiny_model, record_property
):
    """``whet serve --no-learner`` and ``whet learn`` over a Mosquitto the test stops and restarts.

    The store polls are 10 minutes apart, so only the bus can bring the work: its events, and
    after the restart (the broker forgot every session) each process's catch-up on reconnect."""
    if not Path(MOSQUITTO).is_file():
        unavailable(f"{MOSQUITTO} is not installed")
    port = free_port()
    config = write_config(tmp_path, tiny_model, bus={"url": f"mqtt://127.0.0.1:{port}/whet-faults"},
                          learner={**TRAINING, "enabled": True, "poll_s": 600})  # fmt: skip
    db = tmp_path / "data" / "whet.db"
    trained = "SELECT count(*) FROM judgments WHERE trained_in IS NOT NULL"

    def record(client: httpx.Client, n: int, label: str) -> list[str]:
        ids = []
        for i in range(n):
            reply = chat(client, f"{label} question {i}")
            assert reply.status_code == 200, reply.text
            turn = reply.json()["id"]
            rated = client.post("/v1/feedback", json={"turn_id": turn, "score": 1 if i % 2 else -1})
            assert rated.status_code == 201, rated.text
            ids.append(turn)
        return ids

    broker_log = tmp_path / "mosquitto.log"
    broker = mosquitto(port, broker_log)
    broker.__enter__()
    try:
        with serving(config, "--no-learner") as (_, base), process(whet("learn", "--config", str(config)),
                                                                    tmp_path / "learn.log"):  # fmt: skip
            with httpx.Client(base_url=base, timeout=30) as client:
                before = record(client, 4, "before")
                wait_for(lambda: sqlite_rows(db, trained)[0][0] == 4, "the first batch trained")

                broker.__exit__(None, None, None)  # the broker goes away
                broker = None
                started = time.monotonic()
                during = record(client, 4, "during")
                assert time.monotonic() - started < 30, "serving slowed down to a crawl without the broker"

                broker = mosquitto(port, broker_log)
                broker.__enter__()
                wait_for(
                    lambda: sqlite_rows(db, trained)[0][0] == 8,
                    "every turn trained after the broker returned",
                )
                live = sqlite_rows(db, "SELECT id FROM adapters WHERE status = 'live'")
                assert len(live) == 1
                # the server hears of the new version over the bus that came back
                wait_for(
                    lambda: client.get("/health").json()["adapter"] == live[0][0], "the server serves it"
                )
    finally:
        if broker is not None:
            broker.__exit__(None, None, None)
    judged = dict(sqlite_rows(db, "SELECT turn_id, trained_in FROM judgments"))
    assert set(judged) == set(before + during) and all(judged.values())
    record_property("turns_while_down", len(during))
    record_property("trained", sum(1 for t in before + during if judged[t]))
    versions = {v for (v,) in sqlite_rows(db, "SELECT id FROM adapters")}
    assert {judged[t] for t in during} <= versions and len(versions) == 2


# ----------------------------------------------------------------------------- the learner


@pytest.mark.parametrize("point", ["before_step", "before_publish", "after_save"])
def test_a_learner_process_sigkilled_mid_step_trains_every_turn_exactly_once_after_restart(
    tmp_path, tiny_model, point, record_property
):
    config = write_config(tmp_path, tiny_model, learner={**TRAINING, "enabled": True})
    data = tmp_path / "data"

    async def seed() -> list[str]:
        store = open_store(f"sqlite:///{data / 'whet.db'}")
        encoder = new_trainer(tiny_model)
        try:
            return [await judged_turn(store, encoder, QUESTIONS[i % 4], GOOD if i % 2 else BAD, 1 if i % 2 else -1,
                                      "train") for i in range(12)]  # fmt: skip
        finally:
            await store.aclose()

    turns = anyio.run(seed)
    crashing = [sys.executable, str(Path(__file__).parent / "peers" / "crashing_learner.py"), point, "2"]
    with process([*crashing, "--config", str(config)], tmp_path / "crash.log") as first:
        assert first.wait(timeout=LEARN_TIMEOUT_S) == -signal.SIGKILL, (tmp_path / "crash.log").read_text()[-2000:]
    with process(whet("learn", "--once", "--config", str(config)), tmp_path / "learn.log") as second:
        assert second.wait(timeout=LEARN_TIMEOUT_S) == 0, (tmp_path / "learn.log").read_text()[-2000:]

    db = data / "whet.db"
    adapters = {row[0]: row[1:] for row in sqlite_rows(db, "SELECT id, path, status, parent FROM adapters")}
    # the registry and the disk agree: every version has its folder, every folder its row
    folders = {p.parent.name: p.parent for p in (data / "adapters").rglob("trainer_state.json")}
    assert set(folders) == set(adapters) and len(adapters) == 3
    assert not [p for p in (data / "adapters").rglob("*") if p.name.startswith(".")], (
        "half-written folders left"
    )
    live = [v for v, (_, status, _) in adapters.items() if status == "live"]
    assert len(live) == 1
    # the live lineage trained each turn exactly once
    batches, version = [], live[0]
    while version is not None:
        batches += json.loads((Path(adapters[version][0]) / "trainer_state.json").read_text())["batch"]
        version = adapters[version][2]
    assert sorted(batches) == sorted(turns)
    trained_in = dict(sqlite_rows(db, "SELECT turn_id, trained_in FROM judgments"))
    assert all(trained_in[t] in adapters for t in turns)
    record_property("turns", len(turns))
    record_property("trained_once", len(batches))


# ----------------------------------------------------------------------------- the database link


class ThreadedProxy:
    """test_bus's TCP relay on its own event loop thread, for a server in another process."""

    def __init__(self, target_port: int) -> None:
        self.relay = Proxy(target_port)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def _do(self, coroutine) -> None:
        asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=10)

    def start(self) -> int:
        self._do(self.relay.start())  # after the first start, the same port again
        return self.relay.port

    def cut(self) -> None:
        self._do(self.relay.stop())  # open connections dropped, new ones refused

    def close(self) -> None:
        if self.relay._server is not None and self.relay._server.is_serving():
            self.cut()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


def test_postgresql_out_of_reach_is_a_503_and_whet_recovers_without_a_restart(tmp_path, tiny_model, record_property,
                                                                               postgres_schema_url):  # fmt: skip
    proxy = ThreadedProxy(5432)
    try:
        port = proxy.start()
        url = postgres_schema_url.replace("127.0.0.1:5432", f"127.0.0.1:{port}", 1)
        assert url != postgres_schema_url
        config = write_config(tmp_path, tiny_model, store={"url": url})
        acknowledged = []
        with serving(config) as (proc, base), httpx.Client(base_url=base, timeout=60) as client:
            for i in range(3):
                reply = chat(client, f"before {i}")
                assert reply.status_code == 200, reply.text
                acknowledged.append(reply.json()["id"])

            proxy.cut()
            for attempt in ("chat", "stream", "feedback", "turns"):
                started = time.monotonic()
                if attempt == "chat":
                    down = chat(client, "while the database is away")
                elif attempt == "stream":
                    down = chat(client, "streamed while the database is away", stream=True)
                elif attempt == "feedback":
                    down = client.post("/v1/feedback", json={"turn_id": acknowledged[0], "score": 1})
                else:
                    down = client.get("/v1/turns")
                assert time.monotonic() - started < 20, f"{attempt} hung while the database was away"
                assert down.status_code == 503, (attempt, down.status_code, down.text)
                assert (
                    down.headers["retry-after"] and "store is unavailable" in down.json()["error"]["message"]
                )

            proxy.start()  # the database is back; whet was never restarted
            for i in range(3):
                reply = chat(client, f"after {i}")
                assert reply.status_code == 200, reply.text
                acknowledged.append(reply.json()["id"])
            assert (
                client.post("/v1/feedback", json={"turn_id": acknowledged[0], "score": 1}).status_code == 201
            )
            assert proc.poll() is None
    finally:
        proxy.close()
    engine = create_engine(postgres_schema_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as connection:
            stored = {row[0] for row in connection.execute(text("SELECT id FROM turns"))}
    finally:
        engine.dispose()
    assert set(acknowledged) <= stored
    record_property("acknowledged", len(acknowledged))
    record_property("lost", len(set(acknowledged) - stored))


# ----------------------------------------------------------------------------- the process itself


def test_whet_serve_sigkilled_under_concurrent_writes_keeps_every_acknowledged_turn(
    tmp_path, tiny_model, record_property
):
    """Two rounds: start (the second a clean restart after a kill), six writers, SIGKILL mid-write."""
    config = write_config(tmp_path, tiny_model)
    db = tmp_path / "data" / "whet.db"
    acknowledged: list[str] = []
    rated: list[str] = []
    for round_ in range(2):
        with serving(config) as (proc, base):
            with httpx.Client(base_url=base, timeout=30) as client:  # what the last kill left is all there
                listed = {t["id"] for t in client.get("/v1/turns", params={"limit": 500}).json()}
                assert set(acknowledged) <= listed
            stop = threading.Event()

            def writer(n: int, base: str = base, stop: threading.Event = stop, round_: int = round_) -> None:
                with httpx.Client(base_url=base, timeout=30) as client:
                    i = 0
                    while not stop.is_set():
                        try:
                            reply = chat(client, f"round {round_} writer {n} message {i}")
                            if reply.status_code != 200:
                                continue
                            acknowledged.append(reply.json()["id"])
                            rating = client.post(
                                "/v1/feedback", json={"turn_id": reply.json()["id"], "score": 1}
                            )
                            if rating.status_code == 201:
                                rated.append(reply.json()["id"])
                        except httpx.HTTPError:  # the kill cut this request: it was never acknowledged
                            return
                        i += 1

            with ThreadPoolExecutor(6) as pool:
                for n in range(6):
                    pool.submit(writer, n)
                wait_for(lambda r=round_: len(acknowledged) >= 6 * (r + 1), "writes acknowledged under load")
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=10)
                stop.set()
        assert sqlite_rows(db, "PRAGMA integrity_check") == [("ok",)]
        stored = {row[0] for row in sqlite_rows(db, "SELECT id FROM turns")}
        assert set(acknowledged) <= stored, f"round {round_}: acknowledged turns lost"
        with_feedback = {row[0] for row in sqlite_rows(db, "SELECT turn_id FROM feedback")}
        assert set(rated) <= with_feedback, f"round {round_}: acknowledged feedback lost"
    assert len(acknowledged) >= 12
    record_property("acknowledged", len(acknowledged))
    record_property("rated", len(rated))


# ----------------------------------------------------------------------------- the disk


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A 2 MB tmpfs: a data directory whose disk really fills up (needs root to mount)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        unavailable(f"cannot mount a tmpfs here (needs root): {made.stderr.decode().strip()[:200]}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_a_507_with_nothing_corrupted_and_writes_resume_when_space_returns(tmp_path, tiny_model, record_property,
                                                                                          small_disk):  # fmt: skip
    config = write_config(tmp_path, tiny_model, data_dir=small_disk)
    db = small_disk / "whet.db"
    acknowledged = []
    with serving(config) as (proc, base), httpx.Client(base_url=base, timeout=60) as client:
        for i in range(3):
            reply = chat(client, f"before {i}")
            assert reply.status_code == 200, reply.text
            acknowledged.append(reply.json()["id"])

        filler = small_disk / "filler"
        with filler.open("wb") as f, pytest.raises(OSError, match="No space left"):
            while True:  # fill every last block
                f.write(b"\0" * 65536)
                f.flush()
        statuses = []
        for i in range(40):  # the WAL may still have room for a few writes
            reply = chat(client, f"while full {i} " + "x" * 20_000)
            statuses.append(reply.status_code)
            if reply.status_code == 200:
                acknowledged.append(reply.json()["id"])
            else:
                break
        assert statuses[-1] == 507, statuses
        error = reply.json()["error"]
        assert error["code"] == "store_full" and "disk is full" in error["message"]
        assert client.get("/health").status_code == 200  # reading still works

        filler.unlink()  # space returns
        for i in range(3):
            reply = chat(client, f"after {i}")
            assert reply.status_code == 200, reply.text
            acknowledged.append(reply.json()["id"])
        assert proc.poll() is None
    assert sqlite_rows(db, "PRAGMA integrity_check") == [("ok",)]
    stored = {row[0] for row in sqlite_rows(db, "SELECT id FROM turns")}
    assert set(acknowledged) <= stored
    assert shutil.disk_usage(small_disk).free > 0
    record_property("acknowledged", len(acknowledged))
    record_property("accepted_while_full", statuses.count(200))


def test_a_learner_whose_adapter_disk_is_full_leaves_no_partial_version_and_trains_when_space_returns(
    tmp_path, tiny_model, small_disk
):
    """The step cannot be saved: nothing of it stays on disk or in the store, and its turns wait."""

    async def scenario() -> None:
        store = open_store(f"sqlite:///{tmp_path / 'whet.db'}")
        encoder = new_trainer(tiny_model)
        turns = [await judged_turn(store, encoder, QUESTIONS[i], GOOD if i % 2 else BAD, 1 if i % 2 else -1,
                                   "train") for i in range(4)]  # fmt: skip
        learner = make_learner(
            learner_config(batch_size=4), store, MemoryBus(), tiny_model, small_disk / "adapters"
        )
        filler = small_disk / "filler"
        with filler.open("wb") as f, pytest.raises(OSError, match="No space left"):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        try:
            with pytest.raises(OSError, match="No space left"):
                await learner.train_ready()
            assert not [p for p in small_disk.rglob("*") if p.name.startswith(".")], (
                "a half-written version stayed"
            )
            assert await store.list_adapters() == []
            assert [(await store.get_judgment(t)).trained_in for t in turns] == [None] * 4

            filler.unlink()  # space returns
            [version] = await learner.train_ready()
            assert [(await store.get_judgment(t)).trained_in for t in turns] == [version] * 4
        finally:
            await store.aclose()

    anyio.run(scenario)
