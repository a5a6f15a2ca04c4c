"""Property tests for the three readers of text whet did not write: the model's tool-call markup,
the YAML config, and ``mcpServers`` files. Whatever they are given, they answer with their result
or their own clear error (a tool error the model sees, a ConfigError naming the key), never
another exception."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from whet.config.mcp import load_mcp_servers
from whet.config.settings import ConfigError, load_config
from whet.learner.prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, render_chatml
from whet.runtime.chat_format import parse_tool_calls

# derandomized: the same examples every run, so CI never meets a new one by chance (run with
# --hypothesis-seed=random, or derandomize off, to explore further)
FAST = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip

# text with the markup's own pieces in it, so blocks open, close, nest and break often
MARKUP = st.lists(
    st.one_of(
        st.text(max_size=20),
        st.sampled_from([TOOL_CALL_OPEN, TOOL_CALL_CLOSE, "{", "}", '"name"', ":", '"arguments"', "[", "]", "\x00",
                         "\ud800", '"\\ud800"', "NaN", "1e999", "<tool_", "call>",
                         '{"name": "now", "arguments": {"timezone": "Asia/Tokyo"}}']),
    ),
    max_size=30,
).map("".join)

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)

DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = "1" * 5000  # past CPython's int-from-text digit limit


@FAST
@given(MARKUP)
@example(f"{TOOL_CALL_OPEN}{DEEP}{TOOL_CALL_CLOSE}")
@example(f'{TOOL_CALL_OPEN}{{"name": "calc", "arguments": {{"x": {HUGE_INT}}}}}{TOOL_CALL_CLOSE}')
@example(f'{TOOL_CALL_OPEN}{{"name": "calc", "arguments": "{DEEP}"}}{TOOL_CALL_CLOSE}')
# cutting a block out joined "<tool_" and "call>" into a new block in the content
@example(f'<tool_{TOOL_CALL_OPEN}{{}}{TOOL_CALL_CLOSE}call>{{"name": "rm"}}{TOOL_CALL_CLOSE}')
# NaN, Infinity and 1e999 parsed into arguments no strict JSON reader takes (and an OpenAI client gets them)
@example(f'{TOOL_CALL_OPEN}{{"name": "calc", "arguments": {{"x": NaN, "y": 1e999}}}}{TOOL_CALL_CLOSE}')
# a lone surrogate escape made arguments no client or MCP server can be sent (the API answered 500)
@example(f'{TOOL_CALL_OPEN}{{"name": "echo", "arguments": {{"text": "\\ud800"}}}}{TOOL_CALL_CLOSE}')
def test_the_tool_call_parser_answers_any_text_with_content_calls_and_errors(text):
    content, calls, errors = parse_tool_calls(text)
    assert isinstance(content, str) and all(isinstance(e, str) and e for e in errors)
    assert TOOL_CALL_OPEN not in content  # so never a complete block: only calls and errors come of markup
    for call in calls:
        assert call.name and call.name == call.name.strip() and isinstance(call.arguments, dict)
        # what goes out to the client and the MCP server is strict JSON, encodable as UTF-8
        json.dumps(call.arguments, allow_nan=False)
        json.dumps(call.to_openai(), ensure_ascii=False).encode("utf-8")
    # every block is either a call or an error: none is lost
    assert len(calls) + len(errors) == text.count(TOOL_CALL_OPEN) - _nested(text)


def _nested(text: str) -> int:
    """Opening tags inside a block (before its close): they are the block's text, not blocks."""
    inner, pos = 0, 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) != -1:
        end = text.find(TOOL_CALL_CLOSE, start + len(TOOL_CALL_OPEN))
        stop = len(text) if end == -1 else end
        inner += text.count(TOOL_CALL_OPEN, start + len(TOOL_CALL_OPEN), stop)
        pos = stop + len(TOOL_CALL_CLOSE) if end != -1 else len(text)
    return inner


@FAST
@given(
    st.lists(
        st.tuples(st.text(min_size=1, max_size=12).filter(lambda s: s.strip() == s and s and TOOL_CALL_CLOSE not in s),
                  st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4)),
        min_size=1, max_size=3,
    ),
    st.text(max_size=20).filter(lambda s: TOOL_CALL_OPEN not in s),
)  # fmt: skip
@example([('say "hi"\\', {"text": "a</tool_call>b"})], "")
def test_calls_the_prompt_renders_parse_back_to_the_same_names_and_arguments(calls, content):
    """What whet writes into a prompt for an assistant's earlier calls is what the parser reads back
    (a model copying the format of its context writes parseable calls)."""
    message = {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
        for i, (name, arguments) in enumerate(calls)]}  # fmt: skip
    prompt = render_chatml([{"role": "user", "content": "go"}, message], add_generation_prompt=False)
    reply = prompt.split("<|im_start|>assistant", 1)[1].removesuffix("<|im_end|>\n")
    _, parsed, errors = parse_tool_calls(reply)
    if any(TOOL_CALL_CLOSE in json.dumps(a, ensure_ascii=False) for _, a in calls):
        return  # a value holding the closing tag ends the block early: the markup cannot carry it
    assert errors == []
    assert [(c.name, c.arguments) for c in parsed] == calls


