"""Hot-swapping adapters while serving: the real engine on a tiny model, the app in-process.

What the learner does is played by hand: write an adapter row, promote it in the
store, announce it on the app's bus. The follower applies it; requests in flight
finish on the version they pinned; every turn is stamped with the version that
produced it, checked token for token against a separate reference engine.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from perturbed import perturbed_adapter
from test_api import make_config

from whet.memory.bus import ADAPTER_PUBLISHED, LESSON_ADDED
from whet.memory.index import HashingEmbedder
from whet.memory.store import open_store
from whet.memory.tables import Adapter
from whet.runtime.app import create_app
from whet.runtime.policy import SamplingParams
from whet.runtime.scripted import ScriptedBackend
from whet.runtime.tools import ToolPool

pytestmark = pytest.mark.anyio

PROMPTS = ("hello there", "what time is it", "tell me a story about boats")
MAX_TOKENS = 6
GREEDY = SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.0)
VERSIONS = ("v1", "v2", "v3")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from whet.learner.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model, tmp_path_factory) -> dict[str, Path]:
    """One LoRA folder per version, each with its own random B weights, so each changes outputs its own way."""
    root = tmp_path_factory.mktemp("adapters")
    dirs = {}
    for seed, version in enumerate(VERSIONS, start=1):
        dirs[version] = perturbed_adapter(tiny_model, root / version, seed)
    return dirs


def engine(tiny_model: Path):
    from whet.runtime.hf import TransformersBackend

    return TransformersBackend(str(tiny_model), model_name="tiny", workers=2, device="cpu")


def in_model(engine) -> list[str]:
    """The versions whose weights the engine's model really holds (``adapters()`` drops a name before
    freeing it): its peft adapters, less the retired ones kept for reuse (at most KEEP_FREE), by
    version name. A peft adapter that is neither a version's nor kept is a leak (KeyError)."""
    from whet.runtime.hf import KEEP_FREE

    held = {name for module in engine.model.modules() for name in getattr(module, "lora_A", {})}
    assert set(engine._free) <= held and len(engine._free) <= KEEP_FREE
    by_slot = {slot: version for version, slot in engine._slot_of.items()}
    return sorted(by_slot[name] for name in held - set(engine._free))


@asynccontextmanager
async def serve(tmp_path: Path, backend, **overrides: Any) -> AsyncIterator[tuple[Any, httpx.AsyncClient, Any]]:
    """The app on ``backend`` with no tools (shorter prompts), and what the store held before it started."""
    config = make_config(tmp_path, model={"id": "tiny", "max_new_tokens": 16}, **overrides)
    tools = ToolPool([], in_memory={})
    app = create_app(config, backend=backend, tools=tools, embedder=HashingEmbedder())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://whet") as client:
            yield app, client, app.state.resources


async def seed_store(tmp_path: Path, *rows: tuple[str, Path]) -> None:
    """Promote versions in the store before the app starts (a server restarting after a learner ran)."""
    store = open_store(make_config(tmp_path).store_url)
    try:
        for version, path in rows:
            await store.add_adapter(Adapter(id=version, path=str(path)))
            await store.promote_adapter(version)
    finally:
        await store.aclose()


async def publish(res, version: str, path: Path | str, user_id: str | None = None, announce: bool = True) -> None:
    """What the learner does: register the version, promote it, then (store first) announce it."""
    scope = "user" if user_id else "global"
    await res.store.add_adapter(Adapter(id=version, scope=scope, user_id=user_id, path=str(path)))
    await res.store.promote_adapter(version)
    if announce:
        await res.bus.publish(ADAPTER_PUBLISHED, {"adapter_id": version, "scope": scope, "user_id": user_id})


async def serving(res, version: str | None, user: str = "u") -> None:
    with anyio.fail_after(10):
        await res.follower.wait_until(lambda: res.adapters.current(user) == version)


async def chat(client: httpx.AsyncClient, prompt: str, *, stream: bool = False, user: str = "u") -> str:
    """One greedy chat request that must succeed; returns its request id."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "user": user,
            "temperature": 0, "max_tokens": MAX_TOKENS, "stream": stream}  # fmt: skip
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        assert not [c for c in map(json.loads, lines[:-1]) if "error" in c], response.text
    return response.headers["x-whet-request"]


async def versions_of(res, request_id: str) -> set[str | None]:
    return {turn.policy_version for turn in await res.store.request_turns(request_id)}


async def assert_produced_by_their_version(reference, res, request_ids: list[str]) -> None:
    """Each turn's tokens are exactly what its stamped version generates greedily for its prompt."""
    for request_id in request_ids:
        turns = await res.store.request_turns(request_id)
        assert turns and len({t.policy_version for t in turns}) == 1  # one request, one pinned version
        for turn in turns:
            assert turn.tool_names == []
            expected = await reference.generate(turn.prompt_messages, [], GREEDY, adapter=turn.policy_version)
            assert turn.prompt_token_ids == expected.prompt_token_ids
            assert turn.response_token_ids == expected.token_ids, (request_id, turn.policy_version)


