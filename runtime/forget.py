"""Forgetting a user: their rows in the store, lessons in the index, data in the tool servers, adapter files.

One function serves ``whet forget USER`` and ``DELETE /v1/users/{id}``. The store goes first: it
is the source of truth, so from then on nothing of theirs is served, retrieved or put in a training
batch (the learner builds batches from the store). Then the per-user adapter files, the tool
servers (each server's ``whet_forget_user``, called with the user in ``_meta``), and a
``user.forgotten`` event on the bus, on which every serving replica drops the user's lessons from
its index and stops serving their adapter. Every step is idempotent: forgetting again finishes
what an earlier attempt could not. What a *global* adapter already learned from the user stays in
its weights; the README says so.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import structlog

from whet.learner.registry import AdapterRegistry
from whet.memory.bus import USER_FORGOTTEN, Bus
from whet.memory.index import LessonIndex
from whet.memory.store import Store
from whet.runtime.tools import ToolPool

log = structlog.get_logger()


@dataclass
class ForgetReport:
    """What went, and what could not be reached (forget again to finish)."""

    user: str
    store: dict[str, int]
    adapter_files: list[str]
    tools: dict[str, str] = field(default_factory=dict)  # server -> its answer
    failed: dict[str, str] = field(default_factory=dict)  # server -> why it could not forget
    index: int | None = None  # lessons dropped from this process's index (None: no index here)

    @property
    def complete(self) -> bool:
        return not self.failed

    def public(self) -> dict[str, object]:
        return {"user": self.user, "store": self.store, "index": self.index, "adapter_files": self.adapter_files,
                "tools": self.tools, "failed": self.failed, "complete": self.complete}  # fmt: skip


async def forget_user(user_id: str, *, store: Store, bus: Bus, tools: ToolPool, adapters_root: Path,
                      index: LessonIndex | None = None) -> ForgetReport:  # fmt: skip
    """Remove everything of ``user_id`` that whet keeps or reaches; see the module docstring.
    ``index``: this process's lesson index, emptied of the user straight after the store (before
    anything else awaits, so the count is this call's, not the follower's that also reacts)."""
    registry = AdapterRegistry(store, bus, adapters_root)
    own = [Path(row.path) for row in await store.list_adapters(scope="user", user_id=user_id)]
    counts = await store.forget_user(user_id)
    dropped = await anyio.to_thread.run_sync(index.remove_user, user_id) if index is not None else None
    others = {row.user_id for row in await store.list_adapters(scope="user")} - {user_id}
    files = await anyio.to_thread.run_sync(_remove_adapter_files, registry, user_id, own, others)
    report = ForgetReport(user_id, counts, files, index=dropped)
    for server, answer in (await tools.forget_user(user_id)).items():
        if answer.is_error:
            report.failed[server] = answer.content
        else:
            report.tools[server] = answer.content
    await bus.publish(USER_FORGOTTEN, {"user_id": user_id})
    log.info("user.forgotten", user=user_id, store=counts, adapter_files=len(files), tools=sorted(report.tools),
             failed=report.failed)  # fmt: skip
    return report


def _remove_adapter_files(registry: AdapterRegistry, user_id: str, own: list[Path], others: set[str | None]) -> list[str]:
    """Delete the user's adapter folder (candidates and temporaries included), or only their versions'
    folders when another user's id maps to the same folder name."""
    folder = registry.folder("user", user_id)
    shared = any(registry.folder("user", other) == folder for other in others)
    targets = own if shared else [*own, folder]
    removed = []
    for path in targets:
        if path.exists():
            shutil.rmtree(path)
            removed.append(str(path))
    return removed
