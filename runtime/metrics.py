"""Prometheus metrics, one registry per app (built by the factory, never global).

Counters of what this process did (requests, turns, tool calls) are kept as they happen; what
the whole deployment learned (verdicts, adapter versions, the live version) is read from the
store at scrape time, so every replica reports the same numbers and a learner in another
process (`whet learn`) is counted too.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import Message, Receive, Scope, Send

from whet.runtime.middleware import HttpMiddleware
from whet.runtime.policy import Generation

LATENCY_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "whet_chat_seconds", "Chat completion latency (whole agent loop)", registry=self.registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.requests = Histogram(
            "whet_http_request_seconds", "HTTP request latency by route (streams: until their last byte)",
            ["method", "route", "status"], registry=self.registry, buckets=LATENCY_BUCKETS,
        )
        self.turns = Counter("whet_turns", "Model actions recorded", ["policy_version"], registry=self.registry)
        self.tokens = Counter("whet_tokens", "Tokens by kind", ["kind"], registry=self.registry)
        self.tool_calls = Counter(
            "whet_tool_calls", "MCP tool calls by server, tool and outcome", ["server", "tool", "outcome"],
            registry=self.registry,
        )
        self.feedback = Counter("whet_feedback", "Feedback received", registry=self.registry)
        self.tools_available = Gauge("whet_tools_available", "MCP tools currently listed", registry=self.registry)
        self.tool_server_state = Gauge(
            "whet_tool_server_state", "Each MCP server's state (value 1 on its current state)", ["server", "state"],
            registry=self.registry,
        )
        self.judged = Gauge("whet_judged_turns", "Turns judged, by verdict (store)", ["verdict"], registry=self.registry)
        self.adapter_versions = Gauge(
            "whet_adapter_versions", "Adapter versions by status (store); each is one training step's result",
            ["status"], registry=self.registry,
        )
        self.training_steps = Gauge(
            "whet_training_steps", "Optimizer steps taken by the learner in this process", registry=self.registry
        )
        self.live_adapter = Gauge(
            "whet_live_adapter_info", "The global live adapter version (value 1; base = base weights)", ["version"],
            registry=self.registry,
        )

    def turn_recorded(self, generation: Generation) -> None:
        self.turns.labels(generation.adapter or "base").inc()
        self.tokens.labels("prompt").inc(len(generation.prompt_token_ids))
        self.tokens.labels("completion").inc(len(generation.token_ids))

    def tool_called(self, server: str, is_error: bool, tool: str = "unknown") -> None:
        self.tool_calls.labels(server, tool, "error" if is_error else "ok").inc()

    def tool_servers(self, states: dict[str, str]) -> None:
        """Set the server state gauge from ``ToolPool.status()``: one series per server, on its state."""
        self.tool_server_state.clear()
        for server, state in states.items():
            self.tool_server_state.labels(server, state).set(1)

    def learning(self, counts: dict[str, dict[str, int]], live_version: str | None, steps: int | None) -> None:
        """Set the learning gauges from the store's counts (``Store.learning_counts``)."""
        for verdict in ("-1", "0", "+1"):
            self.judged.labels(verdict).set(counts["verdicts"].get(verdict, 0))
        self.adapter_versions.clear()
        for status, n in counts["adapters"].items():
            self.adapter_versions.labels(status).set(n)
        self.live_adapter.clear()
        self.live_adapter.labels(live_version or "base").set(1)
        if steps is not None:
            self.training_steps.set(steps)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer(HttpMiddleware):
    """Pure ASGI middleware: every HTTP request's latency, labelled by its route template."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started, status = time.perf_counter(), 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            metrics = _metrics(scope)
            if metrics is not None:
                route = getattr(scope.get("route"), "path", None) or "unmatched"
                metrics.requests.labels(scope["method"], route, str(status)).observe(time.perf_counter() - started)


def _metrics(scope: Scope) -> Metrics | None:
    app: Any = scope.get("app")
    resources = getattr(getattr(app, "state", None), "resources", None)
    return getattr(resources, "metrics", None)
