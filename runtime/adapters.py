"""Which adapter is live for whom, and swapping versions without refusing a request.

A *key* is who an adapter serves: ``None`` for everyone (global scope) or a
user id (per-user scope, which falls back to the global one). Each version is
loaded into the backend under its own name, so a new version goes live
beside the old one: ``activate`` loads it, then flips the key to it.

A request takes a *lease* at its start: it pins the version live for its user
then, and that version stays loaded until the lease ends, whichever version
is live by then. An old version is unloaded (in a background task) only once
no lease holds it and no key serves it. Backends already make an unload wait
for generations in progress; the lease closes the gap before the first one,
and between the steps of a multi-step request.

The store is the truth: ``apply`` (an ``adapter.published`` event) and
``reconcile`` (a poll) both end with the router serving what the store calls
live, so an event that arrives twice, late or never changes nothing for long.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import structlog

from whet.config.settings import LearnerConfig
from whet.memory.store import Store
from whet.memory.tables import Adapter
from whet.runtime.policy import PolicyBackend

log = structlog.get_logger()

Key = str | None  # None = global, else a user id


class AdapterRouter:
    def __init__(self, backend: PolicyBackend, store: Store, config: LearnerConfig) -> None:
        self.backend = backend
        self.store = store
        self.config = config
        self._live: dict[Key, str] = {}  # key -> the version serving it
        self._loaded: set[str] = set()  # versions this router loaded and has not unloaded yet
        self._leases: Counter[str] = Counter()  # version -> requests holding it
        self._unloading: dict[str, asyncio.Task[None]] = {}
        self._failed: set[str] = set()  # versions whose load failed (logged loudly once)
        self._lock = asyncio.Lock()  # one change at a time: loads are slow, decisions must not interleave
        self._closed = False

    # -- serving --------------------------------------------------------------

    def current(self, user_id: str | None) -> str | None:
        """The version a request by ``user_id`` would get now (None = base weights)."""
        if self.config.scope == "user" and user_id in self._live:
            return self._live[user_id]
        return self._live.get(None)

    def live_version(self) -> str | None:
        """The global version (None = base weights)."""
        return self._live.get(None)

    def leases(self, version: str) -> int:
        """How many requests hold ``version`` now."""
        return self._leases[version]

    @contextmanager
    def lease(self, user_id: str | None) -> Iterator[str | None]:
        """Pin the version live for ``user_id`` now and keep it loaded until the block exits.

        Never waits and never fails: pinning is a dictionary read and a count.
        """
        version = self.current(user_id)
        if version is not None:
            self._leases[version] += 1
        try:
            yield version
        finally:
            if version is not None:
                self._leases[version] -= 1
                if self._leases[version] <= 0:
                    del self._leases[version]
                    self._retire(version)

    # -- changes --------------------------------------------------------------

    async def activate(self, version: str, path: str, user_id: str | None = None) -> bool:
        """Load ``version`` from ``path`` (unless loaded) and make it serve ``user_id``'s key.

        Returns whether it now serves; a load failure is logged and the version
        serving before keeps serving. The replaced version is unloaded once drained.
        """
        async with self._lock:
            return await self._serve(user_id, version, path)

    async def deactivate(self, user_id: str | None = None) -> None:
        """The key serves base weights (a user key: the global version) from now on."""
        async with self._lock:
            self._unserve(user_id)

    async def apply(self, data: Mapping[str, Any]) -> None:
        """Handle an ``adapter.published`` payload ``{adapter_id, scope, user_id}``; idempotent."""
        adapter_id = data.get("adapter_id")
        scope, user_id = data.get("scope", "global"), data.get("user_id")
        async with self._lock:
            if adapter_id is not None:
                row = await self.store.get_adapter(adapter_id)
                if row is None:
                    log.warning("adapter.unknown", adapter=adapter_id, note="published but not in the store; ignored")
                    return
                scope, user_id = row.scope, row.user_id
                if not self._followed(scope):
                    return
                if row.status == "live":
                    await self._serve(_key(row), row.id, row.path)
                    return
            if not self._followed(scope):
                return
            # a rollback to base weights, or a late event whose version was replaced since:
            # either way the store says what this key serves now
            live = await self.store.live_adapter(scope, user_id if scope == "user" else None)
            key = user_id if scope == "user" else None
            if live is None:
                self._unserve(key)
            else:
                await self._serve(key, live.id, live.path)

    async def reconcile(self) -> None:
        """Serve exactly what the store calls live (global, and per user in user scope).

        Used at start and by the follower's poll: when nothing changed it costs
        one or two queries and loads nothing. Also retries unloads that failed.
        """
        async with self._lock:
            wanted = await self._store_live()
            for key, row in wanted.items():
                await self._serve(key, row.id, row.path)
            for key in [k for k in self._live if k not in wanted]:
                self._unserve(key)
            for version in list(self._loaded):
                self._retire(version)

    async def settle(self) -> None:
        """Wait for the unloads scheduled so far (not for leases still held)."""
        while self._unloading:
            await asyncio.wait(list(self._unloading.values()))

    async def aclose(self) -> None:
        """Stop scheduling unloads and wait for those in progress (the backend closes after)."""
        self._closed = True
        await self.settle()

    # -- inside the lock --------------------------------------------------------

    def _followed(self, scope: str) -> bool:
        """Per-user adapters are served only in user scope; otherwise nobody would use them."""
        return scope == "global" or self.config.scope == "user"

    async def _store_live(self) -> dict[Key, Adapter]:
        wanted: dict[Key, Adapter] = {}
        live = await self.store.live_adapter("global")
        if live is not None:
            wanted[None] = live
        if self.config.scope == "user":
            for row in await self.store.list_adapters(scope="user"):
                if row.status == "live" and row.user_id and _newer(row, wanted.get(row.user_id)):
                    wanted[row.user_id] = row
        return wanted

    async def _serve(self, key: Key, version: str, path: str) -> bool:
        if self._live.get(key) == version:
            return True
        pending = self._unloading.get(version)
        if pending is not None:  # brought back while still draining: let the unload finish, then load afresh
            await asyncio.wait([pending])
        if version not in self.backend.adapters():
            try:
                await self.backend.load_adapter(version, path)
            except Exception as exc:  # a bad folder must never take serving down
                loud = version not in self._failed
                self._failed.add(version)
                (log.warning if loud else log.debug)(
                    "adapter.load_failed", version=version, path=path, error=str(exc),
                    serving=self._live.get(key), user=key or "*",
                )  # fmt: skip
                return False
        self._failed.discard(version)
        self._loaded.add(version)
        old, self._live[key] = self._live.get(key), version
        log.info("adapter.live", version=version, replaced=old, user=key or "*")
        if old is not None:
            self._retire(old)
        return True

    def _unserve(self, key: Key) -> None:
        old = self._live.pop(key, None)
        if old is not None:
            log.info("adapter.base", replaced=old, user=key or "*")
            self._retire(old)

    # -- retiring (also called when a lease ends, outside the lock) ----------------

    def _retire(self, version: str) -> None:
        """Unload ``version`` in the background if nothing holds it any more."""
        if (
            self._closed
            or version not in self._loaded
            or version in self._unloading
            or self._leases[version] > 0
            or version in self._live.values()
        ):
            return
        try:
            # a fresh context: the unload belongs to no request, whatever request's lease ended last
            task = asyncio.get_running_loop().create_task(
                self._unload(version), name=f"unload-{version}", context=contextvars.Context()
            )
        except RuntimeError:  # no loop (a request finalised at shutdown): the next reconcile unloads it
            return
        self._unloading[version] = task

    async def _unload(self, version: str) -> None:
        try:
            await self.backend.unload_adapter(version)
            self._loaded.discard(version)
            log.info("adapter.unloaded", version=version)
        except Exception as exc:  # stays in _loaded: the next reconcile tries again
            log.warning("adapter.unload_failed", version=version, error=str(exc))
        finally:
            del self._unloading[version]


def _key(row: Adapter) -> Key:
    return row.user_id if row.scope == "user" else None


def _newer(row: Adapter, other: Adapter | None) -> bool:
    """The store's own order for the live one of a key: latest promoted, then latest created."""
    if other is None:
        return True
    return (row.promoted_at is not None, row.promoted_at or row.created_at, row.created_at) > (
        other.promoted_at is not None, other.promoted_at or other.created_at, other.created_at,
    )
