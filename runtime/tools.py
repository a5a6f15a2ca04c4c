"""The MCP client pool: every configured tool server behind one ``call``.

Each server has one long-lived owner task that opens the client, lists the
tools, follows ``tools/list_changed``, and closes the client in that same task
(anyio cancel scopes, and the stdio transport's process group, must be exited
by the task that entered them). Calls run in the caller's task straight on the
owner's ``ClientSession``: mcp 2.x correlates requests by id in its dispatcher,
so concurrent calls from many request tasks are safe once the session is open.

A server that exits or whose connection breaks is restarted with exponential
backoff; while it is down its tools leave :meth:`ToolPool.tools` and calls to
them fail fast with a clear message. ``call`` never raises for tool problems:
timeouts, errors, unknown names and bad arguments all come back as a
:class:`ToolResult` with ``is_error=True`` that the model can read.

Every call carries the user it acts for in the request's ``_meta`` under
``whet/user`` (:data:`USER_META_KEY`), so a server that keeps personal data can
keep users apart. A server tool named ``whet_forget_user`` (:data:`FORGET_TOOL`)
is never shown to the model; :meth:`ToolPool.forget_user` calls it to delete a
user's data on that server.

Tool names exposed to the model match ``^[a-zA-Z0-9_-]{1,64}$``; when two
servers offer the same name, both become ``server__tool``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import anyio.abc
import mcp_types as types
import structlog
from mcp import Client
from mcp.client.sse import sse_client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.client.subscriptions import SubscriptionLost
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from whet.config.mcp import HttpTransport, McpServerSpec, StdioTransport
from whet.learner.prompt import openai_tool_spec, parse_arguments, render_tool_result
from whet.runtime.stderr_relay import StderrRelay

log = structlog.get_logger(__name__)

_NAME_LIMIT = 64
_UNSAFE = re.compile(r"[^a-zA-Z0-9_-]")
_MAX_PAGES = 100
USER_META_KEY = "whet/user"
FORGET_TOOL = "whet_forget_user"


@dataclass
class ToolInfo:
    """One tool as the model sees it; ``remote_name`` is the server's own name for it."""

    name: str
    server: str
    remote_name: str
    description: str
    input_schema: dict[str, Any]
    annotations: dict[str, Any] = field(default_factory=dict)


@dataclass
class ToolResult:
    """What a tool call produced, as text for the model."""

    content: str
    is_error: bool
    server: str | None = None