@asynccontextmanager
async def reference_engine(tiny_model: Path, adapter_dirs: dict[str, Path]):
    """A second engine with every version loaded: what each version produces, independent of the app."""
    reference = engine(tiny_model)
    try:
        for version, path in adapter_dirs.items():
            await reference.load_adapter(version, str(path))
        yield reference
    finally:
        await reference.aclose()


class HeldBackend:
    """The real engine, but a request on ``adapter`` waits for ``release`` before its first generation."""

    def __init__(self, inner, adapter: str) -> None:
        self.inner, self.adapter = inner, adapter
        self.waiting, self.release = anyio.Event(), anyio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def stream(self, messages, tools, params, adapter=None):
        if adapter == self.adapter and not self.release.is_set():
            self.waiting.set()
            await self.release.wait()
        async for item in self.inner.stream(messages, tools, params, adapter):
            yield item


async def test_swaps_under_concurrent_requests_fail_none_and_stamp_each_turn_with_the_version_that_made_it(
    tmp_path, tiny_model, adapter_dirs
):
    await seed_store(tmp_path, ("v1", adapter_dirs["v1"]))
    backend = engine(tiny_model)
    request_ids: list[str] = []
    async with serve(tmp_path, backend) as (_, client, res):
        assert res.adapters.current("u") == "v1"  # restored from the store at start, before any event
        first_done = anyio.Event()

        async def one(i: int) -> None:
            request_ids.append(await chat(client, PROMPTS[i % len(PROMPTS)], stream=i % 2 == 0))
            first_done.set()

        async with anyio.create_task_group() as group:
            for i in range(8):
                group.start_soon(one, i)
            with anyio.fail_after(20):
                await first_done.wait()  # some requests done on v1, the rest still in flight
            await publish(res, "v2", adapter_dirs["v2"])
            await serving(res, "v2")
            for i in range(8, 16):
                group.start_soon(one, i)
            await publish(res, "v3", adapter_dirs["v3"])
            await serving(res, "v3")
            for i in range(16, 24):
                group.start_soon(one, i)

        assert len(request_ids) == 24
        seen = set().union(*[await versions_of(res, r) for r in request_ids])
        assert {"v1", "v3"} <= seen <= set(VERSIONS)
        await res.adapters.settle()
        assert backend.adapters() == in_model(backend) == ["v3"]  # the old versions drained and went
        assert all(res.adapters.leases(v) == 0 for v in VERSIONS)
        async with reference_engine(tiny_model, adapter_dirs) as reference:
            # the versions really differ on these prompts, so matching tokens name the version
            probe = (await res.store.request_turns(request_ids[0]))[0].prompt_messages
            outputs = [(await reference.generate(probe, [], GREEDY, adapter=v)).token_ids for v in (None, *VERSIONS)]
            assert len({tuple(o) for o in outputs}) == 4
            await assert_produced_by_their_version(reference, res, request_ids)


async def test_a_request_pinned_before_a_swap_finishes_on_its_version_which_stays_loaded_until_then(
    tmp_path, tiny_model, adapter_dirs
):
    await seed_store(tmp_path, ("v1", adapter_dirs["v1"]))
    inner = engine(tiny_model)
    backend = HeldBackend(inner, "v1")
    async with serve(tmp_path, backend) as (_, client, res):
        old: list[str] = []

        async def old_request() -> None:
            old.append(await chat(client, PROMPTS[0]))

        async with anyio.create_task_group() as group:
            group.start_soon(old_request)
            with anyio.fail_after(10):
                await backend.waiting.wait()  # pinned to v1, not generated anything yet
            assert res.adapters.leases("v1") == 1
            await publish(res, "v2", adapter_dirs["v2"])
            await serving(res, "v2")
            new = await chat(client, PROMPTS[0], stream=True)  # new requests go to v2 meanwhile
            await res.adapters.settle()
            assert inner.adapters() == ["v1", "v2"]  # v1 is leased: not unloaded under the old request
            backend.release.set()

        assert await versions_of(res, old[0]) == {"v1"}
        assert await versions_of(res, new) == {"v2"}
        await res.adapters.settle()
        assert inner.adapters() == in_model(inner) == ["v2"]  # drained, then retired
        async with reference_engine(tiny_model, adapter_dirs) as reference:
            await assert_produced_by_their_version(reference, res, [old[0], new])


