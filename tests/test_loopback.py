"""`whet serve` as a real process on 127.0.0.1, driven by the official openai client.

Two servers: one on a tiny local model (the real transformers path: token ids
and log-probs recorded), and one whose policy is an OpenAI-compatible fake we
script, so the agent deterministically calls the third-party `mcp-server-time`
through an mcpServers file, or (start-up) the tools of servers that start at
once, late, or never.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

pytestmark = pytest.mark.loopback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_whet(tmp_path: Path, config: dict, *args: str, name: str = "serve") -> tuple[subprocess.Popen, Path]:
    """Start ``whet <args> --config <tmp_path>/<name>.yaml`` with its output in ``<name>.log``; not waited on."""
    config = {"data_dir": str(tmp_path / "data"), "memory": {"embedder": "hashing"}, **config}
    # model.id tiny builds the untrained tiny model on first start (seconds)
    config["model"] = {"id": "tiny", **config.get("model", {})}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    log_path = tmp_path / f"{name}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHET_")}
    with log_path.open("w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-m", "whet.runtime.cli", *args, "--config", str(path)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    return proc, log_path


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def whet_serve(tmp_path: Path, config: dict) -> Iterator[str]:
    port = free_port()
    proc, log_path = spawn_whet(tmp_path, config, "serve", "--port", str(port))
    base = f"http://127.0.0.1:{port}"
    try:
        keys = list(config.get("server", {}).get("api_keys", {}))
        wait_healthy(base, proc, log_path, headers={"Authorization": f"Bearer {keys[0]}"} if keys else {})
        yield base
    finally:
        stop(proc)


def wait_healthy(
    base: str, proc: subprocess.Popen, log_path: Path, deadline_s: float = 120, headers: dict | None = None
) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"whet serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2, headers=headers).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # polling a starting process: there is no event to wait on
    pytest.fail(f"whet serve not healthy after {deadline_s}s:\n{log_path.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from whet.learner.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_the_openai_client_chats_with_whet_serve_and_every_turn_has_token_ids(tmp_path):
    # the out-of-the-box deployment: the model built on first start, bundled MCP servers
    with whet_serve(tmp_path, {"model": {"max_new_tokens": 12}}) as base:
        assert (tmp_path / "data" / "models" / "tiny" / "config.json").is_file()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}])
        assert reply.id.startswith("turn_")
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello again"}], stream=True
        )
        chunks = list(stream)
        assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
        streamed_id = chunks[-1].id
        for turn_id in (reply.id, streamed_id):
            turn = httpx.get(f"{base}/v1/turns/{turn_id}").json()
            assert turn["prompt_token_ids"] and turn["response_token_ids"]
            assert len(turn["response_logprobs"]) == len(turn["response_token_ids"])
            assert all(lp <= 0.0 for lp in turn["response_logprobs"])


def test_whet_serve_with_a_local_model_folder_serves_a_tool_using_turn(tmp_path, tiny_model):
    """The real transformers path: a tiny model taught one calc conversation calls the bundled calc server."""
    import anyio

    from whet.config.settings import load_config
    from whet.learner.prompt import template_messages
    from whet.runtime.tools import ToolPool
    from whet.servers import calc

    from tinytrain import memorize

    async def tool_side() -> tuple[list[dict], str]:
        async with ToolPool([], in_memory={"calc": calc.build_server()}) as pool:
            return pool.openai_tools(), (await pool.call("calculate", {"expression": "17*23"})).content

    tools, result = anyio.run(tool_side)
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calculate", "arguments": json.dumps({"expression": "17*23"})}}
    asked = [{"role": "system", "content": load_config().agent.system_prompt},
             {"role": "user", "content": "what is 17*23?"}]
    acted = [*asked, {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_0", "name": "calculate", "content": result}]
    lessons = [
        (template_messages(asked), tools, template_messages([acted[2]])[0]),
        (template_messages(acted), tools, {"role": "assistant", "content": "17 times 23 is 391."}),
    ]
    taught = memorize(tiny_model, tmp_path / "taught", lessons)

    mcp_file = tmp_path / "mcp.json"
    mcp_file.write_text(json.dumps({"mcpServers": {"calc": {"command": "${WHET_PYTHON}", "args": ["-m", "whet.servers.calc"]}}}))
    config = {"model": {"id": str(taught), "temperature": 0.0, "max_new_tokens": 48}, "mcp": {"config": str(mcp_file)}}
    with whet_serve(tmp_path, config) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        reply = client.chat.completions.create(model=str(taught), messages=[asked[1]])
        assert reply.choices[0].message.content == "17 times 23 is 391."
        turns = httpx.get(f"{base}/v1/turns", params={"limit": 10}).json()
        tool_turn, final_turn = turns[1], turns[0]
        assert final_turn["id"] == reply.id
        assert tool_turn["tool_calls"][0]["function"]["name"] == "calculate"
        assert tool_turn["next_state_kind"] == "tool_result" and "391" in json.dumps(tool_turn["next_state"])
        for turn in (tool_turn, final_turn):
            assert len(turn["response_logprobs"]) == len(turn["response_token_ids"]) > 0


def lisbon_time(body: dict) -> dict:
    """Ask for the time in Lisbon, then report the tool's answer."""
    last = body["messages"][-1]
    if last["role"] == "tool":
        return {"role": "assistant", "content": f"Lisbon time: {last['content'][:200]}"}
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_current_time", "arguments": json.dumps({"timezone": "Europe/Lisbon"})}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def scripted_openai_app(reply: Callable[[dict], dict] = lisbon_time) -> Starlette:
    """An OpenAI-compatible policy whose message is ``reply(request body)`` (plain or streamed)."""

    async def completions(request: Request):
        body = await request.json()
        message = reply(body)
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        if not body.get("stream"):
            return JSONResponse({"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                                 "choices": [{"index": 0, "message": message, "finish_reason": finish}]})

        async def events():
            delta = {"role": "assistant", "content": message["content"]}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": 0, **message["tool_calls"][0]}]
            for payload in ({"delta": delta, "finish_reason": None}, {"delta": {}, "finish_reason": finish}):
                chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                         "choices": [{"index": 0, **payload}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])


@contextmanager
def run_in_thread(app) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_third_party_mcp_server_from_an_mcpservers_file_is_listed_and_called(tmp_path):
    mcp_file = tmp_path / "mcp.json"
    mcp_file.write_text(json.dumps({"mcpServers": {
        "time": {"command": "${WHET_PYTHON}", "args": ["-m", "mcp_server_time", "--local-timezone=UTC"]},
    }}))
    with run_in_thread(scripted_openai_app()) as policy_url:
        config = {"model": {"backend": "openai", "id": "scripted-policy", "base_url": policy_url},
                  "mcp": {"config": str(mcp_file)}}
        with whet_serve(tmp_path, config) as base:
            tools = {t["name"]: t["server"] for t in httpx.get(f"{base}/v1/tools").json()}
            assert tools.get("get_current_time") == "time"
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
            reply = client.chat.completions.create(
                model="scripted-policy", messages=[{"role": "user", "content": "what time is it in Lisbon?"}]
            )
            answer = reply.choices[0].message.content
            assert answer.startswith("Lisbon time:") and "Europe/Lisbon" in answer
            turns = httpx.get(f"{base}/v1/turns", params={"limit": 10}).json()
            tool_turn = next(t for t in turns if t["tool_calls"])
            assert tool_turn["next_state_kind"] == "tool_result"
            assert "Europe/Lisbon" in json.dumps(tool_turn["next_state"])


def call_the_named_tool(body: dict) -> dict:
    """Call the tool the user names ("call NAME") with 17*23, then report its result; about a tool
    it was not offered, say so, so a test sees what was listed."""
    last = body["messages"][-1]
    if last["role"] == "tool":
        return {"role": "assistant", "content": f"result: {last['content'][:200]}"}
    offered = [t["function"]["name"] for t in body.get("tools") or []]
    wanted = str(last.get("content") or "").removeprefix("call ").strip()
    if wanted not in offered:
        return {"role": "assistant", "content": f"not offered: {wanted}; offered: {','.join(offered)}"}
    call = {"id": "call_1", "type": "function",
            "function": {"name": wanted, "arguments": json.dumps({"expression": "17*23"})}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def test_whet_serves_at_once_while_an_mcp_server_hangs_at_start_and_waits_briefly_for_a_slow_one(tmp_path):
    """A server that never answers initialize no longer holds the port closed for mcp.start_timeout:
    /health answers at once and shows it starting (then failed, with the reason); a chat in the first
    mcp.start_wait seconds waits for a server that is ready a few seconds late, and later chats are
    answered at once with the ready servers' tools."""
    start_timeout, start_wait = 30, 8
    calc = {"command": "${WHET_PYTHON}", "args": ["-m", "whet.servers.calc"]}
    slow = {"command": "${WHET_PYTHON}", "args": [
        "-c", "import runpy, time; time.sleep(4); runpy.run_module('whet.servers.calc', run_name='__main__')"]}
    hang = {"command": "${WHET_PYTHON}", "args": ["-c", "import time; time.sleep(3600)"]}  # never answers
    mcp_file = tmp_path / "mcp.json"
    mcp_file.write_text(json.dumps({"mcpServers": {"calc": calc, "slow": slow, "hang": hang}}))
    with run_in_thread(scripted_openai_app(call_the_named_tool)) as policy_url:
        config = {"model": {"backend": "openai", "id": "scripted-policy", "base_url": policy_url},
                  "mcp": {"config": str(mcp_file), "start_timeout": start_timeout, "start_wait": start_wait},
                  "learner": {"enabled": False}}  # fmt: skip
        port = free_port()
        proc, log_path = spawn_whet(tmp_path, config, "serve", "--port", str(port))
        base = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(base, proc, log_path, deadline_s=start_timeout - 5)
            health = httpx.get(f"{base}/health").json()
            # hang is failed only start_timeout after its start: still starting, so the port opened before
            assert health["servers"]["hang"] == "starting"  # slow (4 s) may be ready already on a loaded machine
            assert health["status"] == "starting" and health["server_errors"]["hang"] == "starting"

            def chat(text: str) -> str:
                body = {"model": "scripted-policy", "messages": [{"role": "user", "content": text}]}
                response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
                assert response.status_code == 200, response.text
                return response.json()["choices"][0]["message"]["content"]

            # the slow server is ready ~4 s after start: a chat now waits for it (up to start_wait)
            assert '"result": 391' in chat("call slow__calculate")
            assert httpx.get(f"{base}/health").json()["servers"]["hang"] == "starting"  # answered meanwhile
            # past start_wait, a chat is answered at once with the servers that are ready
            asked = time.monotonic()
            assert '"result": 391' in chat("call calc__calculate")
            assert time.monotonic() - asked < start_wait
            health = httpx.get(f"{base}/health").json()
            assert health["servers"] == {"calc": "ready", "slow": "ready", "hang": "starting"}
            assert "mcp.tools.still_starting" in log_path.read_text()

            deadline = time.monotonic() + start_timeout + 10
            while (health := httpx.get(f"{base}/health").json())["servers"]["hang"] == "starting":
                assert time.monotonic() < deadline, f"hang never failed: {health}"
                time.sleep(0.2)  # another process's state: there is no event to wait on
            assert health["status"] == "degraded" and health["servers"]["hang"] == "failed"
            assert f"mcp.start_timeout ({start_timeout}s)" in health["server_errors"]["hang"]
            assert list(health["server_errors"]) == ["hang"]
            metrics = httpx.get(f"{base}/metrics").text
            assert 'whet_tool_server_state{server="hang",state="failed"} 1.0' in metrics
            assert 'whet_tool_server_state{server="calc",state="ready"} 1.0' in metrics
        finally:
            stop(proc)