class ToolPool:
    """Connects the MCP servers in ``specs`` and routes tool calls to them.

    ``in_memory`` maps a server name to an mcp ``Server``/``MCPServer`` object
    connected in-process; when a spec has the same name, the spec still
    supplies ``disabled``, the tool filters and the timeout. ``start`` and
    ``aclose`` must run in the same task (use ``async with``).
    """

    def __init__(
        self,
        specs: list[McpServerSpec],
        *,
        call_timeout: float = 30.0,
        max_result_chars: int = 16_000,
        start_timeout: float = 20.0,
        restart_backoff_max: float = 30.0,
        restart_backoff_min: float = 0.5,
        start_wait: float = 10.0,
        in_memory: Mapping[str, Any] | None = None,
    ) -> None:
        self.call_timeout = call_timeout
        self.max_result_chars = max_result_chars
        self.start_timeout = start_timeout
        self.start_wait = start_wait
        self.restart_backoff_max = restart_backoff_max
        self.restart_backoff_min = min(restart_backoff_min, restart_backoff_max)
        in_memory = dict(in_memory or {})
        named = {spec.name for spec in specs}
        self._servers: list[tuple[McpServerSpec | None, str, Any]] = [
            (spec, spec.name, in_memory.get(spec.name)) for spec in specs if not spec.disabled
        ]
        self._servers += [(None, name, server) for name, server in in_memory.items() if name not in named]
        self._links: list[_Link] = []
        self._index: dict[str, tuple[ToolInfo, _Link]] = {}
        self._changed: anyio.Event | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._opened_at = 0.0
        self.generation = 0
        """Bumped whenever the tool list or a server's status changes."""

    async def __aenter__(self) -> ToolPool:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self, *, wait: bool = True) -> None:
        """Start every enabled server in the background; with ``wait``, return once each is
        ready or failed (a server that gives no answer within start_timeout counts as failed).

        ``whet serve`` passes ``wait=False``, so the port opens while servers start; a chat then
        calls :meth:`settle` first. A server that fails to start is retried in the background.
        """
        if self._task_group is not None:
            raise RuntimeError("ToolPool.start() was already called")
        self._changed = anyio.Event()
        self._opened_at = anyio.current_time()
        self._links = [
            _Link(
                spec,
                name,
                server,
                start_timeout=self.start_timeout,
                backoff=(self.restart_backoff_min, self.restart_backoff_max),
                on_change=self._on_change,
            )
            for spec, name, server in self._servers
        ]
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        for link in self._links:
            task_group.start_soon(link.run, name=f"mcp server {link.name}")
            task_group.start_soon(link.start_deadline, name=f"mcp server {link.name} start deadline")
        if not wait:
            task_group.start_soon(self._report_start, name="mcp start report")
            return
        try:
            await self._report_start()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.aclose()
            raise

    async def _report_start(self) -> None:
        """Log the pool's state once every server's first start ended (ready or failed)."""
        for link in self._links:  # each link's start deadline bounds this wait
            await link.attempted.wait()
        log.info("mcp.pool.started", status=self.status(), tools=len(self.tools()))

    async def settle(self) -> list[str]:
        """Wait for servers still on their first start, until ``start_wait`` seconds after the
        pool started; return the names of those still starting then (their tools are missing).

        A chat calls this before listing tools, so a server that is ready a moment after
        ``whet serve`` opened its port is not missed, while a hanging one delays only the
        first ``start_wait`` seconds of service, not every request until start_timeout.
        """
        if not self.starting():
            return []
        left = self._opened_at + min(self.start_wait, self.start_timeout) - anyio.current_time()
        if left > 0:
            with anyio.move_on_after(left):
                for link in self._links:
                    await link.attempted.wait()
        return self.starting()

    def starting(self) -> list[str]:
        """The servers still on their first start (neither ready nor failed yet)."""
        return [link.name for link in self._links if link.status == "starting"]

    async def aclose(self) -> None:
        """Stop every owner task; each closes its own client (and server process)."""
        task_group, self._task_group = self._task_group, None
        if task_group is None:
            return
        for link in self._links:
            link.closing = True
        task_group.cancel_scope.cancel()
        await task_group.__aexit__(None, None, None)

    def status(self) -> dict[str, str]:
        """Server name -> "starting" | "ready" | "restarting" | "failed" (enabled servers only)."""
        if not self._links:
            return {name: "starting" for _, name, _ in self._servers}
        return {link.name: link.status for link in self._links}

    def errors(self) -> dict[str, str]:
        """Server name -> why it is not ready (its last failure), for servers that are not ready."""
        return {link.name: link.error or link.status for link in self._links if link.status != "ready"}

    def tools(self) -> list[ToolInfo]:
        """The tools of the servers that are ready now, filtered and uniquely named."""
        return [info for info, link in self._index.values() if link.status == "ready"]

    def info(self, name: str) -> ToolInfo | None:
        """The tool the model knows as ``name`` (ready or not); None for a name no server offers."""
        entry = self._index.get(name)
        return entry[0] if entry else None

    def openai_tools(self, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """OpenAI function specs for the ready tools (only ``names``, in pool order, when given)."""
        wanted = None if names is None else set(names)
        return [_openai_tool(info) for info in self.tools() if wanted is None or info.name in wanted]

    async def wait_changed(self) -> None:
        """Return at the next change of the tool list or of a server's status."""
        if self._changed is None:
            raise RuntimeError("ToolPool.wait_changed() needs a started pool")
        await self._changed.wait()

    async def forget_user(self, user: str) -> dict[str, ToolResult]:
        """Call every ready server's ``whet_forget_user`` for ``user``: server name -> its answer.

        A server that is not ready is reported as an error result, so the caller can say what
        could not be forgotten.
        """
        answers: dict[str, ToolResult] = {}
        for link in self._links:
            client, generation = link.client, link.generation
            offers = FORGET_TOOL in [tool.name for tool in link.all_tools]
            if link.status != "ready" or client is None:
                if offers or not link.all_tools:  # may hold the user's data, and cannot be asked now
                    answers[link.name] = ToolResult(link.unavailable(), True, link.name)
                continue
            if not offers:
                continue
            info = ToolInfo(FORGET_TOOL, link.name, FORGET_TOOL, "", {})
            timeout = link.timeout or self.call_timeout
            result = await self._send(link, client, generation, info, {}, timeout, user)
            if not isinstance(result, ToolResult):
                result = ToolResult(render_tool_result(result, self.max_result_chars), bool(result.is_error), link.name)
            answers[link.name] = result
        return answers

    async def call(self, name: str, arguments: dict[str, Any] | Any, *, user: str | None = None) -> ToolResult:
        """Call the tool the model knows as ``name`` for ``user``; never raises for tool problems."""
        entry = self._index.get(name)
        if entry is None:
            available = ", ".join(info.name for info in self.tools()) or "none"
            return ToolResult(f"unknown tool '{name}'; available tools: {available}", True)
        info, link = entry
        parsed = parse_arguments(arguments)
        if isinstance(parsed, str):
            return ToolResult(f"bad arguments for tool '{name}': {parsed}", True, link.name)
        client, generation = link.client, link.generation
        if link.status != "ready" or client is None:
            return ToolResult(link.unavailable(), True, link.name)
        timeout = link.timeout or self.call_timeout
        result = await self._send(link, client, generation, info, parsed, timeout, user)
        if isinstance(result, ToolResult):
            return result
        return ToolResult(render_tool_result(result, self.max_result_chars), bool(result.is_error), link.name)

    async def _send(
        self,
        link: _Link,
        client: Client,
        generation: int,
        info: ToolInfo,
        arguments: dict[str, Any],
        timeout: float,
        user: str | None,
    ) -> types.CallToolResult | ToolResult:
        def error(text: str) -> ToolResult:
            return ToolResult(text, True, link.name)

        timed_out = error(f"tool '{info.name}' timed out after {timeout:g}s")
        try:
            with anyio.move_on_after(timeout):
                meta = {USER_META_KEY: user} if user is not None else None
                return await client.call_tool(
                    info.remote_name, arguments, read_timeout_seconds=timeout, meta=meta  # type: ignore[arg-type]
                )
        except MCPError as exc:
            if exc.code == types.REQUEST_TIMEOUT:
                link.suspect(generation, timeout)
                return timed_out
            if exc.code == types.CONNECTION_CLOSED:
                link.lose(generation, "the connection closed during a call")
                return error(f"server '{link.name}' went away during the call to '{info.name}'; restarting")
            return error(f"tool '{info.name}' failed: {exc.message} (MCP error {exc.code})")
        except Exception as exc:  # boundary: a tool problem must reach the model, not the agent loop
            log.warning("mcp.call.failed", server=link.name, tool=info.remote_name, error=_describe(exc))
            return error(f"tool '{info.name}' failed: {_describe(exc)}")
        link.suspect(generation, timeout)
        return timed_out  # only reached when move_on_after cancelled the call

    def _on_change(self) -> None:
        self._reindex()
        self.generation += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = anyio.Event()

    def _reindex(self) -> None:
        """Name every known tool (ready or not, so names stay put across restarts)."""
        listed = [(link, tool) for link in self._links for tool in link.tools]
        seen = Counter(_safe_name(tool.name) for _, tool in listed)
        index: dict[str, tuple[ToolInfo, _Link]] = {}
        for link, tool in listed:
            stem = _safe_name(tool.name)
            if seen[stem] > 1:
                stem = _safe_name(f"{_safe_name(link.name)}__{tool.name}")
            name, suffix = stem, 2
            while name in index:  # still taken (names that only differ in unsafe characters)
                name, suffix = f"{stem[: _NAME_LIMIT - 4]}_{suffix}", suffix + 1
            index[name] = (_tool_info(name, link.name, tool), link)
        self._index = index


class _Link:
    """One server's owner: connects, lists, follows changes, restarts with backoff."""

    def __init__(
        self,
        spec: McpServerSpec | None,
        name: str,
        server: Any,
        *,
        start_timeout: float,
        backoff: tuple[float, float],
        on_change: Callable[[], None],
    ) -> None:
        self.spec, self.name, self.server = spec, name, server
        self.start_timeout, self.backoff, self.on_change = start_timeout, backoff, on_change
        self.timeout = spec.timeout if spec else None
        self.status = "starting"
        self.error: str | None = None
        self.client: Client | None = None
        self.tools: list[types.Tool] = []
        self.all_tools: list[types.Tool] = []  # as listed, the hidden forget tool included
        self.generation = 0
        self.closing = False
        self.attempted = anyio.Event()
        self._wake = anyio.Event()
        self._stale = False
        self._lost: str | None = None
        self._probe: float | None = None  # a call timed out: ping within this many seconds
        self.stderr: StderrRelay | None = None  # the current stdio process's stderr relay

    def unavailable(self) -> str:
        """Why a call to this server cannot go through right now."""
        if self.status == "starting":
            return f"server '{self.name}' is still starting; try again shortly"
        if self.status == "failed":
            return f"server '{self.name}' failed to start ({self.error}); retrying in the background"
        return f"server '{self.name}' is restarting; try again shortly"

    async def start_deadline(self) -> None:
        """Call the first start failed once start_timeout passes without an answer.

        The attempt itself goes on (a server that answers late still becomes ready, and a
        first-run download is not killed); the handshake's own timeouts end a hung one, and the
        backoff retries it.
        """
        await anyio.sleep(self.start_timeout)
        if self.status != "starting":
            return
        self.status = "failed"
        self.error = f"start timed out: no answer within mcp.start_timeout ({self.start_timeout:g}s)"
        self.attempted.set()
        self.on_change()
        log.warning("mcp.server.start_timeout", server=self.name, timeout=self.start_timeout)

    def lose(self, generation: int, reason: str) -> None:
        """Mark connection ``generation`` broken; the owner closes it and reconnects."""
        if generation != self.generation or self._lost is not None or self.closing:
            return
        self._lost = reason
        if self.status == "ready":
            self.status = "restarting"
            self.on_change()
        self._wake.set()

    def suspect(self, generation: int, timeout: float) -> None:
        """A call on connection ``generation`` timed out: the owner pings it and reconnects if it is dead.

        A slow tool leaves a live server that answers the ping; a wedged process or a broken
        read side answers nothing, and without this check would stay "ready" for good.
        """
        if generation != self.generation or self.closing or self._lost is not None:
            return
        self._probe = timeout
        self._wake.set()

    def tool_names(self) -> list[str]:
        return [tool.name for tool in self.tools]

    def mark_stale(self) -> None:
        self._stale = True
        self._wake.set()

    async def run(self) -> None:
        """The owner task: connect, serve until lost, back off, repeat until cancelled.

        The backoff doubles per failure up to its cap, and starts over once a
        connection has stayed up for as long as the cap.
        """
        shortest, longest = self.backoff
        delay = shortest
        while True:
            self.generation += 1
            self._lost, self._stale = None, False
            began = anyio.current_time()
            try:
                await self._connect_and_serve(self.generation)
            except Exception as exc:  # boundary: any failure of a server means restart, never a crash
                self.error = _describe(exc)
            self.client = None
            if anyio.current_time() - began >= longest:
                delay = shortest
            self.status = "failed" if self.status in ("starting", "failed") else "restarting"
            self.attempted.set()
            self.on_change()
            log.warning(
                "mcp.server.down", server=self.name, status=self.status, error=self.error, retry_in=delay
            )
            await anyio.sleep(delay)
            delay = min(delay * 2, longest)

    async def _connect_and_serve(self, generation: int) -> None:
        async with self._client(generation) as client, anyio.create_task_group() as task_group:
            # subscribe before listing, so a change right after the listing is not missed
            await task_group.start(self._follow_changes, client, generation)
            await self._list_tools(client)
            self.client, self.status, self.error = client, "ready", None
            self.attempted.set()
            self.on_change()
            log.info(
                "mcp.server.ready",
                server=self.name,
                protocol=client.protocol_version,
                tools=self.tool_names(),
            )
            await self._serve(client)
            task_group.cancel_scope.cancel()

    async def _serve(self, client: Client) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            if self._lost is not None:
                raise ConnectionError(self._lost)
            if self._probe is not None:
                await self._ping(client, self._probe)
                self._probe = None
            if self._stale:
                self._stale = False
                await self._list_tools(client)
                self.on_change()
                log.info("mcp.server.tools_changed", server=self.name, tools=self.tool_names())

    async def _ping(self, client: Client, timeout: float) -> None:
        """Raise ConnectionError when the server does not answer within ``timeout``.

        The probe is a tools/list (ping is gone from the 2026-07-28 protocol); any answer,
        an error included, shows the link alive.
        """
        problem = f"no answer within {timeout:g}s"
        with anyio.move_on_after(timeout):
            try:
                await client.list_tools()
                return
            except MCPError as exc:
                if exc.code not in (types.REQUEST_TIMEOUT, types.CONNECTION_CLOSED):
                    return
                problem = _describe(exc)
            except Exception as exc:  # boundary: any other failure to answer means the link is dead
                problem = _describe(exc)
        self.status = "restarting"
        self.on_change()
        raise ConnectionError(f"the server stopped answering after a timed-out call ({problem})")

    def _client(self, generation: int) -> Client:
        target: Any = self.server
        if target is None:
            assert self.spec is not None
            closed = partial(self.lose, generation, "the connection closed")
            target = _open_transport(self.spec.transport, closed, self)
        return Client(
            target,
            # bounds the handshake and listings; calls pass their own timeout
            read_timeout_seconds=self.start_timeout,
            message_handler=self._on_message,
            client_info=types.Implementation(name="whet", version="0.1.0"),
            cache=None,
        )

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            self.mark_stale()
        elif isinstance(message, Exception):
            log.debug("mcp.server.transport_error", server=self.name, error=_describe(message))

    async def _list_tools(self, client: Client) -> None:
        tools: list[types.Tool] = []
        cursor: str | None = None
        for _ in range(_MAX_PAGES):
            page = await client.list_tools(cursor=cursor)
            tools += page.tools
            cursor = page.next_cursor
            if not cursor:
                break
        self.all_tools = tools
        self.tools = [tool for tool in tools if tool.name != FORGET_TOOL and self._exposed(tool.name)]

    def _exposed(self, remote_name: str) -> bool:
        if self.spec is None:
            return True
        allowed = self.spec.allowed_tools
        return (allowed is None or remote_name in allowed) and remote_name not in self.spec.disabled_tools

    async def _follow_changes(
        self,
        client: Client,
        generation: int,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """On 2026-07-28 connections, change notifications come only on a listen stream.

        Reports started once the stream is acknowledged (or known to be unavailable).
        A stream that drops abruptly means the connection did (HTTP servers give no
        other sign until the next call), so the server is reconnected.
        """
        tools = client.server_capabilities.tools
        modern = client.protocol_version in MODERN_PROTOCOL_VERSIONS
        if not modern or tools is None or not tools.list_changed:
            task_status.started()  # earlier versions deliver them to _on_message unasked
            return
        started = False
        try:
            async with client.listen(tools_list_changed=True) as subscription:
                task_status.started()
                started = True
                async for _ in subscription:
                    self.mark_stale()
        except SubscriptionLost as exc:
            if started:
                self.lose(generation, f"the change subscription dropped ({exc})")
        except Exception as exc:  # without listen support a server still works, only unrefreshed
            log.debug("mcp.server.listen_ended", server=self.name, error=_describe(exc))
            if not started:
                task_status.started()


class _WatchedReadStream:
    """A transport's read side that reports when the connection ends (EOF or close)."""

    def __init__(self, inner: Any, on_close: Callable[[], None]) -> None:
        self._inner, self._on_close = inner, on_close

    @property
    def last_context(self) -> Any:
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> Any:
        return await self._inner.receive()

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __aiter__(self) -> _WatchedReadStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self._inner.__anext__()
        except StopAsyncIteration:
            self._on_close()
            raise

    async def __aenter__(self) -> _WatchedReadStream:
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        self._on_close()
        return await self._inner.__aexit__(*exc_info)


@asynccontextmanager
async def _open_transport(
    transport: StdioTransport | HttpTransport, on_close: Callable[[], None], link: _Link
) -> AsyncIterator[tuple[Any, Any]]:
    async with AsyncExitStack() as stack:
        relay = None
        if isinstance(transport, StdioTransport):
            relay = link.stderr = StderrRelay(link.name)
            stack.callback(relay.spawned)  # also when the spawn fails
            command, args, env = transport.command, transport.args, transport.env or None
            # "replace": bytes that are not UTF-8 spoil one message at most, instead of killing the reader
            params = StdioServerParameters(
                command=command, args=args, env=env, cwd=transport.cwd, encoding_error_handler="replace"
            )
            streams = stdio_client(params, errlog=relay.writer)  # type: ignore[arg-type]
        elif transport.type == "sse":
            streams = sse_client(transport.url, headers=transport.headers or None)
        else:
            http_client = create_mcp_http_client(headers=transport.headers or None)
            http = await stack.enter_async_context(http_client)
            streams = streamable_http_client(transport.url, http_client=http)
        read_stream, write_stream = await stack.enter_async_context(streams)
        if relay is not None:
            relay.spawned()
        yield _WatchedReadStream(read_stream, on_close), write_stream


def _safe_name(name: str) -> str:
    return _UNSAFE.sub("_", name)[:_NAME_LIMIT] or "tool"


def _tool_info(name: str, server: str, tool: types.Tool) -> ToolInfo:
    annotations = {}
    if tool.annotations is not None:
        annotations = tool.annotations.model_dump(mode="json", by_alias=True, exclude_none=True)
    return ToolInfo(
        name=name,
        server=server,
        remote_name=tool.name,
        description=tool.description or tool.title or "",
        input_schema=dict(tool.input_schema),
        annotations=annotations,
    )


def _openai_tool(info: ToolInfo) -> dict[str, Any]:
    return openai_tool_spec(info.name, info.description, info.input_schema)


def _describe(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, MCPError):
        return f"{exc.message} (MCP error {exc.code})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
