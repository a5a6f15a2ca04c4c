"""The service's figures for ``bench/perf.py``: swaps under load, lesson and adapter latency, the agent
loop's overhead, lesson search at scale, store and bus throughput, and training beside serving.

Each ``p*`` function runs one measurement on a fresh in-process app (ASGI transport, SQLite in a
temporary folder, the in-process bus) unless it measures an engine itself (PostgreSQL, Mosquitto),
and returns plain figures. Sizes come from :class:`Sizes` (``quick`` for CI).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import random
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from whet.config.settings import LoraConfig, load_config
from whet.learner.registry import AdapterRegistry
from whet.memory.bus import open_bus
from whet.memory.index import HashingEmbedder, LessonIndex, minilm_available, open_embedder
from whet.memory.store import open_store
from whet.memory.tables import Adapter, TurnCreate
from whet.runtime.app import create_app
from whet.runtime.policy import PolicyBackend, SamplingParams
from whet.runtime.scripted import ScriptedBackend
from whet.runtime.tools import ToolPool

USER = "bench"
CORRECTION = "No, I meant Lisbon time"


@dataclass
class Sizes:
    load_s: float = 30.0  # p1: seconds of closed-loop load, with and without swaps (each)
    concurrency: int = 8  # p1: chats in flight
    swap_every_s: float = 3.0  # p1: a new adapter version this often
    swap_rounds: int = 6  # p1: steady and swapping windows alternate this many times
    repeats: int = 20  # p2, p4, p5: measurements per figure
    batch: int = 4  # p3: judged turns per training step
    overhead_lessons: int = 100_000  # p4
    overhead_requests: int = 200  # p4: requests timed (a median of a few ms wants many)
    search_lessons: int = 1_000_000  # p5
    search_users: int = 10  # p5: the lessons are spread over this many users
    store_turns: int = 1000  # p6
    mqtt_events: int = 5000  # p7
    train_requests: int = 20  # serving latency samples, idle and while training
    train_batch: int = 16

    @classmethod
    def quick(cls) -> Sizes:
        return cls(load_s=3.0, swap_every_s=0.5, swap_rounds=1, repeats=5, batch=2, overhead_lessons=2000,
                   overhead_requests=10, search_lessons=5000, store_turns=50, mqtt_events=200, train_requests=4, train_batch=2)  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


@asynccontextmanager
async def whet_app(
    data_dir: Path, backend: PolicyBackend, source: Path, /, **overrides: Any
) -> AsyncIterator[Any]:
    """(client, resources) of a fresh app on ``backend``; ``source`` is the model a learner trains;
    ``overrides`` are config sections merged over the defaults here."""
    base: dict[str, Any] = {"data_dir": str(data_dir), "memory": {"embedder": "hashing"},
                            "model": {"id": str(source), "max_new_tokens": 8},
                            "learner": {"enabled": False, "gate": {"holdout_fraction": 0.0, "regression_set": None}},
                            # closed-loop load from one client measures serving, not the per-key limits
                            "server": {"max_concurrent_per_key": 0, "rate_limit_per_minute": 0}}  # fmt: skip
    for key, value in overrides.items():
        base[key] = _merged(base.get(key, {}), value) if isinstance(value, dict) else value
    app = create_app(load_config(overrides=base), backend=backend, tools=ToolPool([], in_memory={}),
                     embedder=HashingEmbedder())  # fmt: skip
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://whet", timeout=120) as client:
            yield client, app.state.resources


def _merged(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {**a, **{k: _merged(a.get(k, {}), v) if isinstance(v, dict) else v for k, v in b.items()}}


async def chat(client: httpx.AsyncClient, text: str, user: str = USER) -> httpx.Response:
    body = {"model": "bench", "user": user, "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    return await client.post("/v1/chat/completions", json=body, headers={"X-Whet-Session": uuid.uuid4().hex})


# ----------------------------------------------------------------------------- p1: swaps under load


async def _closed_loop(client: httpx.AsyncClient, sizes: Sizes) -> tuple[list[float], int]:
    """``concurrency`` chats in flight for ``load_s`` seconds: (latencies of the answered, failures)."""
    deadline = time.perf_counter() + sizes.load_s
    latencies: list[float] = []
    failures = 0

    async def worker(w: int) -> None:
        nonlocal failures
        i = 0
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                response = await chat(client, f"Remind me about errand {w}-{i}")
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - started)
            else:
                failures += 1
            i += 1

    await asyncio.gather(*(worker(w) for w in range(sizes.concurrency)))
    return latencies, failures


async def p1_swaps_under_load(work: Path, backend: PolicyBackend, model: Path, adapter: Path,
                              sizes: Sizes) -> dict[str, float]:  # fmt: skip
    """Closed-loop chats on one live adapter version, in windows that alternate: steady, then with a
    new version published every ``swap_every_s`` (``swap_rounds`` of each, ``load_s`` in all per phase).
    Both phases serve through an adapter, so the ratio is the swaps' cost alone (not an adapter's
    forward cost against the base weights'); alternating windows keep the machine's drift over the
    run (another process, the clock speed) out of the ratio, which one long window of each let in."""
    async with whet_app(work / "p1", backend, model) as (client, res):
        registry = AdapterRegistry(res.store, res.bus, work / "p1" / "adapters")
        await res.store.add_adapter(Adapter(id="global-0001", path=str(adapter)))
        await registry.promote("global-0001")
        await asyncio.wait_for(res.follower.wait_until(lambda: res.adapters.live_version() == "global-0001"), 60)
        await _closed_loop(
            client, Sizes(load_s=min(1.0, sizes.load_s), concurrency=sizes.concurrency)
        )  # warm-up
        window = Sizes(load_s=sizes.load_s / sizes.swap_rounds, concurrency=sizes.concurrency)
        steady: list[float] = []
        swapping: list[float] = []
        failed = 0
        swaps = 1

        async def swap_forever() -> None:  # as the learner publishes: store first, then the bus event
            nonlocal swaps
            await asyncio.sleep(sizes.swap_every_s / 2)
            while True:
                version = f"global-{swaps + 1:04d}"
                await res.store.add_adapter(Adapter(id=version, path=str(adapter), parent=f"global-{swaps:04d}"))
                await registry.promote(version)
                swaps += 1
                await asyncio.sleep(sizes.swap_every_s)

        for _ in range(sizes.swap_rounds):
            latencies, window_failed = await _closed_loop(client, window)
            steady += latencies
            failed += window_failed
            swapper = asyncio.create_task(swap_forever())
            try:
                latencies, window_failed = await _closed_loop(client, window)
            finally:
                swapper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await swapper
            swapping += latencies
            failed += window_failed
            # the next steady window starts on a replica that has followed the last swap
            stored = await res.store.live_adapter("global")  # the store is the truth; the replica must follow it
            last = stored.id if stored else None
            await asyncio.wait_for(
                res.follower.wait_until(lambda last=last: res.adapters.live_version() == last), timeout=60
            )
            await res.adapters.settle()
    return {
        "p1_failed_requests": failed,
        "p1_p99_ratio": percentile(swapping, 99) / percentile(steady, 99),
        "p1_p99_ms_steady": percentile(steady, 99) * 1000,
        "p1_p99_ms_swapping": percentile(swapping, 99) * 1000,
        "p1_requests": len(steady) + len(swapping),
        "p1_swaps": swaps - 1,  # under load (the first version went live before)
    }


# ----------------------------------------------------------------------------- p2, p3: lessons and adapters


async def p2_lesson_latency(work: Path, model: Path, sizes: Sizes) -> dict[str, float]:
    """Feedback with a correction -> the lesson is what retrieval offers the user's next request."""
    backend = ScriptedBackend(lambda messages, tools: "It is 10:00 in Paris.")
    latencies = []
    async with whet_app(work / "p2", backend, model, learner={"enabled": True, "train": False}) as (
        client,
        res,
    ):
        for i in range(sizes.repeats):
            user = f"p2-{i}"
            turn_id = (await chat(client, "What time is it at home?", user)).json()["id"]
            started = time.perf_counter()
            response = await client.post(
                "/v1/feedback", json={"turn_id": turn_id, "score": -1, "text": CORRECTION}
            )
            assert response.status_code == 201, response.text

            def retrieved(user: str = user) -> bool:
                return any(
                    "Lisbon" in hit.text for hit in res.index.search(user, "What time is it at home?", 4)
                )

            await asyncio.wait_for(res.follower.wait_until(retrieved), timeout=30)
            latencies.append(time.perf_counter() - started)
    return {"p2_lesson_latency_ms": statistics.median(latencies) * 1000}


