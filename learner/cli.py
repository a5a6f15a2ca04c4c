"""``whet learn`` and ``whet adapters``: the learner's commands, without the web stack.

They open the configured store and bus themselves, so they work beside a running
server (or on another machine): what they change reaches the server as bus events
and, with an in-process bus, through the server's periodic store check.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from whet.config.settings import WhetConfig
from whet.learner.learner import TRAINER_STATE, Learner, open_learner
from whet.learner.registry import AdapterRegistry
from whet.memory.bus import Bus, open_bus
from whet.memory.store import Store, open_store


@asynccontextmanager
async def _opened(config: WhetConfig, role: str) -> AsyncIterator[tuple[Store, Bus]]:
    store = await anyio.to_thread.run_sync(open_store, config.store_url, config.store.sqlite_sync)
    bus = open_bus(config.bus.url, config.bus.client_id or f"whet-{role}-{os.getpid()}")
    try:
        await bus.start()
        yield store, bus
    finally:
        await bus.aclose()
        await store.aclose()


# ----------------------------------------------------------------------------- whet learn


def learn(config: WhetConfig, *, once: bool) -> int:
    """Run the learner until interrupted (``once``: judge and train what is waiting, then exit)."""

    async def main() -> None:
        async with _opened(config, "learn") as (store, bus):
            learner = open_learner(config, store, bus)
            with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                          console=Console(stderr=True), transient=once) as progress:  # fmt: skip
                task = progress.add_task("starting", total=None)
                if once:
                    await _learn_once(learner, lambda: progress.update(task, description=_summary(learner)))
                else:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(learner.run)
                        while True:
                            progress.update(task, description=_summary(learner))
                            await anyio.sleep(0.5)
            print(_summary(learner))

    anyio.run(main)
    return 0


async def _learn_once(learner: Learner, show: Callable[[], None]) -> None:
    await learner.recover()
    show()
    await learner.catch_up()
    show()
    while await learner.train_ready(force=True):
        show()


def _summary(learner: Learner) -> str:
    p = learner.progress
    text = f"judged {p.judged} · lessons {p.lessons} · steps {p.steps} ({len(p.promoted)} promoted, {len(p.rejected)} rejected)"
    if p.last_step:
        text += f" · last {p.last_step['version']}: {p.last_step['reason']}"
    return text


# ----------------------------------------------------------------------------- whet adapters


def adapters(config: WhetConfig, action: str, version: str | None = None, user: str | None = None,
             as_json: bool = False) -> int:  # fmt: skip
    """``list``, ``show VERSION``, ``promote VERSION``, ``rollback [--user U]``. Exit 1 with a reason on failure."""

    async def main() -> int:
        async with _opened(config, "adapters") as (store, bus):
            registry = AdapterRegistry(store, bus, config.data_path / "adapters")
            if action == "list":
                rows = await store.list_adapters()
                _print_list(rows, as_json)
                return 0
            if action == "rollback":
                scope = config.learner.scope
                if scope == "user" and not user:
                    return _fail("learner.scope is user: name whose adapter to roll back with --user USER")
                try:
                    rolled, live = await registry.rollback(scope, user if scope == "user" else None, "rolled back by hand")
                except LookupError as exc:
                    return _fail(f"{exc}; nothing to roll back")
                print(f"rolled back {rolled.id}; now serving {live.id if live else 'the base weights'}")
                return 0
            row = await store.get_adapter(version or "")
            if row is None:
                return _fail(f"no adapter version {version!r}; `whet adapters list` shows them")
            if action == "show":
                print(json.dumps(_details(row), indent=2, default=str))
                return 0
            live = await registry.promote(row.id, promoted_by="cli")
            print(f"{live.id} is live for {live.scope}{f' user {live.user_id}' if live.user_id else ''}")
            return 0

    return anyio.run(main)


def _fail(message: str) -> int:
    print(f"whet: {message}", file=sys.stderr)
    return 1


def _details(row: Any) -> dict[str, Any]:
    out = row.model_dump()
    state = Path(row.path) / TRAINER_STATE
    if state.is_file():
        saved = json.loads(state.read_text())
        out["trained_on"] = saved.get("batch", [])
        out["baseline"] = saved.get("baseline")
    return out


def _print_list(rows: list[Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps([_details(r) for r in rows], indent=2, default=str))
        return
    table = Table(title=f"{len(rows)} adapter versions")
    for column in ("version", "scope", "status", "parent", "batch", "gate", "created"):
        table.add_column(column)
    for r in rows:
        gate = r.metrics.get("gate", {})
        margin = gate.get("preference_margin")
        verdict = ("" if not gate else ("accepted" if gate.get("accepted") else "rejected")) + (
            f" {margin:+.3f}" if isinstance(margin, float) else ""
        )
        scope = r.scope if r.scope == "global" else f"user {r.user_id}"
        table.add_row(r.id, scope, r.status, r.parent or "-", str(r.metrics.get("batch_size", "")), verdict,
                      r.created_at.strftime("%Y-%m-%d %H:%M:%S"))  # fmt: skip
    Console().print(table)
