"""A small MCP server for pool tests: echo, whoami, structured, fail, slow, big, pid, grow, exit, garbage, wedge, spew.

Run as a stdio server with ``python tests/peers/echo_server.py`` (add
``--handshake-only`` to speak only the pre-2026 handshake era); import
:func:`build_server` to connect in-process. Imports only ``mcp``.
"""

from __future__ import annotations

import os
import sys

import anyio
import mcp_types as types
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError


def build_server(name: str = "echo") -> MCPServer:
    """A fresh server; each one keeps its own tool list (``grow`` adds to it)."""
    server = MCPServer(name)

    @server.tool()
    def echo(text: str) -> str:
        """Return the text unchanged."""
        return text

    @server.tool()
    def whoami() -> str:
        """The name this server was built with."""
        return name

    @server.tool()
    def structured() -> types.CallToolResult:
        """A result with structured content and no text."""
        return types.CallToolResult(content=[], structured_content={"answer": 42})

    @server.tool()
    def fail(message: str) -> str:
        """Fail with the given message."""
        raise ToolError(message)

    @server.tool()
    async def slow(seconds: float) -> str:
        """Sleep, then answer."""
        await anyio.sleep(seconds)
        return "done"

    @server.tool()
    def big(size: int) -> str:
        """Return ``size`` characters."""
        return "x" * size

    @server.tool()
    def pid() -> int:
        """The server's process id."""
        return os.getpid()

    @server.tool()
    async def grow(ctx: Context, tool: str) -> str:
        """Add a tool named ``tool`` and tell the client the tool list changed."""

        def added() -> str:
            return f"{tool} works"

        server.add_tool(added, name=tool, description=f"Added at runtime: {tool}")
        await ctx.notify_tools_changed()  # 2026-07-28 clients: their listen stream
        await ctx.session.send_tool_list_changed()  # earlier clients: a plain notification
        return f"added {tool}"

    @server.tool()
    def garbage(newline: bool = False, kind: str = "utf8") -> str:
        """Write garbage onto the wire (before this call's own answer), then answer: bytes that are
        not UTF-8 (``utf8``), a line of plain text (``text``) or a JSON-RPC message cut off (``half-json``)."""
        from mcp.server import stdio  # the transport serves the wire from a private copy of fd 1

        claim = stdio._claims.get(1)
        wire = claim.private_fd if claim is not None and claim.private_fd is not None else 1
        payload = {"utf8": b"\xff\xfe\x80 not utf-8", "text": b"Server ready, listening on stdio!",
                   "half-json": b'{"jsonrpc": "2.0", "id": 7, "result": {"content": [{"type": "te'}[kind]  # fmt: skip
        os.write(wire, payload + (b"\n" if newline else b""))
        return "wrote garbage"

    @server.tool()
    def spew(lines: int, size: int) -> str:
        """Write ``lines`` lines of ``size`` bytes of garbage (control characters, invalid UTF-8) to stderr."""
        line = (b"\x1b[31m\x00\xff" + b"g" * size)[:size] + b"\n"
        for _ in range(lines):
            os.write(2, line)
        return "spewed"

    @server.tool()
    async def wedge() -> str:
        """Block the server's event loop for good: the process lives on but never answers again."""
        import time

        while True:
            time.sleep(3600)

    @server.tool()
    def exit(code: int = 3) -> str:
        """End the server process at once, without answering."""
        os._exit(code)

    return server


async def serve_handshake_era_only(server: MCPServer) -> None:
    """Serve stdio the way pre-2026 servers do: initialize handshake only, no listen streams."""
    from mcp.server.runner import serve_loop
    from mcp.server.stdio import stdio_server

    lowlevel = server._lowlevel_server
    async with stdio_server() as (read_stream, write_stream), lowlevel.lifespan(lowlevel) as state:
        options = lowlevel.create_initialization_options()
        await serve_loop(lowlevel, read_stream, write_stream, lifespan_state=state, init_options=options)


if __name__ == "__main__":
    if "--handshake-only" in sys.argv:
        anyio.run(serve_handshake_era_only, build_server())
    else:
        build_server().run()