async def p3_adapter_latency(
    work: Path, backend: PolicyBackend, model: Path, sizes: Sizes, device: str = "cpu", dtype: str = "auto"
) -> dict[str, float]:
    """The feedback that completes a training batch -> the first request answered by the new version.

    The learner trains on ``device`` in ``dtype``, as the serving backend runs (one GPU for both on CUDA)."""
    learner = {"enabled": True, "batch_size": sizes.batch, "batch_timeout_s": 3600, "poll_s": 0.2, "device": device}
    model_settings = {"device": device, "dtype": dtype}
    async with whet_app(work / "p3", backend, model, learner=learner, model=model_settings) as (client, res):
        # a learner loads its trainer (the model, greedy replies for rehearsal) once it has had something
        # to train: a server that has run a while has done it, so the clock starts on a ready learner
        await res.learner.prepare()
        turns = [(await chat(client, f"Add item {i} to my list")).json()["id"] for i in range(sizes.batch)]
        for i, turn_id in enumerate(turns):
            thumbs = "up" if i % 2 == 0 else "down"
            response = await client.post("/v1/feedback", json={"turn_id": turn_id, "thumbs": thumbs})
            assert response.status_code == 201, response.text
        last_judged = time.perf_counter()
        deadline = last_judged + 600
        while time.perf_counter() < deadline:
            answer = (await chat(client, "Add one more item")).json()
            if answer.get("system_fingerprint"):
                return {"p3_adapter_latency_s": time.perf_counter() - last_judged}
        raise TimeoutError("no adapter went live within 600 s of the batch's last judged turn")


