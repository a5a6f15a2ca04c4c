"""Tiny MCP servers the tests talk to (in-process or as stdio subprocesses)."""
