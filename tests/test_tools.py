"""The MCP client pool: start-up, naming, calls, errors, timeouts, refresh, stdio servers, restarts."""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
import uvicorn

from whet.config.mcp import McpServerSpec, parse_mcp_servers
from whet.runtime.tools import ToolPool

from peers.echo_server import build_server

ECHO_SERVER = Path(__file__).parent / "peers" / "echo_server.py"
DEADLINE = 15.0


def specs(servers: dict) -> list[McpServerSpec]:
    return parse_mcp_servers({"mcpServers": servers}, {}, "test")


async def wait_until(pool: ToolPool, condition: Callable[[], bool], deadline: float = DEADLINE) -> None:
    with anyio.fail_after(deadline):
        while not condition():
            await pool.wait_changed()


def names(pool: ToolPool) -> set[str]:
    return {tool.name for tool in pool.tools()}


@pytest.mark.anyio
async def test_colliding_tool_names_are_namespaced_and_routed_to_their_server():
    async with ToolPool([], in_memory={"alpha": build_server("alpha"), "beta": build_server("beta")}) as pool:
        assert {"alpha__whoami", "beta__whoami", "alpha__echo", "beta__echo"} <= names(pool)
        assert "whoami" not in names(pool)
        assert (await pool.call("alpha__whoami", {})).content == "alpha"
        beta = await pool.call("beta__whoami", {})
        assert (beta.content, beta.is_error, beta.server) == ("beta", False, "beta")
        info = next(tool for tool in pool.tools() if tool.name == "beta__echo")
        assert (info.server, info.remote_name) == ("beta", "echo")


@pytest.mark.anyio
async def test_names_that_do_not_collide_stay_plain_and_unsafe_characters_are_replaced():
    server = build_server("solo")
    server.add_tool(lambda: "ok", name="get.time/now", description="odd name")
    server.add_tool(lambda: "ok", name="t" * 80, description="long name")
    async with ToolPool([], in_memory={"solo": server}) as pool:
        exposed = names(pool)
        assert {"echo", "whoami", "get_time_now", "t" * 64} <= exposed
        assert all(len(name) <= 64 for name in exposed)
        assert (await pool.call("get_time_now", {})).content == "ok"


@pytest.mark.anyio
async def test_openai_tools_are_function_specs_for_the_named_tools():
    async with ToolPool([], in_memory={"solo": build_server("solo")}) as pool:
        (echo,) = pool.openai_tools(["echo", "not-a-tool"])
        assert echo["type"] == "function"
        assert echo["function"]["name"] == "echo"
        assert echo["function"]["description"] == "Return the text unchanged."
        assert echo["function"]["parameters"]["type"] == "object"
        assert "text" in echo["function"]["parameters"]["properties"]
        assert len(pool.openai_tools()) == len(pool.tools())


@pytest.mark.anyio
async def test_a_tool_error_comes_back_as_an_error_result():
    async with ToolPool([], in_memory={"solo": build_server("solo")}) as pool:
        result = await pool.call("fail", {"message": "disk on fire"})
        assert result.is_error
        assert "disk on fire" in result.content


@pytest.mark.anyio
async def test_a_slow_tool_times_out_after_the_servers_own_timeout():
    config = specs({"solo": {"command": "in-process", "timeout": 0.2}})
    async with ToolPool(config, call_timeout=30.0, in_memory={"solo": build_server("solo")}) as pool:
        with anyio.fail_after(5):
            result = await pool.call("slow", {"seconds": 30})
        assert result.is_error
        assert "timed out after 0.2s" in result.content
        assert (await pool.call("echo", {"text": "still here"})).content == "still here"


@pytest.mark.anyio
async def test_a_long_result_is_truncated_with_a_marker():
    async with ToolPool([], max_result_chars=100, in_memory={"solo": build_server("solo")}) as pool:
        result = await pool.call("big", {"size": 1000})
        assert not result.is_error
        assert result.content == "x" * 100 + "\n[truncated 900 chars]"
        assert (await pool.call("big", {"size": 100})).content == "x" * 100


@pytest.mark.anyio
async def test_structured_content_is_the_text_when_there_is_no_text():
    async with ToolPool([], in_memory={"solo": build_server("solo")}) as pool:
        result = await pool.call("structured", {})
        assert (result.content, result.is_error) == ('{"answer": 42}', False)