# ----------------------------------------------------------------------------- p4, p5: the agent loop and memory


def lesson_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    cities = ["Lisbon", "Tokyo", "Sydney", "Cairo", "Oslo", "Lima", "Seoul", "Quito", "Accra", "Hanoi"]
    lists = ["errands", "groceries", "work", "home", "garden", "travel", "books", "gifts"]
    return [f"Request {i}: {rng.choice(['time', 'weather', 'todo', 'note'])} for {rng.choice(cities)} "
            f"goes on {rng.choice(lists)} list {rng.randrange(10_000)}" for i in range(n)]  # fmt: skip


async def p4_loop_overhead(work: Path, model: Path, sizes: Sizes) -> dict[str, float]:
    """The whole request (HTTP, agent, store, lesson retrieval over ``overhead_lessons``) minus the backend call."""
    backend = ScriptedBackend(lambda messages, tools: "ok")
    # the lessons go into the index alone (a store of 100k lessons takes as many commits to fill), so the
    # follower's store poll, which drops indexed lessons the store does not have, is kept from running
    async with whet_app(work / "p4", backend, model, learner={"poll_s": 86400}) as (client, res):
        texts = lesson_texts(sizes.overhead_lessons)
        await asyncio.to_thread(res.index.add_many, [(i + 1, USER, t) for i, t in enumerate(texts)])
        messages = [{"role": "user", "content": "What time is it at home?"}]
        raw, whole = [], []
        for _ in range(3):  # warm-up
            await chat(client, messages[0]["content"])
        for _ in range(sizes.overhead_requests):
            started = time.perf_counter()
            await backend.generate(messages, [], SamplingParams(max_new_tokens=8))
            raw.append(time.perf_counter() - started)
            started = time.perf_counter()
            response = await chat(client, messages[0]["content"])
            whole.append(time.perf_counter() - started)
            assert response.status_code == 200, response.text
    figures = {
        "p4_overhead_ms_p50": (statistics.median(whole) - statistics.median(raw)) * 1000,
        "p4_lessons": sizes.overhead_lessons,
    }
    # the loop above embeds the request with the hashing embedder; the default (MiniLM, when installed)
    # runs a 6-layer sentence model on it instead, once per request: its cost, on its own
    if minilm_available():
        embedder = await asyncio.to_thread(open_embedder, "minilm")
        times = []
        for _ in range(sizes.repeats + 3):
            started = time.perf_counter()
            await asyncio.to_thread(embedder.embed, [messages[0]["content"]])
            times.append(time.perf_counter() - started)
        figures["p4_minilm_query_ms_p50"] = statistics.median(times[3:]) * 1000
    return figures


