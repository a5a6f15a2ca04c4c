"""MCP server files: the ``mcpServers`` JSON that Claude Desktop and Cursor use.

A file maps server names to either a command to launch over stdio
(``command``, ``args``, ``env``, ``cwd``) or a URL to reach over HTTP
(``url``, ``headers``, ``type``). VS Code's shape (top-level ``servers``,
``"type": "stdio" | "http" | "sse"``, comments and trailing commas) reads the
same. Per server whet also honours ``disabled``, ``allowedTools``,
``disabledTools`` and ``timeout`` (seconds).

Every string may use ``${VAR}``, ``${VAR:-default}`` or VS Code's
``${env:VAR}``; the values come from the ``variables`` the entrypoint passes,
never from the environment read here. Every problem raises
:class:`~whet.config.settings.ConfigError` naming the key path and the fix.
Unknown per-server keys other clients use (``description``, ``envFile``, ...)
are ignored with a warning, so a file copied from another client still loads.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field

from whet.config.jsontext import JsonTextError, parse_json
from whet.config.settings import ConfigError

log = structlog.get_logger(__name__)

_KNOWN_KEYS = frozenset(
    {"command", "args", "env", "cwd", "url", "headers", "type"}
    | {"disabled", "allowedTools", "disabledTools", "timeout"}
)
_Kind = Literal["stdio", "http", "sse"]
_TYPES: dict[str, _Kind] = {
    "stdio": "stdio",
    "http": "http",
    "streamable-http": "http",
    "streamable_http": "http",
    "streamableHttp": "http",
    "sse": "sse",
}
_REFERENCE = re.compile(r"\$\{([^}]*)\}")
_VARIABLE = re.compile(r"(?:env:)?([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?", re.DOTALL)


class StdioTransport(BaseModel):
    """Launch ``command args...`` and speak MCP over its stdin/stdout."""

    model_config = ConfigDict(frozen=True)

    command: str
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: Path | None = None


class HttpTransport(BaseModel):
    """Reach a running server: streamable HTTP (``http``) or the older ``sse``."""

    model_config = ConfigDict(frozen=True)

    url: str
    headers: dict[str, str] = Field(default_factory=dict)
    type: Literal["http", "sse"] = "http"


class McpServerSpec(BaseModel):
    """One server entry, variables expanded. ``timeout`` None means the pool's default."""

    model_config = ConfigDict(frozen=True)

    name: str
    transport: StdioTransport | HttpTransport
    disabled: bool = False
    allowed_tools: list[str] | None = None
    disabled_tools: list[str] = Field(default_factory=list)
    timeout: float | None = None


