"""whet.servers: the bundled MCP tool servers, each its own process over stdio.

`notes` (notes and todo lists in SQLite), `calc` (arithmetic and unit conversion),
`clock` (time, dates, timezones). Each module has a `build_server(...)` factory
returning an `MCPServer` and runs with `python -m whet.servers.NAME`. They import
only `mcp` and the standard library, never other whet packages.
"""