def p5_search(sizes: Sizes) -> dict[str, float]:
    """Lesson retrieval over ``search_lessons`` (spread over users) against exact search of the same vectors."""
    embedder = HashingEmbedder()
    index = LessonIndex(embedder)
    texts = lesson_texts(sizes.search_lessons, seed=1)
    owners = [f"user-{i % sizes.search_users}" for i in range(len(texts))]
    chunk = 50_000
    for start in range(0, len(texts), chunk):
        index.add_many((i + 1, owners[i], texts[i]) for i in range(start, min(start + chunk, len(texts))))
    queries = lesson_texts(sizes.repeats, seed=2)
    user_ids = np.arange(0, len(texts), sizes.search_users)  # [n / users] positions of user-0's lessons
    vectors = embedder.embed([texts[i] for i in user_ids])  # [n / users, dim]
    times, recall = [], []
    for query in queries:
        started = time.perf_counter()
        hits = index.search("user-0", query, 5)
        times.append(time.perf_counter() - started)
        scores = vectors @ embedder.embed([query])[0]  # [n / users]
        # a hit counts when it is as similar as exact search's 5th best: the bench's lessons come from
        # templates, and a lesson tied with the 5th (same similarity) is as right an answer as it
        fifth = np.sort(scores)[-5]
        rows = [(h.lesson_id - 1) // sizes.search_users for h in hits]  # user-0's lesson ids are 1, 1 + users, ...
        recall.append(sum(scores[j] >= fifth - 1e-6 for j in rows) / 5)
    return {"p5_search_ms_p50": statistics.median(times) * 1000, "p5_recall_at_5": statistics.fmean(recall),
            "p5_lessons": sizes.search_lessons}  # fmt: skip


# ----------------------------------------------------------------------------- p6, p7: store and bus


async def p6_store_writes(url: str, sizes: Sizes) -> float:
    """Turns written one after another (each its own commit), per second."""
    store = await asyncio.to_thread(open_store, url)
    try:
        session = await store.create_session(USER)
        turn = {"session_id": session.id, "user_id": USER, "step": 0, "model": "bench",
                "prompt_messages": [{"role": "user", "content": "What time is it at home?"}],
                "prompt_token_ids": list(range(64)), "response_text": "It is 10:00.",
                "response_token_ids": list(range(16)), "response_logprobs": [-0.5] * 16}  # fmt: skip
        started = time.perf_counter()
        for i in range(sizes.store_turns):
            await store.add_turn(TurnCreate(request_id=f"req-{i}", **turn))
        return sizes.store_turns / (time.perf_counter() - started)
    finally:
        await store.aclose()


async def p7_mqtt(url: str, sizes: Sizes) -> dict[str, float]:
    """Events through Mosquitto: a burst of ``mqtt_events`` for throughput, then one event at a time
    (publish, wait until the subscriber has it) for latency."""
    prefix = f"{url.rstrip('/')}/whet-bench-{uuid.uuid4().hex[:8]}"
    publisher, subscriber = open_bus(prefix, f"bench-pub-{uuid.uuid4().hex[:6]}"), open_bus(prefix, None)
    await publisher.start()
    await subscriber.start()
    try:
        async with subscriber.subscribe("bench.event") as events, asyncio.timeout(300):
            incoming = aiter(events)

            async def until(i: int) -> None:
                while (await anext(incoming)).data["i"] != i:
                    pass

            await _subscribed(publisher, until)
            started = time.perf_counter()
            for i in range(sizes.mqtt_events):
                await publisher.publish("bench.event", {"i": i})
            await until(sizes.mqtt_events - 1)
            burst = time.perf_counter() - started
            latencies = []
            for i in range(sizes.mqtt_events, sizes.mqtt_events + min(sizes.mqtt_events, 500)):
                sent = time.perf_counter()
                await publisher.publish("bench.event", {"i": i})
                await until(i)
                latencies.append(time.perf_counter() - sent)
    finally:
        await publisher.aclose()
        await subscriber.aclose()
    return {
        "p7_mqtt_events_per_s": sizes.mqtt_events / burst,
        "p7_mqtt_latency_ms_p50": statistics.median(latencies) * 1000,
        "p7_mqtt_latency_ms_p99": percentile(latencies, 99) * 1000,
    }


async def _subscribed(publisher: Any, until: Any) -> None:
    """Return once the subscription is live: a marker event published until one comes back."""
    while True:
        await publisher.publish("bench.event", {"i": -1})
        try:
            await asyncio.wait_for(until(-1), timeout=1.0)
            return
        except TimeoutError:
            continue


def temporary_dir() -> Path:
    """A scratch folder, removed when the process exits (the suite runs these figures on every run)."""
    path = Path(tempfile.mkdtemp(prefix="whet-perf-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def lora_adapter(model: Path, out: Path) -> Path:
    """A saved LoRA adapter for ``model`` (as the learner writes one), for swapping in p1."""
    from whet.learner.objective import build_objective
    from whet.learner.trainer import LoraTrainer

    trainer = LoraTrainer.load(str(model), LoraConfig(), build_objective("rl"), device="cpu")
    trainer.save(out)
    return out


@asynccontextmanager
async def postgres_schema(url: str) -> AsyncIterator[str]:
    """A throwaway schema in the database at ``url``, dropped afterwards."""
    from sqlalchemy import create_engine, text

    schema = f"whet_bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(url)
    try:
        with admin.begin() as connection:
            connection.execute(text(f'CREATE SCHEMA "{schema}"'))
        yield f"{url}?options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


# the figure groups ``--skip`` can leave out, and the figures each one gives
GROUPS = {
    "p1": ("p1_failed_requests", "p1_p99_ratio"),
    "p2": ("p2_lesson_latency_ms",),
    "p3": ("p3_adapter_latency_s",),
    "p4": ("p4_overhead_ms_p50",),
    "p5": ("p5_search_ms_p50", "p5_recall_at_5"),
    "p6": ("p6_sqlite_turns_per_s", "p6_postgres_turns_per_s"),
    "p7": ("p7_mqtt_events_per_s", "p7_mqtt_latency_ms_p50"),
    "train": ("train_tokens_per_s", "serving_latency_ratio_while_training"),
}

HEADLINE = ("p1_failed_requests", "p1_p99_ratio", "p2_lesson_latency_ms", "p3_adapter_latency_s", "p4_overhead_ms_p50",
            "p5_search_ms_p50", "p5_recall_at_5", "p6_sqlite_turns_per_s", "p6_postgres_turns_per_s",
            "p7_mqtt_events_per_s", "p7_mqtt_latency_ms_p50", "train_tokens_per_s",
            "serving_latency_ratio_while_training")  # fmt: skip


def reachable(url: str) -> str | None:
    """None when the service at ``url`` accepts a connection, else why not."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url.replace("postgresql+psycopg://", "postgresql://", 1))
    host, port = parts.hostname or "127.0.0.1", parts.port or {"postgresql": 5432}.get(parts.scheme, 1883)
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return None
    except OSError as exc:
        return f"{host}:{port} is not reachable ({exc.strerror or exc})"


async def measure_service(model: Path, device: str, dtype: str, sizes: Sizes, postgres: str, mqtt: str,
                          skip: tuple[str, ...] = ()) -> tuple[dict[str, float], dict[str, str]]:  # fmt: skip
    """Every service figure (and its details), and the figures left out with the reason.

    ``skip`` names groups of :data:`GROUPS` not to measure (p4-p7 do not depend on the model or the
    device, so a second run on another model or device may leave them out)."""
    from serving_during_training import measure as training_figures

    from whet.runtime.hf import TransformersBackend

    work = temporary_dir()
    figures: dict[str, float] = {}
    unavailable: dict[str, str] = {}

    def engine() -> TransformersBackend:  # each app closes its backend on the way out
        return TransformersBackend(str(model), device=device, dtype=dtype, workers=sizes.concurrency)

    unavailable |= {name: f"skipped (--skip {group})" for group in skip for name in GROUPS[group]}
    if "p1" not in skip:
        adapter = await asyncio.to_thread(lora_adapter, model, work / "adapter")
        figures |= await p1_swaps_under_load(work, engine(), model, adapter, sizes)
    if "p2" not in skip:
        figures |= await p2_lesson_latency(work, model, sizes)
    if "p3" not in skip:
        figures |= await p3_adapter_latency(work, engine(), model, sizes, device, dtype)
    if "p4" not in skip:
        figures |= await p4_loop_overhead(work, model, sizes)
    if "p5" not in skip:
        figures |= await asyncio.to_thread(p5_search, sizes)
    if "p6" not in skip:
        figures["p6_sqlite_turns_per_s"] = await p6_store_writes(f"sqlite:///{work / 'p6.db'}", sizes)
        if (why := reachable(postgres)) is None:
            async with postgres_schema(postgres) as url:
                figures["p6_postgres_turns_per_s"] = await p6_store_writes(url, sizes)
        else:
            unavailable["p6_postgres_turns_per_s"] = f"PostgreSQL {why}"
    if "p7" not in skip:
        if (why := reachable(mqtt)) is None:
            figures |= await p7_mqtt(mqtt, sizes)
        else:
            unavailable |= {name: f"Mosquitto {why}" for name in GROUPS["p7"]}
    if "train" not in skip:
        figures |= await training_figures(model, sizes.train_requests, sizes.train_batch, device=device, dtype=dtype)
    return figures, unavailable