def load_mcp_servers(path: Path, variables: Mapping[str, str]) -> list[McpServerSpec]:
    """Read and parse an MCP server file; raises ConfigError on any problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        problem = f"cannot read the MCP server file ({reason})"
        raise ConfigError(str(path), problem, "set mcp.config to an existing JSON file") from None
    try:
        data = parse_json(_strip_jsonc(text))
    except JsonTextError as exc:
        raise ConfigError(str(path), f"not valid JSON: {exc}", "fix the JSON syntax at the position shown") from None
    return parse_mcp_servers(data, variables, str(path))


def parse_mcp_servers(data: Any, variables: Mapping[str, str], source: str) -> list[McpServerSpec]:
    """Turn a parsed MCP server file into specs, in file order (disabled ones included)."""
    if not isinstance(data, dict):
        fix = 'start the file with {"mcpServers": {...}}'
        raise ConfigError(source, "the top level must be a JSON object", fix)
    if "mcpServers" in data and "servers" in data:
        problem = f"both 'mcpServers' and 'servers' are present in {source}"
        raise ConfigError("servers", problem, "keep one of the two keys")
    root = "mcpServers" if "mcpServers" in data else "servers"
    if root not in data:
        raise ConfigError(
            "mcpServers",
            f"{source} has no 'mcpServers' (or VS Code 'servers') object",
            'add {"mcpServers": {"name": {"command": "..."}}}, or {"mcpServers": {}} for no servers',
        )
    servers = data[root]
    if not isinstance(servers, dict):
        raise ConfigError(root, f"must be an object of name -> server (in {source})", 'write {"name": {...}}')
    readers = [_EntryReader(name, entry, root, variables, source) for name, entry in servers.items()]
    return [_parse_entry(reader) for reader in readers]


def _parse_entry(reader: _EntryReader) -> McpServerSpec:
    name, entry, key, source = reader.name, reader.entry, reader.key, reader.source
    if not name.strip():
        raise ConfigError(key, f"a server has an empty name (in {source})", "give every server a name")
    if not _is_text(name):
        raise ConfigError(key, f"the server name holds a NUL or a lone surrogate (in {source})", "rename the server")
    if not isinstance(entry, dict):
        fix = 'write {"command": "..."} or {"url": "..."}'
        raise ConfigError(key, f"must be an object (in {source})", fix)
    for unknown in sorted(set(entry) - _KNOWN_KEYS):
        log.warning("mcp.config.unknown_key", key=f"{key}.{unknown}", source=source)
    return McpServerSpec(
        name=name,
        transport=_transport(reader),
        disabled=reader.boolean("disabled"),
        allowed_tools=reader.strings("allowedTools") if "allowedTools" in entry else None,
        disabled_tools=reader.strings("disabledTools"),
        timeout=reader.seconds("timeout"),
    )


def _transport(reader: _EntryReader) -> StdioTransport | HttpTransport:
    entry = reader.entry
    kind = _kind(reader)
    if kind == "stdio":
        if "command" not in entry:
            fix = 'add "command": "program to run"'
            raise reader.error("command", "a stdio server needs a 'command'", fix)
        return StdioTransport(
            command=reader.text("command", required=True),
            args=reader.strings("args"),
            env=reader.mapping("env"),
            cwd=reader.directory("cwd") if "cwd" in entry else None,
        )
    if "url" not in entry:
        raise reader.error("url", f"an {kind} server needs a 'url'", 'add "url": "http://host:port/mcp"')
    url = reader.text("url", required=True)
    if not url.startswith(("http://", "https://")):
        raise reader.error("url", f"'{url}' is not an http(s) URL", "use http://... or https://...")
    return HttpTransport(url=url, headers=reader.mapping("headers"), type=kind)


def _kind(reader: _EntryReader) -> _Kind:
    entry = reader.entry
    if "type" in entry:
        declared = reader.text("type")
        if declared not in _TYPES:
            raise reader.error("type", f"unknown type '{declared}'", "use one of: stdio, http, sse")
        return _TYPES[declared]
    if "command" in entry and "url" in entry:
        fix = 'keep one, or set "type" to "stdio", "http" or "sse"'
        raise reader.error("command", "has both 'command' and 'url'", fix)
    if "command" in entry:
        return "stdio"
    if "url" in entry:
        return "http"
    raise ConfigError(
        reader.key,
        f"has neither 'command' nor 'url' (in {reader.source})",
        'add "command" (and "args") to launch a local server, or "url" to reach a running one',
    )


class _EntryReader:
    """Typed, variable-expanded reads of one server entry; errors carry the key path."""

    def __init__(self, name: str, entry: Any, root: str, variables: Mapping[str, str], source: str) -> None:
        self.name, self.entry, self.key = name, entry, f"{root}.{_shown(name)}"
        self.variables, self.source = variables, source

    def error(self, field: str, problem: str, fix: str) -> ConfigError:
        return ConfigError(f"{self.key}.{_shown(field)}", f"{problem} (in {self.source})", fix)

    def wrong_type(self, field: str, expected: str, value: Any, fix: str) -> ConfigError:
        return self.error(field, f"must be {expected}, got {_json_kind(value)}", fix)

    def text(self, field: str, *, required: bool = False) -> str:
        value = self.entry.get(field)
        if not isinstance(value, str):
            raise self.wrong_type(field, "a string", value, f'write "{field}": "..."')
        expanded = self.expand(value, field)
        if required and not expanded.strip():
            raise self.error(field, "is empty", f"set {field} to a non-empty value")
        return expanded

    def directory(self, field: str) -> Path | None:
        value = self.text(field)
        try:
            return Path(value).expanduser() if value else None
        except RuntimeError:  # ~name of no user here
            raise self.error(field, f"'{value.split('/')[0]}' names no user on this machine", "use ~/ or a full path") from None

    def strings(self, field: str) -> list[str]:
        value = self.entry.get(field, [])
        if not isinstance(value, list):
            raise self.wrong_type(field, "a list of strings", value, f'write "{field}": ["..."]')
        out = []
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise self.wrong_type(f"{field}[{i}]", "a string", item, 'quote it, e.g. "8080"')
            out.append(self.expand(item, f"{field}[{i}]"))
        return out

    def mapping(self, field: str) -> dict[str, str]:
        value = self.entry.get(field, {})
        if not isinstance(value, dict):
            raise self.wrong_type(field, "an object of strings", value, f'write "{field}": {{}}')
        out = {}
        for name, item in value.items():
            self.checked(name, f"{field}.{name}")
            if not isinstance(item, str):
                raise self.wrong_type(f"{field}.{name}", "a string", item, 'quote it, e.g. "1"')
            out[name] = self.expand(item, f"{field}.{name}")
        return out

    def boolean(self, field: str) -> bool:
        value = self.entry.get(field, False)
        if not isinstance(value, bool):
            raise self.wrong_type(field, "true or false", value, f'write "{field}": true')
        return value

    def seconds(self, field: str) -> float | None:
        value = self.entry.get(field)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            problem = f"must be a positive number of seconds, got {json.dumps(value)}"
            raise self.error(field, problem, f'write "{field}": 30')
        return float(value)

    def expand(self, value: str, field: str) -> str:
        """Replace ``${VAR}``, ``${VAR:-default}`` and ``${env:VAR}`` from the variables."""

        def substitute(match: re.Match[str]) -> str:
            parsed = _VARIABLE.fullmatch(match.group(1))
            if parsed is None:
                raise self.error(
                    field,
                    f"'{match.group(0)}' is not a variable reference whet understands",
                    "use ${VAR}, ${VAR:-default} or ${env:VAR}",
                )
            name, default = parsed.group(1), parsed.group(2)
            found = self.variables.get(name)
            if found:
                return found
            if default is not None:
                return default
            if found is not None:
                return found
            raise self.error(
                field,
                f"variable '{name}' is not defined (server '{self.name}')",
                f"set {name} in the environment, or write ${{{name}:-default}}",
            )

        return self.checked(_REFERENCE.sub(substitute, value), field)

    def checked(self, value: str, field: str) -> str:
        """No command, argument, variable, path, URL or header can carry a NUL or a lone surrogate (a
        ``\\ud800`` escape is valid JSON but not text): refused here, not at launch or on the wire."""
        if "\x00" in value:
            raise self.error(field, "contains a NUL character", "remove it (or the variable that holds it)")
        if not _is_text(value):
            problem = "contains a lone surrogate (a \\ud800-\\udfff escape without its pair), which is not text"
            raise self.error(field, problem, "write the character itself, or a surrogate pair")
        return value


_JSON_KINDS = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list"}


def _json_kind(value: Any) -> str:
    """'a number', 'an object', ...: the JSON kind of a parsed value, for error messages."""
    if value is None:
        return "null"
    return "an object" if isinstance(value, dict) else _JSON_KINDS.get(type(value), type(value).__name__)


def _is_text(value: str) -> bool:
    """No NUL and no lone surrogate: a string that can reach argv, an environment, a URL or a log."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in value