@pytest.mark.anyio
async def test_an_unknown_tool_lists_the_available_names():
    async with ToolPool([], in_memory={"solo": build_server("solo")}) as pool:
        result = await pool.call("fly", {})
        assert result.is_error
        assert "unknown tool 'fly'" in result.content
        assert "echo" in result.content and "whoami" in result.content


@pytest.mark.anyio
@pytest.mark.parametrize("arguments", [["hello"], 7, "not json", '["a", "list"]'])
async def test_arguments_that_are_not_a_json_object_are_refused(arguments):
    async with ToolPool([], in_memory={"solo": build_server("solo")}) as pool:
        result = await pool.call("echo", arguments)
        assert result.is_error
        assert "bad arguments for tool 'echo'" in result.content


@pytest.mark.anyio
async def test_arguments_given_as_a_json_string_are_accepted():
    async with ToolPool([], in_memory={"solo": build_server("solo")}) as pool:
        assert (await pool.call("echo", '{"text": "from json"}')).content == "from json"


@pytest.mark.anyio
async def test_allowed_and_disabled_tools_filter_what_is_exposed_and_disabled_servers_stay_off():
    config = specs(
        {
            "solo": {
                "command": "in-process",
                "allowedTools": ["echo", "fail", "pid"],
                "disabledTools": ["fail"],
            },
            "off": {"command": "in-process", "disabled": True},
        }
    )
    in_memory = {"solo": build_server("solo"), "off": build_server("off")}
    async with ToolPool(config, in_memory=in_memory) as pool:
        assert names(pool) == {"echo", "pid"}
        assert pool.status() == {"solo": "ready"}
        result = await pool.call("fail", {"message": "x"})
        assert result.is_error and "unknown tool 'fail'" in result.content


@pytest.mark.anyio
async def test_the_tool_list_refreshes_when_a_server_announces_a_change():
    async with ToolPool([], in_memory={"solo": build_server("solo")}) as pool:
        assert "forecast" not in names(pool)
        before = pool.generation
        assert not (await pool.call("grow", {"tool": "forecast"})).is_error
        await wait_until(pool, lambda: "forecast" in names(pool))
        assert pool.generation > before
        assert (await pool.call("forecast", {})).content == "forecast works"


@pytest.mark.anyio
async def test_a_server_that_cannot_start_is_reported_failed_without_failing_start():
    config = specs({"broken": {"command": sys.executable, "args": ["-c", "raise SystemExit(1)"]}})
    async with ToolPool(config, start_timeout=10.0, in_memory={"solo": build_server("solo")}) as pool:
        assert pool.status() == {"broken": "failed", "solo": "ready"}
        assert (await pool.call("echo", {"text": "fine"})).content == "fine"


HANGING = {"command": sys.executable, "args": ["-c", "import time; time.sleep(3600)"]}  # never answers initialize


@pytest.mark.anyio
async def test_a_server_silent_past_start_timeout_is_failed_with_that_reason_and_start_returns():
    async with ToolPool(specs({"hang": HANGING}), start_timeout=1.0, in_memory={"solo": build_server("solo")}) as pool:
        assert pool.status() == {"hang": "failed", "solo": "ready"}
        assert "no answer within mcp.start_timeout (1s)" in pool.errors()["hang"]
        assert pool.starting() == []


@pytest.mark.anyio
async def test_a_pool_started_without_waiting_settles_only_until_start_wait():
    pool = ToolPool(specs({"hang": HANGING}), start_timeout=30.0, start_wait=3.0, in_memory={"solo": build_server("solo")})
    began = anyio.current_time()
    await pool.start(wait=False)
    try:
        assert pool.status()["hang"] == "starting"  # returned at once, servers on their way
        assert await pool.settle() == ["hang"]  # the ready server is listed, the hanging one is not waited for
        assert 3.0 <= anyio.current_time() - began < 12.0
        assert pool.status() == {"hang": "starting", "solo": "ready"} and "echo" in names(pool)
        waited = anyio.current_time()
        assert await pool.settle() == ["hang"] and anyio.current_time() - waited < 1.5  # past start_wait: no 3 s wait
    finally:
        await pool.aclose()


@pytest.mark.loopback
@pytest.mark.anyio
async def test_the_stdio_time_server_lists_and_answers_get_current_time():
    config = specs({"time": {"command": sys.executable, "args": ["-m", "mcp_server_time"]}})
    async with ToolPool(config) as pool:
        assert pool.status() == {"time": "ready"}
        assert "get_current_time" in names(pool)
        result = await pool.call("get_current_time", {"timezone": "UTC"})
        assert not result.is_error, result.content
        assert '"timezone": "UTC"' in result.content
        bad = await pool.call("get_current_time", {"timezone": "Mars/Olympus"})
        assert bad.is_error


