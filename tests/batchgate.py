"""Test-only: start requests so that the transformers backend's engine decodes them in one batch."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def decoded_together(backend: Any, requests: list[Awaitable[Any]]) -> list[Any]:
    """Await ``requests`` after holding the engine's forward passes until every one is submitted,
    so it admits them all before its next decode step (they share every pass until they stop)."""
    engine, loop = backend._engine, asyncio.get_running_loop()
    expected = engine.submitted + len(requests)
    gate = backend._lock.write()  # forward passes wait for it, as for an adapter load
    gate.__enter__()
    try:
        tasks = [asyncio.ensure_future(r) for r in requests]
        deadline = loop.time() + 20
        while engine.submitted < expected and loop.time() < deadline and not any(t.done() for t in tasks):
            await asyncio.sleep(0.005)
        assert engine.submitted == expected, "the requests never reached the engine"
    finally:
        gate.__exit__(None, None, None)
    return list(await asyncio.gather(*tasks))
