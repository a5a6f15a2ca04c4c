"""A stdio MCP server's stderr, relayed into whet's log: line by line, sanitised, capped, rate-limited.

A server's stderr is not whet's to trust: handed straight to our stderr, 5 MB of garbage made a
5 MB log. Here the child writes into a pipe; a thread reads it and logs each line as
``mcp.server.stderr`` with control characters replaced and at most :data:`LINE_CHARS` characters,
at most :data:`BURST` lines at once and :data:`RATE` a second after that (a token bucket). What
is dropped is counted and said in one ``mcp.server.stderr_dropped`` line.
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import IO

import structlog

log = structlog.get_logger("whet.runtime.tools")

LINE_CHARS = 500
BURST = 50
RATE = 10.0  # lines a second, once the burst is spent
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


class StderrRelay:
    """Give :attr:`writer` to the child as its stderr, then call :meth:`spawned`; the relay ends at EOF."""

    def __init__(self, server: str) -> None:
        self.server = server
        read_fd, write_fd = os.pipe()
        self.writer: IO[str] = os.fdopen(write_fd, "w")
        self._reader = os.fdopen(read_fd, "rb", buffering=0)
        self.logged = 0
        self.dropped = 0
        self.done = threading.Event()
        self._tokens, self._stamp, self._unsaid = float(BURST), time.monotonic(), 0
        threading.Thread(target=self._run, name=f"mcp-stderr-{server}", daemon=True).start()

    def spawned(self) -> None:
        """Close our copy of the write end: the child holds its own, and its exit then ends the relay."""
        if not self.writer.closed:
            self.writer.close()

    def _run(self) -> None:
        pending, skipping = b"", False
        try:
            while chunk := self._reader.read(65536):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if skipping:  # the rest of a line already cut
                        skipping = False
                        continue
                    self._line(line)
                if len(pending) > 4 * LINE_CHARS:  # a line with no end in sight: cut it, drop the rest
                    if not skipping:
                        self._line(pending)
                    pending, skipping = b"", True
            if pending and not skipping:
                self._line(pending)
        except (OSError, ValueError) as exc:
            log.warning("mcp.server.stderr_failed", server=self.server, error=repr(exc))
        finally:
            self._say_dropped()
            self._reader.close()
            self.done.set()

    def _line(self, raw: bytes) -> None:
        now = time.monotonic()
        self._tokens = min(float(BURST), self._tokens + (now - self._stamp) * RATE)
        self._stamp = now
        if self._tokens < 1.0:
            self.dropped += 1
            self._unsaid += 1
            return
        self._tokens -= 1.0
        self._say_dropped()
        text = _CONTROL.sub("?", raw.decode("utf-8", errors="replace").rstrip("\r"))
        if len(text) > LINE_CHARS:
            text = f"{text[:LINE_CHARS]}... ({len(text)} characters)"
        self.logged += 1
        log.info("mcp.server.stderr", server=self.server, line=text)

    def _say_dropped(self) -> None:
        if self._unsaid:
            log.warning("mcp.server.stderr_dropped", server=self.server, lines=self._unsaid,
                        note=f"over {RATE:g} lines a second")  # fmt: skip
            self._unsaid = 0