def _shown(key: str) -> str:
    """A key as an error shows it: any JSON string, with a lone surrogate escaped so the message prints."""
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def _strip_jsonc(text: str) -> str:
    """Blank out // and /* */ comments, then trailing commas, outside strings.

    Every removed character becomes a space (newlines stay), so JSON error
    positions still point into the original file.
    """
    out = list(text)
    for start, end, kind in _scan(text):
        if kind == "comment":
            out[start:end] = [c if c == "\n" else " " for c in text[start:end]]
    cleaned = "".join(out)
    for start, _, kind in _scan(cleaned):
        if kind == "comma":
            following = start + 1
            while following < len(cleaned) and cleaned[following].isspace():
                following += 1
            if following < len(cleaned) and cleaned[following] in "}]":
                out[start] = " "
    return "".join(out)


def _scan(text: str) -> list[tuple[int, int, str]]:
    """Spans of comments and commas that lie outside JSON strings."""
    spans, i, n, in_string = [], 0, len(text), False
    while i < n:
        char = text[i]
        if in_string:
            if char == "\\":
                i += 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif text.startswith("//", i) or text.startswith("/*", i):
            close = "\n" if text[i + 1] == "/" else "*/"
            end = text.find(close, i + 2)
            end = n if end == -1 else end + (0 if close == "\n" else 2)
            spans.append((i, end, "comment"))
            i = end
            continue
        elif char == ",":
            spans.append((i, i + 1, "comma"))
        i += 1
    return spans
