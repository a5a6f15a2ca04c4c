"""``whet doctor``: check what a deployment needs, and say how to fix what fails.

Each check runs the real thing the service would (load the config, start every MCP server
and list its tools, open the store, round-trip an event over the bus, load the model and
generate one token, write into the data directory) and reports it as a :class:`Check`:
passed or not, what was found, how long it took, and for a failure the fix. A check that
cannot run because an earlier one failed (no config: nothing else) is not reported.
"""

from __future__ import annotations

import shlex
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio

from whet.config.mcp import McpServerSpec, StdioTransport, load_mcp_servers
from whet.config.settings import ConfigError, WhetConfig, load_config

MIN_FREE_BYTES = 1 << 30  # a model build, adapters and the store need room; below 1 GiB, say so
BUS_TIMEOUT = 10.0  # seconds for an event to come back over the bus


@dataclass
class Check:
    name: str
    ok: bool
    detail: str  # what was found
    fix: str = ""  # for a failure: what to do about it
    seconds: float = 0.0

    def public(self) -> dict[str, Any]:
        return asdict(self)


async def run_checks(config_path: Path | None, overrides: dict[str, Any] | None = None) -> list[Check]:
    """Every check, in order; stops after the config check when the config does not load."""
    started = time.perf_counter()
    try:
        config = load_config(config_path, overrides)
    except ConfigError as exc:
        return [
            Check(
                "config", False, f"{exc.key}: {exc.problem}", exc.fix or "fix the key named", _since(started)
            )
        ]
    source = str(config_path) if config_path else "shipped defaults"
    checks = [
        Check(
            "config", True, f"{source}; model {config.model.id} ({config.model.backend})", "", _since(started)
        )
    ]
    checks.append(await _timed("data dir", lambda: _data_dir(config)))
    checks += await _mcp_servers(config)
    checks.append(await _timed("store", lambda: _store(config)))
    checks.append(await _timed("bus", lambda: _bus(config)))
    checks.append(await _timed("model", lambda: _model(config)))
    return checks


async def _timed(name: str, run: Callable[[], Awaitable[tuple[bool, str, str]]]) -> Check:
    started = time.perf_counter()
    try:
        ok, detail, fix = await run()
    except Exception as exc:  # boundary: a check that blows up is a failed check, reported, never a traceback
        ok, detail, fix = (
            False,
            f"{type(exc).__name__}: {exc}",
            "see the error; run `whet serve` to see it in context",
        )
    return Check(name, ok, detail, fix, _since(started))


async def _data_dir(config: WhetConfig) -> tuple[bool, str, str]:
    path = config.data_path
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".whet-doctor-{uuid.uuid4().hex}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        fix = f"make {path} writable by this user (chown/chmod), or set data_dir to a folder that is"
        return False, f"{path}: cannot write ({exc.strerror})", fix
    free = shutil.disk_usage(path).free
    detail = f"{path}: writable, {free / (1 << 30):.1f} GiB free"
    if free < MIN_FREE_BYTES:
        return (
            False,
            detail,
            f"free space on that disk (at least {MIN_FREE_BYTES >> 30} GiB), or move data_dir",
        )
    return True, detail, ""


async def _mcp_servers(config: WhetConfig) -> list[Check]:
    from whet.runtime.state import mcp_variables

    started = time.perf_counter()
    path = config.mcp_config_path()
    try:
        specs = load_mcp_servers(path, mcp_variables(config))
    except ConfigError as exc:
        return [Check("mcp config", False, f"{exc.key}: {exc.problem}", exc.fix, _since(started))]
    enabled = [spec for spec in specs if not spec.disabled]
    checks: list[Check | None] = [None] * len(enabled)

    async def one(i: int, spec: McpServerSpec) -> None:
        checks[i] = await _timed(f"mcp server {spec.name}", lambda: _mcp_server(config, spec, path))

    async with anyio.create_task_group() as group:  # servers start together, as under `whet serve`
        for i, spec in enumerate(enabled):
            group.start_soon(one, i, spec)
    if not enabled:
        return [Check("mcp servers", True, f"{path}: no enabled servers (no tools)", "", _since(started))]
    return [check for check in checks if check is not None]


async def _mcp_server(config: WhetConfig, spec: McpServerSpec, path: Path) -> tuple[bool, str, str]:
    from whet.runtime.tools import ToolPool

    pool = ToolPool([spec], call_timeout=config.mcp.call_timeout, start_timeout=config.mcp.start_timeout,
                    restart_backoff_max=config.mcp.restart_backoff_max)  # fmt: skip
    started = time.perf_counter()
    async with pool:
        took = time.perf_counter() - started
        status, tools, errors = pool.status()[spec.name], pool.tools(), pool.errors()
    if status == "ready":
        names = ", ".join(t.name for t in tools[:6]) + (", ..." if len(tools) > 6 else "")
        return True, f"ready in {took:.1f}s, {len(tools)} tools ({names})", ""
    why = errors.get(spec.name) or status
    return False, f"{status} after {took:.1f}s: {why}", _mcp_fix(spec, why, path, config)


