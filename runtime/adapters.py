"""Which adapter is live for whom, and loading it into the backend.

The router answers ``current(user_id)`` at request start; the agent pins that
answer for the whole request. Versions are loaded into the backend under
their own name, so a new version can go live beside the old one.
"""

from __future__ import annotations

import structlog

from whet.config.settings import LearnerConfig
from whet.memory.store import Store
from whet.runtime.policy import PolicyBackend

log = structlog.get_logger()


class AdapterRouter:
    def __init__(self, backend: PolicyBackend, store: Store, config: LearnerConfig) -> None:
        self.backend = backend
        self.store = store
        self.config = config
        self._live: dict[str | None, str] = {}  # user id (None = global) -> adapter version

    def current(self, user_id: str) -> str | None:
        if self.config.scope == "user" and user_id in self._live:
            return self._live[user_id]
        return self._live.get(None)

    def live_version(self) -> str | None:
        return self._live.get(None)

    async def restore(self) -> None:
        """Load the adapters the store says are live (after a restart)."""
        for adapter in await self.store.list_adapters():
            if adapter.status == "live":
                await self.activate(adapter.id, adapter.path, adapter.user_id if adapter.scope == "user" else None)

    async def activate(self, version: str, path: str, user_id: str | None = None) -> None:
        if version not in self.backend.adapters():
            await self.backend.load_adapter(version, path)
        self._live[user_id] = version
        log.info("adapter live", version=version, user=user_id or "*")
