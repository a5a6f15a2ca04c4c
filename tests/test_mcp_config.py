"""Reading MCP server files: both shapes, variables, filters, and errors that name the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from whet.config.mcp import HttpTransport, StdioTransport, load_mcp_servers, parse_mcp_servers
from whet.config.settings import ConfigError, shipped_path


def parse(servers: dict, variables: dict[str, str] | None = None, root: str = "mcpServers"):
    return parse_mcp_servers({root: servers}, variables or {}, "test.json")


def config_error(servers: dict, variables: dict[str, str] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        parse(servers, variables)
    return caught.value


def test_claude_desktop_shape_reads_stdio_and_http_servers():
    specs = parse(
        {
            "time": {
                "command": "uvx",
                "args": ["mcp-server-time", "--local-timezone=UTC"],
                "env": {"A": "1"},
                "autoApprove": [],  # another client's key: ignored, not an error
            },
            "remote": {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer x"}},
        }
    )
    assert [spec.name for spec in specs] == ["time", "remote"]
    assert specs[0].transport == StdioTransport(
        command="uvx", args=["mcp-server-time", "--local-timezone=UTC"], env={"A": "1"}
    )
    assert specs[1].transport == HttpTransport(
        url="https://example.com/mcp", headers={"Authorization": "Bearer x"}, type="http"
    )
    assert not specs[0].disabled and specs[0].allowed_tools is None and specs[0].timeout is None


def test_vscode_shape_with_types_comments_and_trailing_commas_loads(tmp_path: Path):
    path = tmp_path / "mcp.json"
    path.write_text(
        """{
          // VS Code allows comments and trailing commas
          "servers": {
            "local": {"type": "stdio", "command": "node", "args": ["server.js",],},
            "remote": {"type": "http", "url": "http://127.0.0.1:9000/mcp"}, /* streamable */
            "legacy": {"type": "sse", "url": "http://127.0.0.1:9001/sse"},
            "quoted": {"command": "echo", "args": ["// not a comment", "a,]"]},
          },
        }"""
    )
    specs = {spec.name: spec for spec in load_mcp_servers(path, {})}
    assert specs["local"].transport == StdioTransport(command="node", args=["server.js"])
    assert specs["remote"].transport == HttpTransport(url="http://127.0.0.1:9000/mcp", type="http")
    assert specs["legacy"].transport == HttpTransport(url="http://127.0.0.1:9001/sse", type="sse")
    assert specs["quoted"].transport.args == ["// not a comment", "a,]"]


def test_variables_expand_in_every_string_with_defaults():
    variables = {"PY": "/usr/bin/python3", "TOKEN": "s3cret", "EMPTY": ""}
    (stdio, http) = parse(
        {
            "local": {
                "command": "${PY}",
                "args": ["-m", "srv", "--db=${DATA:-/tmp/data}/x.db"],
                "env": {"KEY": "${env:TOKEN}", "MODE": "${EMPTY:-fallback}"},
                "cwd": "${WORKDIR:-~/work}",
            },
            "remote": {
                "url": "http://${HOST:-localhost}:8000/mcp",
                "headers": {"Authorization": "Bearer ${TOKEN}"},
            },
        },
        variables,
    )
    assert stdio.transport.command == "/usr/bin/python3"
    assert stdio.transport.args == ["-m", "srv", "--db=/tmp/data/x.db"]
    assert stdio.transport.env == {"KEY": "s3cret", "MODE": "fallback"}
    assert stdio.transport.cwd == Path("~/work").expanduser()
    assert stdio.transport.cwd.is_absolute()
    assert http.transport.url == "http://localhost:8000/mcp"
    assert http.transport.headers == {"Authorization": "Bearer s3cret"}


def test_undefined_variable_names_the_server_the_key_and_the_variable():
    error = config_error({"notes": {"command": "python", "env": {"DB": "${NOTES_DB}/n.db"}}})
    assert error.key == "mcpServers.notes.env.DB"
    assert "NOTES_DB" in error.problem and "notes" in error.problem
    assert "${NOTES_DB:-" in error.fix


def test_disabled_and_tool_filters_and_timeout_are_read():
    (spec,) = parse(
        {
            "fs": {
                "command": "fs-server",
                "disabled": True,
                "allowedTools": ["read", "list"],
                "disabledTools": ["list"],
                "timeout": 5,
            }
        }
    )
    assert spec.disabled is True
    assert spec.allowed_tools == ["read", "list"]
    assert spec.disabled_tools == ["list"]
    assert spec.timeout == 5.0


def test_shipped_file_lists_the_bundled_servers():
    specs = load_mcp_servers(shipped_path("mcp.json"), {"WHET_PYTHON": "/py", "WHET_DATA_DIR": "/data"})
    assert {spec.name for spec in specs} == {"notes", "calc", "clock"}
    notes = next(spec for spec in specs if spec.name == "notes")
    assert notes.transport.command == "/py"
    assert notes.transport.env == {"WHET_NOTES_DB": "/data/notes.db"}


@pytest.mark.parametrize(
    ("servers", "key", "words"),
    [
        ({"x": {"args": ["a"]}}, "mcpServers.x", "neither 'command' nor 'url'"),
        ({"x": {"type": "websocket", "url": "ws://h"}}, "mcpServers.x.type", "unknown type 'websocket'"),
        ({"x": {"command": "run", "args": "--flag"}}, "mcpServers.x.args", "list of strings"),
        ({"x": {"command": "run", "args": ["--port", 8080]}}, "mcpServers.x.args[1]", "must be a string"),
        ({"x": {"command": "run", "env": {"PORT": 8080}}}, "mcpServers.x.env.PORT", "must be a string"),
        ({"x": {"command": 42}}, "mcpServers.x.command", "must be a string"),
        ({"x": {"command": "run", "timeout": -1}}, "mcpServers.x.timeout", "positive number"),
        ({"x": {"command": "run", "disabled": "yes"}}, "mcpServers.x.disabled", "true or false"),
        ({"x": {"command": "run", "allowedTools": "read"}}, "mcpServers.x.allowedTools", "list of strings"),
        ({"x": {"command": "run", "url": "http://h"}}, "mcpServers.x.command", "both 'command' and 'url'"),
        ({"x": {"type": "http", "command": "run"}}, "mcpServers.x.url", "needs a 'url'"),
        ({"x": {"url": "ftp://h"}}, "mcpServers.x.url", "not an http(s) URL"),
        ({"x": {"command": "run", "args": ["${in:k}"]}}, "mcpServers.x.args[0]", "not a variable reference"),
        ({"x": "python server.py"}, "mcpServers.x", "must be an object"),
    ],
)
def test_bad_entries_raise_config_error_naming_the_key(servers, key, words):
    error = config_error(servers)
    assert error.key == key
    assert words in error.problem
    assert error.fix
    assert "test.json" in error.problem


def test_a_file_without_a_servers_object_says_what_to_add():
    with pytest.raises(ConfigError) as caught:
        parse_mcp_servers({"mcpservers": {}}, {}, "test.json")
    assert caught.value.key == "mcpServers"
    assert "mcpServers" in caught.value.fix


def test_a_file_with_both_root_keys_is_refused():
    with pytest.raises(ConfigError) as caught:
        parse_mcp_servers({"mcpServers": {}, "servers": {}}, {}, "test.json")
    assert "both" in caught.value.problem


def test_unreadable_file_and_bad_json_raise_config_error(tmp_path: Path):
    with pytest.raises(ConfigError) as missing:
        load_mcp_servers(tmp_path / "absent.json", {})
    assert "cannot read" in missing.value.problem
    assert missing.value.key.endswith("absent.json")

    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"mcpServers": {}})[:-1] + "\n")
    with pytest.raises(ConfigError) as bad:
        load_mcp_servers(broken, {})
    assert "not valid JSON" in bad.value.problem and "line" in bad.value.problem


def _readme_mcp_example() -> str:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("### MCP servers"):]
    return section[section.index("```json") + len("```json"):section.index("```", section.index("```json") + 7)]


@pytest.mark.anyio
async def test_the_readmes_mcp_example_works_as_pasted(tmp_path):
    """Copied as is, with none of its optional variables set: it loads, keeps notes in whet's data
    directory, leaves the remote server off until it is configured, and every enabled server starts."""
    import sys

    from whet.runtime.tools import ToolPool

    path = tmp_path / "mcp.json"
    path.write_text(_readme_mcp_example())
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    specs = load_mcp_servers(path, {"WHET_PYTHON": sys.executable, "WHET_DATA_DIR": str(data_dir)})
    by_name = {spec.name: spec for spec in specs}
    assert set(by_name) == {"time", "git", "notes", "remote"}
    assert isinstance(by_name["remote"].transport, HttpTransport) and by_name["remote"].disabled
    assert by_name["notes"].transport.args[-1] == f"{data_dir}/notes.db"
    async with ToolPool(specs, start_timeout=60) as pool:
        assert pool.status() == {"time": "ready", "git": "ready", "notes": "ready"}, pool.status()
        assert {"get_current_time", "git_status", "add_note"} <= {tool.name for tool in pool.tools()}