@pytest.mark.loopback
@pytest.mark.anyio
async def test_a_handshake_era_stdio_server_refreshes_on_its_plain_change_notification():
    config = specs({"old": {"command": sys.executable, "args": [str(ECHO_SERVER), "--handshake-only"]}})
    async with ToolPool(config) as pool:
        assert pool.status() == {"old": "ready"}
        assert not (await pool.call("grow", {"tool": "late_tool"})).is_error
        await wait_until(pool, lambda: "late_tool" in names(pool))
        assert (await pool.call("late_tool", {})).content == "late_tool works"


@pytest.mark.loopback
@pytest.mark.anyio
async def test_a_stdio_server_that_exits_is_restarted_and_its_tools_come_back():
    config = specs({"peer": {"command": sys.executable, "args": [str(ECHO_SERVER)]}})
    async with ToolPool(config, restart_backoff_min=0.05, restart_backoff_max=1.0) as pool:
        assert pool.status() == {"peer": "ready"}
        first_pid = (await pool.call("pid", {})).content

        crashed = await pool.call("exit", {})
        assert crashed.is_error
        assert pool.status() == {"peer": "restarting"}
        assert "pid" not in names(pool)
        meanwhile = await pool.call("pid", {})
        assert meanwhile.is_error and "restarting" in meanwhile.content

        await wait_until(pool, lambda: pool.status()["peer"] == "ready")
        assert "pid" in names(pool)
        again = await pool.call("pid", {})
        assert not again.is_error
        assert again.content != first_pid