def _mcp_fix(spec: McpServerSpec, why: str, path: Path, config: WhetConfig) -> str:
    where = f"mcpServers.{spec.name} in {path}"
    transport = spec.transport
    if isinstance(transport, StdioTransport):
        command = shlex.join([transport.command, *transport.args])
        if "FileNotFoundError" in why or "No such file" in why:
            return f"'{transport.command}' was not found: install it or give its full path ({where}.command)"
        if "PermissionError" in why:
            return f"'{transport.command}' is not executable: chmod +x it, or fix {where}.command"
        if why in ("starting", "restarting") or "mcp.start_timeout" in why:
            return (f"it did not answer within mcp.start_timeout ({config.mcp.start_timeout:g}s): run `{command}` "
                    "by hand to see whether it speaks MCP on stdio, or raise mcp.start_timeout")  # fmt: skip
        return f"it exited or broke off during start-up: run `{command}` by hand to see its error, then fix {where}"
    if why in ("starting", "restarting") or "mcp.start_timeout" in why:
        return f"{transport.url} did not answer within mcp.start_timeout: check the server runs, or raise the timeout"
    return f"check that {transport.url} is up and serves MCP ({transport.type}), and the headers in {where}"


async def _store(config: WhetConfig) -> tuple[bool, str, str]:
    from whet.config.settings import redact
    from whet.memory.store import open_store

    shown = redact(config.store)["url"] or f"sqlite:///{config.data_path / 'whet.db'}"
    try:
        store = await anyio.to_thread.run_sync(open_store, config.store_url, config.store.sqlite_sync)
    except Exception as exc:  # boundary: any failure to open is the finding
        return False, f"{shown}: {type(exc).__name__}: {exc}".splitlines()[0], _store_fix(config)
    try:
        stats = await store.stats()
    except Exception as exc:  # boundary: opened but unreadable
        return False, f"{shown}: {type(exc).__name__}: {exc}".splitlines()[0], _store_fix(config)
    finally:
        await store.aclose()
    return (
        True,
        f"{shown}: {stats['turns']} turns, {stats['lessons']} lessons, {stats['adapters']} adapters",
        "",
    )


def _store_fix(config: WhetConfig) -> str:
    if config.store.url and config.store.url.startswith("postgres"):
        return "start PostgreSQL (or fix host, port, user, password and database in store.url)"
    return f"make {config.data_path} writable, or set store.url to a database you can open"


async def _bus(config: WhetConfig) -> tuple[bool, str, str]:
    from whet.memory.bus import open_bus

    if config.bus.url is None:
        return True, "in-process (one replica; set bus.url to an MQTT broker to scale out)", ""
    from whet.config.settings import redact

    shown = redact(config.bus)["url"]
    bus = open_bus(config.bus.url, None)  # a clean session of its own: never the server's client id
    name = f"doctor_{uuid.uuid4().hex[:8]}"
    try:
        await bus.start()
        async with bus.subscribe(name) as events:
            await bus.publish(name, {"ping": 1})
            with anyio.move_on_after(BUS_TIMEOUT):
                async for event in events:
                    if event.name == name:
                        return True, f"{shown}: an event went out and came back", ""
    finally:
        await bus.aclose()
    fix = "start the MQTT broker (e.g. mosquitto) or fix host, port and credentials in bus.url"
    return False, f"{shown}: no event came back within {BUS_TIMEOUT:g}s", fix


async def _model(config: WhetConfig) -> tuple[bool, str, str]:
    from whet.learner.model import DEFAULT_MODEL
    from whet.runtime.backends import create_backend
    from whet.runtime.policy import BackendError, SamplingParams

    try:
        backend = await anyio.to_thread.run_sync(create_backend, config.model, config.data_path)
    except BackendError as exc:
        fix = (
            "run `whet model build`" if config.model.id == DEFAULT_MODEL else "fix model.id / model.base_url"
        )
        return False, f"{config.model.id}: {exc}", fix
    try:
        started = time.perf_counter()
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        generation = await backend.generate([{"role": "user", "content": "Say OK."}], [], params)
        took = time.perf_counter() - started
    except BackendError as exc:
        return False, f"{config.model.id}: loaded, but generating failed: {exc}", _model_fix(config)
    finally:
        await backend.aclose()
    return True, f"{config.model.name}: loaded; one token ({generation.text!r}) in {took:.2f}s", ""


def _model_fix(config: WhetConfig) -> str:
    if config.model.backend == "transformers":
        return "check model.device and model.dtype fit this machine (model.device: cpu always works)"
    return f"check that {config.model.base_url} serves {config.model.id} (model.id names the remote model)"


def _since(started: float) -> float:
    return round(time.perf_counter() - started, 3)


def print_report(checks: list[Check]) -> None:
    """A rich table: one row per check, the fix beside each failure."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="whet doctor", show_lines=False)
    for column in ("check", "result", "time", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for check in checks:
        mark = "[green]ok[/green]" if check.ok else "[red]FAIL[/red]"
        table.add_row(check.name, mark, f"{check.seconds:.2f}s", check.detail, check.fix)
    console = Console()
    console.print(table)
    failed = [check.name for check in checks if not check.ok]
    console.print(
        f"[red]{len(failed)} failed: {', '.join(failed)}[/red]"
        if failed
        else "[green]all checks passed[/green]"
    )
