"""Prometheus metrics, one registry per app (built by the factory, never global)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from whet.runtime.policy import Generation


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "whet_chat_seconds", "Chat completion latency (whole agent loop)", registry=self.registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.turns = Counter("whet_turns", "Model actions recorded", ["policy_version"], registry=self.registry)
        self.tokens = Counter("whet_tokens", "Tokens by kind", ["kind"], registry=self.registry)
        self.tool_calls = Counter(
            "whet_tool_calls", "MCP tool calls by server and outcome", ["server", "outcome"], registry=self.registry
        )
        self.feedback = Counter("whet_feedback", "Feedback received", registry=self.registry)
        self.tools_available = Gauge("whet_tools_available", "MCP tools currently listed", registry=self.registry)

    def turn_recorded(self, generation: Generation) -> None:
        self.turns.labels(generation.adapter or "base").inc()
        self.tokens.labels("prompt").inc(len(generation.prompt_token_ids))
        self.tokens.labels("completion").inc(len(generation.token_ids))

    def tool_called(self, server: str, is_error: bool) -> None:
        self.tool_calls.labels(server, "error" if is_error else "ok").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
