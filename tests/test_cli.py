"""The `whet` command line as a user runs it: subprocesses, real files."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import yaml

from whet.memory.store import TurnCreate, open_store

pytestmark = pytest.mark.loopback


def whet(*args: str, input: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "whet.runtime.cli", *args], capture_output=True, text=True, input=input, timeout=timeout
    )


def write_config(tmp_path: Path, **sections) -> Path:
    path = tmp_path / "whet.yaml"
    path.write_text(yaml.safe_dump({"data_dir": str(tmp_path / "data"), **sections}))
    return path


def test_the_cli_reports_invalid_config_in_one_line_with_exit_code_2(tmp_path):
    path = tmp_path / "whet.yaml"
    path.write_text("server:\n  port: not-a-port\n")
    done = whet("tools", "--config", str(path))
    assert done.returncode == 2
    assert "server.port" in done.stderr and "Traceback" not in done.stderr


def test_the_cli_reports_an_unreadable_yaml_file_without_a_traceback(tmp_path):
    path = tmp_path / "whet.yaml"
    path.write_text("model: [unclosed\n")
    done = whet("serve", "--config", str(path))
    assert done.returncode == 2
    assert "not valid YAML" in done.stderr and "Traceback" not in done.stderr


def test_whet_tools_lists_the_tools_of_the_configured_servers(tmp_path):
    mcp_file = tmp_path / "mcp.json"
    mcp_file.write_text(json.dumps({"mcpServers": {"calc": {"command": "${WHET_PYTHON}", "args": ["-m", "whet.servers.calc"]}}}))
    done = whet("tools", "--json", "--config", str(write_config(tmp_path, mcp={"config": str(mcp_file)})))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["servers"] == {"calc": {"status": "ready", "error": None}}
    listed = {t["name"]: t["server"] for t in report["tools"]}
    assert listed == {"calculate": "calc", "convert": "calc", "list_units": "calc"}


def test_whet_tools_exits_non_zero_and_reports_each_server_that_failed(tmp_path):
    servers = {"calc": {"command": "${WHET_PYTHON}", "args": ["-m", "whet.servers.calc"]},
               "missing": {"command": "/nonexistent/whet-no-such-server"}}  # fmt: skip
    mcp_file = tmp_path / "mcp.json"
    mcp_file.write_text(json.dumps({"mcpServers": servers}))
    config = str(write_config(tmp_path, mcp={"config": str(mcp_file)}))
    done = whet("tools", "--json", "--config", config)
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert report["servers"]["calc"] == {"status": "ready", "error": None}
    assert report["servers"]["missing"]["status"] == "failed"
    assert "FileNotFoundError" in report["servers"]["missing"]["error"]
    assert {t["server"] for t in report["tools"]} == {"calc"}
    table = whet("tools", "--config", config)
    assert table.returncode == 1 and "server missing: failed" in table.stdout and "whet doctor" in table.stdout


def test_whet_tools_names_the_key_of_a_broken_mcp_file(tmp_path):
    mcp_file = tmp_path / "mcp.json"
    mcp_file.write_text(json.dumps({"mcpServers": {"broken": {"args": ["x"]}}}))
    done = whet("tools", "--config", str(write_config(tmp_path, mcp={"config": str(mcp_file)})))
    assert done.returncode == 2
    assert "mcpServers.broken" in done.stderr and "Traceback" not in done.stderr


def test_whet_turns_prints_recorded_turns_oldest_first(tmp_path):
    config = write_config(tmp_path)

    async def record() -> list[str]:
        store = open_store(f"sqlite:///{tmp_path / 'data' / 'whet.db'}")
        session = await store.create_session("alice")
        ids = []
        for step, text in enumerate(["first answer", "second answer"]):
            turn = await store.add_turn(TurnCreate(
                session_id=session.id, user_id="alice", request_id="req_1", step=step, model="m",
                response_text=text, response_token_ids=[1, 2], response_logprobs=[-0.1, -0.2],
            ))
            ids.append(turn.id)
        await store.aclose()
        return ids

    ids = anyio.run(record)
    done = whet("turns", "--config", str(config), "--limit", "5")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert [line.split()[2] for line in lines] == ids
    assert "first answer" in lines[0] and "[open]" in lines[0]


def test_whet_chat_talks_to_a_running_server_and_rates_the_answer(tmp_path):
    from test_loopback import whet_serve

    with whet_serve(tmp_path, {"model": {"max_new_tokens": 8}}) as base:
        done = whet("chat", "--url", base, input="hello\n+\n\n")
        assert done.returncode == 0, done.stderr
        assert "whet> " in done.stdout and "(feedback recorded)" in done.stdout
        import httpx

        turns = httpx.get(f"{base}/v1/turns").json()
        assert turns[0]["next_state_kind"] == "feedback"


def test_whet_chat_explains_when_no_server_is_running(tmp_path):
    done = whet("chat", "--url", "http://127.0.0.1:9")
    assert done.returncode == 1
    assert "whet serve" in done.stderr and "Traceback" not in done.stderr


def test_whet_forget_removes_a_users_turns_notes_and_adapter_files_and_keeps_the_others(tmp_path):
    from whet.memory import Adapter
    from whet.servers.notes import NoteBook

    data = tmp_path / "data"
    mcp_file = tmp_path / "mcp.json"
    mcp_file.write_text(json.dumps({"mcpServers": {"notes": {
        "command": "${WHET_PYTHON}", "args": ["-m", "whet.servers.notes"],
        "env": {"WHET_NOTES_DB": "${WHET_DATA_DIR}/notes.db"}}}}))  # fmt: skip
    config = write_config(tmp_path, mcp={"config": str(mcp_file)})
    data.mkdir()
    book = NoteBook(data / "notes.db")
    book.add("alice", "alice PIN 4711", "inbox", "note")
    book.add("bob", "bob likes tea", "inbox", "note")
    book.close()
    folder = data / "adapters" / "user" / "alice" / "user-alice-0001"
    folder.mkdir(parents=True)

    async def record(user: str) -> str:
        store = open_store(f"sqlite:///{data / 'whet.db'}")
        session = await store.create_session(user)
        turn = await store.add_turn(TurnCreate(session_id=session.id, user_id=user, request_id="r", step=0, model="m"))
        await store.add_lesson(user, f"{user}'s lesson")
        if user == "alice":
            await store.add_adapter(Adapter(id="user-alice-0001", scope="user", user_id="alice", path=str(folder)))
        await store.aclose()
        return turn.id

    anyio.run(record, "alice")
    anyio.run(record, "bob")
    done = whet("forget", "alice", "--config", str(config))
    assert done.returncode == 0, done.stderr
    assert "forgot user alice" in done.stdout and "notes" in done.stdout

    async def left() -> tuple[set[str], set[str]]:
        store = open_store(f"sqlite:///{data / 'whet.db'}")
        users = {t.user_id for t in await store.list_turns()} | {x.user_id for x in await store.list_lessons()}
        adapters = {a.id for a in await store.list_adapters()}
        await store.aclose()
        return users, adapters

    assert anyio.run(left) == ({"bob"}, set())
    book = NoteBook(data / "notes.db")
    assert book.find("alice", [], None, None, True, 10).count == 0
    assert [n.text for n in book.find("bob", [], None, None, True, 10).notes] == ["bob likes tea"]
    book.close()
    assert not (data / "adapters" / "user" / "alice").exists()


def test_whet_serve_on_a_port_in_use_says_so_before_loading_anything_and_exits_1(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = write_config(tmp_path, model={"id": "tiny"}, learner={"enabled": False}, server={"port": port})
        done = whet("serve", "--config", str(config))
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "--port N" in done.stderr
    assert "whet ready" not in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "data" / "models" / "tiny").exists()  # refused before the model was loaded (or built)


def test_whet_bench_learn_help_states_the_learning_rate_the_arms_train_at():
    from whet.world.bench import LORA_OVERRIDES

    done = whet("bench", "learn", "--help")
    assert done.returncode == 0, done.stderr
    stated = re.search(r"learning rate in the arms \(default ([^)]+)\)", " ".join(done.stdout.split()))
    assert stated and float(stated[1]) == LORA_OVERRIDES["learning_rate"]


def test_whet_bench_perf_hands_every_option_to_bench_perf_py():
    done = whet("bench", "perf", "--help")
    assert done.returncode == 0, done.stderr
    assert "--quick" in done.stdout and "--skip" in done.stdout  # bench/perf.py's own options
    bad = whet("bench", "perf", "--no-such-option")
    assert bad.returncode == 2 and "--no-such-option" in bad.stderr
