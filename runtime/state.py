"""The service's resources, opened together in one lifespan.

Everything with a life (store engine, bus connection, MCP sessions, the model)
is entered in one ``AsyncExitStack`` and exposed as one typed object. Tests
hand in twins (a ScriptedBackend, an in-memory tool pool) through the same
factory instead of patching globals.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog

from whet.config.mcp import load_mcp_servers
from whet.config.settings import WhetConfig
from whet.learner.learner import Learner, open_learner
from whet.learner.lesson_check import Generate
from whet.memory.bus import Bus, open_bus
from whet.memory.experience import Experience
from whet.memory.index import Embedder, LessonIndex, open_embedder
from whet.memory.store import Store, open_store
from whet.runtime.adapters import AdapterRouter
from whet.runtime.agent import Agent
from whet.runtime.approvals import ApprovalPolicy
from whet.runtime.backends import create_backend
from whet.runtime.follower import Follower
from whet.runtime.metrics import Metrics
from whet.runtime.policy import BackendChat, PolicyBackend, SamplingParams
from whet.runtime.tools import ToolPool

log = structlog.get_logger()


@dataclass
class Resources:
    config: WhetConfig
    store: Store
    bus: Bus
    experience: Experience
    index: LessonIndex
    backend: PolicyBackend
    tools: ToolPool
    adapters: AdapterRouter
    agent: Agent
    metrics: Metrics
    follower: Follower
    learner: Learner | None = None  # None: no learner in this process (disabled, or `whet learn` elsewhere)
    started_at: float = field(default_factory=time.time)

    @property
    def model_name(self) -> str:
        return self.config.model.name


@asynccontextmanager
async def _background(name: str, run: Callable[[], Awaitable[None]]) -> AsyncIterator[asyncio.Task[None]]:
    """A task that lives as long as the context; cancelled (and awaited) when it exits."""
    task = asyncio.create_task(run(), name=name)
    task.add_done_callback(
        lambda t: t.cancelled() or t.exception() is None or log.error("background task died", task=name,
                                                                      error=repr(t.exception()))  # fmt: skip
    )
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def served_greedy(backend: PolicyBackend, adapters: AdapterRouter) -> Generate:
    """The served model's greedy reply, under the version live for the user now (the lesson check's model)."""

    async def generate(user_id: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       max_tokens: int) -> str:  # fmt: skip
        with adapters.lease(user_id) as version:
            params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0)
            return (await backend.generate(messages, tools or [], params, adapter=version)).text

    return generate


def mcp_variables(config: WhetConfig) -> dict[str, str]:
    """What ``${VAR}`` in an mcpServers file may name: the environment plus whet's own."""
    return {**os.environ, "WHET_PYTHON": sys.executable, "WHET_DATA_DIR": str(config.data_path)}


def configured_tool_pool(config: WhetConfig) -> ToolPool:
    """The pool for the configured mcpServers file (raises ConfigError for a bad file)."""
    specs = load_mcp_servers(config.mcp_config_path(), mcp_variables(config))
    return ToolPool(
        specs,
        call_timeout=config.mcp.call_timeout,
        max_result_chars=config.mcp.max_result_chars,
        start_timeout=config.mcp.start_timeout,
        restart_backoff_max=config.mcp.restart_backoff_max,
        start_wait=config.mcp.start_wait,
    )


@asynccontextmanager
async def open_resources(
    config: WhetConfig,
    *,
    backend: PolicyBackend | None = None,
    tools: ToolPool | None = None,
    embedder: Embedder | None = None,
) -> AsyncIterator[Resources]:
    async with AsyncExitStack() as stack:
        config.data_path.mkdir(parents=True, exist_ok=True)
        # first, so servers start while the rest opens; never waited on here, so the port opens
        # at once and /health shows each server starting (a chat waits for them: ToolPool.settle)
        tools = tools or configured_tool_pool(config)
        await tools.start(wait=False)
        stack.push_async_callback(tools.aclose)
        store = await anyio.to_thread.run_sync(open_store, config.store_url, config.store.sqlite_sync)
        stack.push_async_callback(store.aclose)
        bus = open_bus(config.bus.url, config.bus.client_id)
        await bus.start()
        stack.push_async_callback(bus.aclose)
        index = LessonIndex(embedder or await anyio.to_thread.run_sync(open_embedder, config.memory.embedder))
        lessons = await store.list_lessons()
        await anyio.to_thread.run_sync(index.rebuild, lessons)
        if backend is None:
            backend = await anyio.to_thread.run_sync(create_backend, config.model, config.data_path)
        stack.push_async_callback(backend.aclose)
        adapters = AdapterRouter(backend, store, config.learner)
        stack.push_async_callback(adapters.aclose)  # pending unloads finish before the backend closes
        # entering reconciles adapters with the store (what a restart needs), then follows bus and store
        cursor = max((lesson.id or 0 for lesson in lessons), default=0)
        follower = await stack.enter_async_context(
            Follower(store, bus, adapters, index, config.learner.poll_s, lesson_cursor=cursor)
        )
        learner: Learner | None = None
        if config.learner.enabled:  # the default deployment: the learner alongside, in the background
            learner = open_learner(config, store, bus, chat=BackendChat(backend), index=index,
                                   generate=served_greedy(backend, adapters))  # fmt: skip
            await stack.enter_async_context(_background("whet-learner", learner.run))
        metrics = Metrics()
        experience = Experience(store, bus)
        agent = Agent(backend, tools, experience, index, config.agent, metrics, adapters=adapters,
                      approvals=ApprovalPolicy.from_config(config.mcp))  # fmt: skip
        log.info(
            "whet ready", model=config.model.name, lessons=len(index), adapter=adapters.live_version(),
            tools=len(tools.tools()), servers=tools.status(),  # "starting" ones are not ready yet: see /health
        )
        yield Resources(
            config=config, store=store, bus=bus, experience=experience, index=index, backend=backend,
            tools=tools, adapters=adapters, agent=agent, metrics=metrics, follower=follower, learner=learner,
        )