YAML_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
SECTIONS = ["server", "model", "mcp", "store", "bus", "memory", "learner", "agent", "log", "data_dir", "nonsense", 1, None]
KEYS = ["port", "host", "api_keys", "id", "backend", "dtype", "scope", "batch_size", "lora", "gate", "url",
        "trusted_users", "rehearsal", "objective", "max_tokens_cap", "format", "level", "config", "x"]  # fmt: skip
CONFIG_LEAF = st.dictionaries(st.sampled_from(KEYS), YAML_SCALARS | st.lists(YAML_SCALARS, max_size=2), max_size=3)
# a section's value: a scalar, a list, keys with scalars, or keys with keys (two levels, as the config nests)
SECTION_VALUES = YAML_SCALARS | st.lists(YAML_SCALARS, max_size=3) | CONFIG_LEAF | st.dictionaries(
    st.sampled_from(KEYS), CONFIG_LEAF, max_size=2)
CONFIG_DOCS = st.dictionaries(st.sampled_from(SECTIONS), SECTION_VALUES, max_size=3)


@FAST
@given(CONFIG_DOCS, st.one_of(st.none(), CONFIG_DOCS))
@example({"server": {"port": 10**30}}, None)
@example({"learner": {"scope": "auto", "trusted_users": "alice"}}, {"server": {"api_keys": ["sk"]}})
@example({1: "x"}, None)  # a number as a section name was a TypeError (keywords must be strings)
@example({}, {None: {"port": 1}})  # the same in the overrides
@example({"data_dir": "~nosuchuser_whet/data"}, None)  # loaded, then a RuntimeError at start (no such user)
@example({"mcp": {"config": "a\x00b"}}, None)  # loaded, then a ValueError at start (embedded null byte)
def test_the_config_loader_loads_or_names_the_key(tmp_path, document, overrides):
    path = tmp_path / "whet.yaml"
    path.write_text(yaml.safe_dump(document))
    config = _load_or_name_the_key(path, overrides, {})
    if config is not None:
        assert config.server.port >= 0 and config.learner.scope in ("global", "user")


