"""``whet chat``: a terminal chat with a running whet server over its HTTP API.

Streams each answer as it is written, rates the last one with ``+`` / ``-`` (``POST
/v1/feedback``), and turns every failure (no server, a missing key, an error in the stream,
a server that goes away) into one line that says what happened, never a traceback. A tool
call held for approval is asked about at the prompt (y / n and a reason) and the answer goes on.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import httpx

from whet.runtime.approvals import APPROVAL_TOOL

Reader = Callable[[str], str]


class ChatError(Exception):
    """A failure the person at the terminal can act on; the message is the whole story."""


def run_chat(url: str, api_key: str | None, model: str | None, read: Reader = input,
             transport: httpx.BaseTransport | None = None) -> int:  # fmt: skip
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=300, transport=transport) as client:
        try:
            model = model or _served_model(client, url, api_key)
            return _loop(client, model, read)
        except KeyboardInterrupt:
            print()
            return 130
        except ChatError as exc:
            print(f"\nwhet: {exc}", file=sys.stderr)
            return 1
        except httpx.HTTPError as exc:
            print(f"\nwhet: lost the connection to the server at {url} ({exc}); is `whet serve` still running?",
                  file=sys.stderr)  # fmt: skip
            return 1


def _served_model(client: httpx.Client, url: str, api_key: str | None) -> str:
    try:
        response = client.get("/v1/models")
    except httpx.HTTPError as exc:
        raise ChatError(f"cannot reach a whet server at {url} ({exc}); start one with `whet serve`") from None
    if response.status_code == 401:
        fix = "check the key given with --api-key" if api_key else "pass one with --api-key KEY"
        raise ChatError(f"the server at {url} needs an API key: {fix}")
    if response.status_code != 200:
        raise ChatError(f"the server at {url} answered /v1/models with {response.status_code}: {_message(response)}")
    return response.json()["data"][0]["id"]


def _loop(client: httpx.Client, model: str, read: Reader) -> int:
    messages: list[dict[str, Any]] = []
    session: str | None = None
    last_turn: str | None = None
    print(f"chatting with {model}; empty line or Ctrl-D to quit, '+' / '-' to rate the last answer")
    while True:
        try:
            line = read("you> ").strip()
        except EOFError:
            return 0
        if not line:
            return 0
        if line in ("+", "-"):
            _rate(client, last_turn, line == "+")
            continue
        messages.append({"role": "user", "content": line})
        headers = {"X-Whet-Session": session} if session else {}
        reply, turn, session = _stream_reply(client, model, messages, headers, read)
        if turn is None:  # the request failed: it is not part of the conversation
            messages.pop()
            continue
        last_turn = turn
        messages.append({"role": "assistant", "content": reply})


def _rate(client: httpx.Client, turn_id: str | None, up: bool) -> None:
    if turn_id is None:
        print("(no answer to rate yet)")
        return
    response = client.post("/v1/feedback", json={"turn_id": turn_id, "thumbs": "up" if up else "down"})
    if response.status_code == 201:
        print("(feedback recorded)")
    else:
        print(f"[feedback not recorded: {response.status_code} {_message(response)}]")


def _stream_reply(client: httpx.Client, model: str, messages: list[dict[str, Any]], headers: dict[str, str],
                  read: Reader):  # fmt: skip
    """(reply text, answering turn id or None when it failed, session id).

    A step held for approval (a ``whet_approval`` call) asks at the prompt and streams the rest
    of the answer once decided.
    """
    body = {"model": model, "messages": messages, "stream": True}
    print("whet> ", end="", flush=True)
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        text, turn_id, approval = _read_stream(response)
        session = response.headers.get("x-whet-session") or headers.get("X-Whet-Session")
    while approval is not None and turn_id is not None:
        decision = _ask(approval, read)
        path = f"/v1/approvals/{approval['approval_id']}"
        with client.stream("POST", path, json={**decision, "stream": True}) as response:
            more, turn_id, approval = _read_stream(response)
        text += more
    print()
    return text, turn_id, session


def _read_stream(response: httpx.Response) -> tuple[str, str | None, dict[str, Any] | None]:
    """(text, turn id or None when it failed, a pending approval's arguments or None)."""
    if response.status_code >= 400:
        response.read()
        print(f"[error {response.status_code}: {_message(response)}]", end="")
        return "", None, None
    parts: list[str] = []
    turn_id, failed, approval = None, False, None
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("error"):
            failed = True
            print(f"\n[error: {chunk['error'].get('message', 'the server reported an error')}]", end="")
            continue
        turn_id = chunk.get("id", turn_id)
        for choice in chunk.get("choices", []):
            text = choice["delta"].get("content") or ""
            parts.append(text)
            print(text, end="", flush=True)
            for call in choice["delta"].get("tool_calls") or []:
                if call["function"]["name"] == APPROVAL_TOOL:
                    approval = json.loads(call["function"]["arguments"])
    return "".join(parts), None if failed else turn_id, approval


def _ask(approval: dict[str, Any], read: Reader) -> dict[str, Any]:
    """The person's decision on a held step: y approves; n (and an optional reason) rejects."""
    print()
    for call in approval["calls"]:
        print(f"[approval needed] {call['name']} {json.dumps(call['arguments'], ensure_ascii=False)}")
    while True:
        try:
            answer = read("approve? y / n [reason]> ").strip()
        except EOFError:
            answer = "n"
        word, _, reason = answer.partition(" ")
        if word.lower() in ("y", "yes"):
            print("whet> ", end="", flush=True)
            return {"decision": "approve"}
        if word.lower() in ("n", "no"):
            print("whet> ", end="", flush=True)
            return {"decision": "reject", "reason": reason.strip() or None}
        print("(answer y to approve, or n and an optional reason to reject)")


def _message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:200] or response.reason_phrase