@asynccontextmanager
async def serving_over_http(app) -> AsyncIterator[int]:
    """Serve ``app`` with uvicorn on a loopback socket bound up front (so no wait for startup)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    async with anyio.create_task_group() as task_group:
        task_group.start_soon(server.serve, [sock])
        try:
            yield sock.getsockname()[1]
        finally:
            server.should_exit = True
    sock.close()


@pytest.mark.loopback
@pytest.mark.anyio
@pytest.mark.parametrize(("kind", "path"), [("http", "/mcp"), ("sse", "/sse")])
async def test_an_http_server_is_listed_called_and_refreshed(kind, path):
    peer = build_server("web")
    app = peer.streamable_http_app() if kind == "http" else peer.sse_app()
    async with serving_over_http(app) as port:
        url = f"http://127.0.0.1:{port}{path}"
        config = specs({"web": {"type": kind, "url": url, "headers": {"X-Test": "1"}}})
        async with ToolPool(config) as pool:
            assert pool.status() == {"web": "ready"}
            assert (await pool.call("whoami", {})).content == "web"
            assert not (await pool.call("grow", {"tool": "remote_added"})).is_error
            await wait_until(pool, lambda: "remote_added" in names(pool))


@pytest.mark.loopback
@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["utf8", "text", "half-json"])
@pytest.mark.parametrize("newline", [True, False], ids=["own-line", "glued-to-the-answer"])
async def test_garbage_on_a_stdio_servers_stdout_costs_at_most_one_call(kind, newline):
    """Invalid UTF-8, a line of plain text, a JSON-RPC message cut off: at most the call that wrote it fails."""
    config = specs({"peer": {"command": sys.executable, "args": [str(ECHO_SERVER)]}})
    async with ToolPool(config, call_timeout=3.0) as pool:
        assert pool.status() == {"peer": "ready"}
        with anyio.fail_after(DEADLINE):
            # may fail: its answer may be the garbled line
            await pool.call("garbage", {"newline": newline, "kind": kind})
            for n in range(3):
                answer = await pool.call("echo", {"text": f"still here {n}"})
                assert not answer.is_error and answer.content == f"still here {n}"
        assert pool.status() == {"peer": "ready"}


@pytest.mark.loopback
@pytest.mark.anyio
async def test_a_stdio_server_that_stops_answering_is_detected_and_restarted():
    config = specs({"peer": {"command": sys.executable, "args": [str(ECHO_SERVER)]}})
    async with ToolPool(config, call_timeout=1.0, restart_backoff_min=0.05, restart_backoff_max=1.0) as pool:
        first_pid = (await pool.call("pid", {})).content
        wedged = await pool.call("wedge", {})
        assert wedged.is_error and "timed out" in wedged.content
        await wait_until(pool, lambda: pool.status()["peer"] != "ready")
        await wait_until(pool, lambda: pool.status()["peer"] == "ready")
        again = await pool.call("pid", {})
        assert not again.is_error and again.content != first_pid


@pytest.mark.loopback
@pytest.mark.anyio
async def test_a_stdio_servers_stderr_reaches_the_log_sanitised_capped_and_rate_limited():
    from structlog.testing import capture_logs

    from whet.runtime.stderr_relay import BURST, LINE_CHARS

    config = specs({"peer": {"command": sys.executable, "args": [str(ECHO_SERVER)]}})
    with capture_logs() as logs:
        async with ToolPool(config, restart_backoff_min=5.0) as pool:
            relay = pool._links[0].stderr
            assert (await pool.call("spew", {"lines": 2000, "size": 5000})).content == "spewed"  # 10 MB
            await pool.call("exit", {})  # the process ends, so does its stderr
            assert await anyio.to_thread.run_sync(relay.done.wait, DEADLINE)
    lines = [entry["line"] for entry in logs if entry["event"] == "mcp.server.stderr"]
    assert BURST <= len(lines) < 2000 and relay.dropped + relay.logged >= 2000
    assert all(len(line) <= LINE_CHARS + 40 and "\x1b" not in line and "\x00" not in line for line in lines)
    assert sum(entry["lines"] for entry in logs if entry["event"] == "mcp.server.stderr_dropped") == relay.dropped
    assert sum(len(line) for line in lines) < 2000 * 5000 // 10


def two_stdio_peers() -> list[McpServerSpec]:
    peer = {"command": sys.executable, "args": [str(ECHO_SERVER)]}
    return specs({"alpha": peer, "beta": peer})


@pytest.mark.loopback
@pytest.mark.anyio
async def test_a_stdio_server_killed_from_outside_is_an_error_at_once_and_is_restarted_while_another_serves():
    async with ToolPool(two_stdio_peers(), call_timeout=10.0, restart_backoff_min=0.05,
                        restart_backoff_max=1.0) as pool:  # fmt: skip
        assert pool.status() == {"alpha": "ready", "beta": "ready"}
        victim = int((await pool.call("alpha__pid", {})).content)
        os.kill(victim, signal.SIGKILL)
        with anyio.fail_after(5.0):  # well inside call_timeout: a dead link is known, not waited out
            gone = await pool.call("alpha__echo", {"text": "anyone?"})
            assert gone.is_error
            other = await pool.call("beta__echo", {"text": "still here"})
        assert (other.is_error, other.content) == (False, "still here")
        await wait_until(pool, lambda: pool.status()["alpha"] == "ready")
        again = await pool.call("alpha__pid", {})
        assert not again.is_error and int(again.content) != victim


@pytest.mark.loopback
@pytest.mark.anyio
async def test_a_hung_stdio_server_delays_neither_other_calls_nor_other_servers():
    timeout = 6.0  # far above an echo's round trip on a loaded machine, so "delayed by the wedge" cannot pass
    async with ToolPool(two_stdio_peers(), call_timeout=timeout, restart_backoff_min=0.05,
                        restart_backoff_max=1.0) as pool:  # fmt: skip
        answers: dict[str, object] = {}

        async def call(key: str, name: str, arguments: dict) -> None:
            started = anyio.current_time()
            answer = await pool.call(name, arguments)
            answers[key] = (answer, anyio.current_time() - started, anyio.current_time())

        with anyio.fail_after(DEADLINE):
            async with anyio.create_task_group() as group:
                group.start_soon(call, "wedged", "alpha__wedge", {})
                await anyio.sleep(0.3)  # the wedge call is in flight
                for n in range(5):
                    group.start_soon(call, f"beta{n}", "beta__echo", {"text": f"beta {n}"})
        wedged, waited, wedge_ended = answers["wedged"]
        assert wedged.is_error and "timed out" in wedged.content and timeout <= waited < timeout + 3.0
        for n in range(5):
            answer, took, ended = answers[f"beta{n}"]
            assert (answer.is_error, answer.content) == (False, f"beta {n}")
            assert ended < wedge_ended and took < timeout / 2  # answered while alpha was still wedged
        await wait_until(pool, lambda: pool.status()["alpha"] != "ready")  # found dead, restarted
        await wait_until(pool, lambda: pool.status()["alpha"] == "ready")
        assert (await pool.call("alpha__echo", {"text": "back"})).content == "back"
