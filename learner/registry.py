"""The adapter registry: version names, folders, promotion, rollback and the publish event.

Versions are named ``global-0007`` or ``user-<id>-0003`` and live on disk under
``<data>/adapters/<scope>/<version>/`` (``<scope>`` is ``global`` or
``user/<id>``) in peft's safetensors format. Every change of what is live is
written to the store first and then announced on the bus, so the learner's own
decisions and a person's (``whet adapters promote|rollback``) reach the serving
replicas the same way.
"""

from __future__ import annotations

import re
from pathlib import Path

from whet.memory.bus import ADAPTER_PUBLISHED, Bus
from whet.memory.store import Store
from whet.memory.tables import Adapter


def scope_key(scope: str, user_id: str | None) -> str:
    """The lineage a version belongs to: ``global`` or ``user-<id>``."""
    return "global" if scope == "global" else f"user-{_safe(user_id or '')}"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text) or "_"


class AdapterRegistry:
    def __init__(self, store: Store, bus: Bus, root: Path) -> None:
        self.store = store
        self.bus = bus
        self.root = Path(root).expanduser()

    def folder(self, scope: str, user_id: str | None) -> Path:
        """Where a lineage's versions are kept."""
        return self.root / "global" if scope == "global" else self.root / "user" / _safe(user_id or "")

    async def next_version(self, scope: str, user_id: str | None) -> str:
        """A version id not used in the store nor on disk."""
        key = scope_key(scope, user_id)
        taken = {a.id for a in await self.store.list_adapters(scope=scope, user_id=user_id)}
        folder = self.folder(scope, user_id)
        if folder.is_dir():
            taken |= {p.name.lstrip(".").split(".")[0] for p in folder.iterdir()}
        numbers = [int(v.rsplit("-", 1)[1]) for v in taken if v.startswith(key + "-") and v.rsplit("-", 1)[1].isdigit()]
        return f"{key}-{max(numbers, default=0) + 1:04d}"

    async def publish(self, scope: str, user_id: str | None, adapter_id: str | None) -> None:
        """Announce what a scope now serves (None: the base weights)."""
        await self.bus.publish(ADAPTER_PUBLISHED, {"adapter_id": adapter_id, "scope": scope, "user_id": user_id})

    async def promote(self, adapter_id: str, **metrics: object) -> Adapter:
        """Make a version live for its scope and announce it."""
        live, _ = await self.store.promote_adapter(adapter_id, **metrics)
        await self.publish(live.scope, live.user_id, live.id)
        return live

    async def rollback(self, scope: str, user_id: str | None, reason: str) -> tuple[Adapter, Adapter | None]:
        """Retire the live version of a scope, bring its parent back, announce it."""
        rolled, live = await self.store.rollback_adapter(scope, user_id, reason)
        await self.publish(scope, user_id, live.id if live else None)
        return rolled, live