async def test_a_client_that_hangs_up_mid_stream_releases_its_lease(tmp_path, tiny_model, adapter_dirs):
    await seed_store(tmp_path, ("v1", adapter_dirs["v1"]))
    inner = engine(tiny_model)
    backend = HeldBackend(inner, "v1")
    async with serve(tmp_path, backend) as (app, _, res):
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
        requests = iter([{"type": "http.request", "body": body, "more_body": False}])
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            message = next(requests, None)
            if message is not None:
                return message
            await backend.waiting.wait()  # the stream has pinned v1 and is generating: hang up now
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
            "query_string": b"", "root_path": "", "server": ("whet", 80), "client": ("127.0.0.1", 5000),
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }  # fmt: skip
        with anyio.fail_after(10):
            await app(scope, receive, send)
        assert sent[0]["status"] == 200
        assert res.adapters.leases("v1") == 0
        await publish(res, "v2", adapter_dirs["v2"])
        await serving(res, "v2")
        await res.adapters.settle()
        assert inner.adapters() == in_model(inner) == ["v2"]
        assert await res.store.list_turns() == []  # the cut request recorded nothing


async def test_rollback_to_base_and_bad_or_unknown_versions_never_stop_serving(tmp_path, tiny_model, adapter_dirs):
    backend = engine(tiny_model)
    async with serve(tmp_path, backend) as (_, client, res):
        assert res.adapters.current("u") is None
        await res.bus.publish(ADAPTER_PUBLISHED, {"adapter_id": "v404", "scope": "global", "user_id": None})
        await publish(res, "v-bad", tmp_path / "no-such-folder")
        with anyio.fail_after(10):
            await res.follower.wait_until(lambda: res.follower.handled == 2)
        assert res.adapters.current("u") is None and backend.adapters() == []  # logged, base keeps serving
        await publish(res, "v1", adapter_dirs["v1"])
        await res.bus.publish(ADAPTER_PUBLISHED, {"adapter_id": "v1", "scope": "global", "user_id": None})
        await serving(res, "v1")  # events are handled in order: the follower survived the bad ones
        assert backend.adapters() == ["v1"]
        on_v1 = await chat(client, PROMPTS[1])

        await res.store.rollback_adapter("global", None, "scores dropped")  # v1 had no parent: base weights
        await res.bus.publish(ADAPTER_PUBLISHED, {"adapter_id": None, "scope": "global", "user_id": None})
        await serving(res, None)
        on_base = await chat(client, PROMPTS[1], stream=True)
        await res.adapters.settle()
        assert backend.adapters() == in_model(backend) == []
        assert await versions_of(res, on_v1) == {"v1"}
        assert await versions_of(res, on_base) == {None}
        assert (await client.get("/health")).json()["adapter"] is None


async def test_the_follower_indexes_an_announced_lesson_once(tmp_path):
    backend = ScriptedBackend(lambda messages, tools: "noted")
    async with serve(tmp_path, backend, learner={"poll_s": 3600}) as (_, client, res):  # only the event can do it
        lesson = await res.store.add_lesson("alice", "When alice says home she means Lisbon time.")
        for _ in range(2):  # the bus may deliver twice
            await res.bus.publish(LESSON_ADDED, {"lesson_id": lesson.id, "user_id": "alice"})
        await res.bus.publish(LESSON_ADDED, {"lesson_id": 9999, "user_id": "alice"})  # forgotten since: ignored
        with anyio.fail_after(10):
            await res.follower.wait_until(lambda: len(res.index) > 0)
        hits = res.index.search("alice", "what time is it at home?", k=5)
        assert [h.lesson_id for h in hits] == [lesson.id] and len(res.index) == 1
        await client.post("/v1/chat/completions", json={
            "model": "tiny", "user": "alice", "messages": [{"role": "user", "content": "time at home?"}]})
    assert "Lisbon time" in backend.calls[0].messages[0]["content"]


async def test_the_poll_brings_adapters_and_lessons_that_no_event_announced(tmp_path, adapter_dirs):
    backend = ScriptedBackend(lambda messages, tools: "ok")
    overrides = {"learner": {"poll_s": 0.05, "scope": "user"}}
    async with serve(tmp_path, backend, **overrides) as (_, client, res):
        await publish(res, "g1", adapter_dirs["v1"], announce=False)
        await publish(res, "alice-1", adapter_dirs["v2"], user_id="alice", announce=False)
        lesson = await res.store.add_lesson("alice", "Alice likes short answers.")
        with anyio.fail_after(10):
            await res.follower.wait_until(
                lambda: res.adapters.current("alice") == "alice-1" and res.adapters.current("bob") == "g1"
                and len(res.index) == 1
            )
        assert res.index.search("alice", "short answers", k=1)[0].lesson_id == lesson.id
        alice = await chat(client, PROMPTS[0], user="alice")
        bob = await chat(client, PROMPTS[0], user="bob")
        assert await versions_of(res, alice) == {"alice-1"} and await versions_of(res, bob) == {"g1"}

        await res.store.rollback_adapter("user", "alice", "test")  # no parent: alice falls back to global
        await serving(res, "g1", user="alice")
        await res.adapters.settle()
        assert backend.adapters() == ["g1"]