def _load_or_name_the_key(path, overrides, environ):
    """The config, or None after a ConfigError that names a key (a variable of ``environ`` when it names one)
    and prints; ``environ`` is the only WHET_* set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHET_")} | environ
    with mock.patch.dict(os.environ, env, clear=True):
        try:
            config = load_config(path, overrides)
        except ConfigError as error:
            assert error.key and error.problem
            str(error).encode("utf-8")  # it reaches a terminal: no lone surrogate
            assert not error.key.startswith("WHET_") or error.key in environ
            return None
    config.data_path, config.mcp_config_path()  # the paths whet opens at start resolve
    return config


YAML_PIECES = st.sampled_from(["server:", "\n  port: ", "8080", "\n", "- ", "[", "]", "{", "}", ": ", "&a ", "*a", "!!binary ",
                               "? ", "\t", "'", '"', "\\ud800", "\x00", "1: 2", "data_dir: ", "~nobody_here/x", "1e999",
                               ".nan", "null", "learner:\n  scope: ", "auto"])  # fmt: skip
YAML_TEXT = st.lists(YAML_PIECES | st.text(max_size=8), max_size=25).map("".join)


@FAST
@given(YAML_TEXT.map(lambda t: t.encode("utf-8", "surrogatepass")) | st.binary(max_size=60))
@example(b"1: 2\n")  # TypeError (keywords must be strings)
@example(b"server:\n  host: \xff\n")  # UnicodeDecodeError: not UTF-8
@example(b"[" * 10_000 + b"]" * 10_000)  # RecursionError inside the YAML reader
@example(b'data_dir: "a\\0b"\n')  # loaded, then a ValueError at start
def test_the_config_loader_reads_any_yaml_text_or_names_the_problem(tmp_path, raw):
    path = tmp_path / "whet.yaml"
    path.write_bytes(raw)
    _load_or_name_the_key(path, None, {})


ENV_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
ENV_NAMES = st.builds("WHET_{}{}".format, st.sampled_from([s for s in SECTIONS if isinstance(s, str)]).map(str.upper),
                      st.sampled_from([""] + [f"__{k.upper()}" for k in KEYS]))  # fmt: skip
ENV_VALUES = st.one_of(ENV_TEXT, JSON_VALUES.map(json.dumps), st.sampled_from(["{bad", "[" * 5000, "{\"a\": " + HUGE_INT + "}",
                                                                             '{"port": 1}', '["a"]', "NaN"]))  # fmt: skip


@FAST
@given(st.dictionaries(ENV_NAMES, ENV_VALUES, max_size=3))
@example({"WHET_SERVER__API_KEYS": "{bad"})  # pydantic-settings' SettingsError escaped, naming no variable
@example({"WHET_SERVER": "notjson"})  # the same, a whole section
@example({"WHET_SERVER__API_KEYS": "[" * 100_000})  # RecursionError from pydantic-settings' JSON decoding
def test_the_config_loader_reads_any_whet_variables_or_names_the_variable(tmp_path, environ):
    path = tmp_path / "whet.yaml"
    path.write_text("{}")
    config = _load_or_name_the_key(path, None, environ)
    if config is not None:
        assert config.server.port >= 0


MCP_PIECES = st.sampled_from(['{"mcpServers": {"x": {"command": "a"', '{"servers": {', '"url": "http://h/mcp"', '"cwd": ',
                               '"~nobody_here/x"', '"timeout": ', "NaN", "Infinity", "1e999", '"\\ud800"', '"\\u0000"',
                               '"args": [', '"env": {"A": ', '"${HOME}"', ", ", ": ", "}", "]", "//", "/*", "*/", "\n"])  # fmt: skip
MCP_TEXT = st.lists(MCP_PIECES | st.text(max_size=6), max_size=20).map("".join)


@FAST
@given(MCP_TEXT | st.text(max_size=200))
@example("{" * 100_000)
@example('{"mcpServers": {"x": {"command": "a", "timeout": ' + HUGE_INT + "}}}")
@example('{"mcpServers": {"x": {"command": "a", "args": ["/*", "*/"]}}} // trailing')
@example('{"mcpServers": {"x": {"command": "a", "cwd": "~nobody_here/x"}}}')  # RuntimeError: no such user
@example('{"mcpServers": {"x": {"command": "a", "cwd": "~a\\u0000b"}}}')  # ValueError: embedded null byte
@example('{"mcpServers": {"x": {"command": "a", "timeout": NaN}}}')  # loaded with a NaN timeout (Infinity too)
@example('{"mcpServers": {"x": {"command": "a\\ud800"}}}')  # loaded; failed at launch (not encodable)
@example('{"mcpServers": {"x": {"command": "a", "env": {"A": "\\u0000"}}}}')  # loaded; failed at launch (NUL)
@example('{"mcpServers": {"x\\udc00": {}}}')  # the error named the key with a lone surrogate and could not print
def test_the_mcp_file_loader_reads_any_text_or_names_the_problem(tmp_path, text):
    path = tmp_path / "mcp.json"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    specs = _specs_or_named_problem(path, {"HOME": "/home/x"})
    assert all(spec.name for spec in specs or [])


def _specs_or_named_problem(path, variables):
    """The specs, each one whet can launch or reach; or None after a ConfigError that names a key and prints."""
    try:
        specs = load_mcp_servers(path, variables)
    except ConfigError as error:
        assert error.key and error.problem
        str(error).encode("utf-8")
        return None
    for spec in specs:
        assert spec.timeout is None or 0 < spec.timeout < math.inf
        assert "\\u0000" not in spec.model_dump_json()  # UTF-8 text with no NUL: argv, env, URLs, headers
    return specs


MCP_ENTRIES = st.dictionaries(
    st.sampled_from(["command", "args", "env", "url", "type", "headers", "disabled", "allowedTools", "disabledTools",
                     "timeout", "cwd", "transport", "other"]),
    JSON_VALUES,
    max_size=5,
)  # fmt: skip


@FAST
@given(st.dictionaries(st.text(max_size=8), MCP_ENTRIES, max_size=3), st.sampled_from(["mcpServers", "servers"]))
def test_the_mcp_file_loader_reads_any_server_entries_or_names_the_key(tmp_path, servers, root):
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({root: servers}))
    specs = _specs_or_named_problem(path, {"HOME": "/home/x"})
    if specs is not None:
        assert [spec.name for spec in specs] == list(servers)


def test_strategies_reach_both_outcomes(tmp_path):
    """The generators are not all-errors: a document of the right shape loads."""
    path = Path(tmp_path / "mcp.json")
    path.write_text(json.dumps({"mcpServers": {"calc": {"command": "python", "args": ["-m", "x"]}}}))
    assert [s.name for s in load_mcp_servers(path, {})] == ["calc"]
    with pytest.raises(ConfigError):
        load_mcp_servers(path.with_name("missing.json"), {})
