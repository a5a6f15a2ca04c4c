"""`whet chat` against scripted HTTP answers (httpx.MockTransport): every failure is one clear line."""

from __future__ import annotations

import json

import httpx

from whet.runtime.console import run_chat

MODELS = {"object": "list", "data": [{"id": "m", "object": "model"}]}


def sse(*chunks: dict) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def chunk(text: str) -> dict:
    return {"id": "turn_1", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


def lines(*typed: str):
    queue = list(typed)

    def read(prompt: str) -> str:
        if not queue:
            raise EOFError
        return queue.pop(0)

    return read


def server(chat, feedback_status: int = 201, models_status: int = 200):
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/models":
            body = MODELS if models_status == 200 else {"error": {"message": "missing or invalid API key"}}
            return httpx.Response(models_status, json=body)
        if request.url.path == "/v1/feedback":
            if feedback_status == 201:
                return httpx.Response(201, json={"id": 1})
            return httpx.Response(feedback_status, json={"error": {"message": "turn 'turn_1' not found"}})
        return chat(request)

    return httpx.MockTransport(handle), seen


def test_an_error_inside_the_stream_is_shown_and_the_answer_cannot_be_rated(capsys):
    failing = sse(chunk("Hel"), {"id": "turn_1", "choices": [], "error": {"message": "the model backend failed: boom"}})
    transport, seen = server(lambda r: httpx.Response(200, content=failing, headers={"x-whet-session": "s"}))
    assert run_chat("http://whet", None, None, lines("hi", "+"), transport) == 0
    out = capsys.readouterr().out
    assert "[error: the model backend failed: boom]" in out
    assert "(feedback recorded)" not in out and "no answer to rate" in out
    assert not [r for r in seen if r.url.path == "/v1/feedback"]


def test_feedback_the_server_refuses_is_reported_not_claimed(capsys):
    transport, _ = server(lambda r: httpx.Response(200, content=sse(chunk("Hello"))), feedback_status=404)
    assert run_chat("http://whet", None, None, lines("hi", "-"), transport) == 0
    out = capsys.readouterr().out
    assert "Hello" in out and "(feedback recorded)" not in out
    assert "[feedback not recorded: 404 turn 'turn_1' not found]" in out


def test_feedback_the_server_accepts_is_confirmed(capsys):
    transport, seen = server(lambda r: httpx.Response(200, content=sse(chunk("Hello"))))
    assert run_chat("http://whet", None, None, lines("hi", "+"), transport) == 0
    assert "(feedback recorded)" in capsys.readouterr().out
    rated = json.loads(next(r for r in seen if r.url.path == "/v1/feedback").content)
    assert rated == {"turn_id": "turn_1", "thumbs": "up"}


class DiesMidway(httpx.SyncByteStream):
    def __iter__(self):
        yield f"data: {json.dumps(chunk('Hel'))}\n\n".encode()
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


def test_a_server_that_dies_mid_answer_gives_one_line_and_exit_code_1(capsys):
    transport, _ = server(lambda r: httpx.Response(200, stream=DiesMidway()))
    assert run_chat("http://whet", None, None, lines("hi"), transport) == 1
    err = capsys.readouterr().err
    assert "lost the connection to the server at http://whet" in err and "Traceback" not in err


def test_a_keyed_server_without_a_key_says_the_key_is_missing(capsys):
    transport, _ = server(lambda r: httpx.Response(500), models_status=401)
    assert run_chat("http://whet", None, None, lines(), transport) == 1
    err = capsys.readouterr().err
    assert "needs an API key" in err and "--api-key" in err and "whet serve" not in err


def test_ctrl_c_ends_the_chat_without_a_traceback(capsys):
    def interrupted(prompt: str) -> str:
        raise KeyboardInterrupt

    transport, _ = server(lambda r: httpx.Response(200, content=sse(chunk("Hello"))))
    assert run_chat("http://whet", None, None, interrupted, transport) == 130
    assert "Traceback" not in capsys.readouterr().err


def held(approval_id: str) -> dict:
    arguments = {"approval_id": approval_id, "status": "pending", "expires_at": "2026-01-01T00:10:00+00:00",
                 "calls": [{"name": "delete_note", "arguments": {"note_id": 1}}], "decide": f"/v1/approvals/{approval_id}"}
    call = {"index": 0, "id": approval_id, "type": "function",
            "function": {"name": "whet_approval", "arguments": json.dumps(arguments)}}
    return {"id": "turn_1", "choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": "tool_calls"}]}


def test_a_held_tool_call_is_asked_about_and_the_answer_goes_on_after_the_decision(capsys):
    def chat(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            return httpx.Response(200, content=sse(chunk("I will delete it. "), held("appr_1")),
                                  headers={"x-whet-session": "s"})
        decision = json.loads(request.content)
        text = "Deleted." if decision["decision"] == "approve" else f"Kept it ({decision['reason']})."
        return httpx.Response(200, content=sse({**chunk(text), "id": "turn_2"}))

    transport, seen = server(chat)
    assert run_chat("http://whet", None, None, lines("delete note 1", "maybe", "n keep it", "+"), transport) == 0
    out = capsys.readouterr().out
    assert '[approval needed] delete_note {"note_id": 1}' in out
    assert "answer y to approve" in out  # "maybe" is asked again
    assert "Kept it (keep it)." in out
    [decided] = [r for r in seen if r.url.path == "/v1/approvals/appr_1"]
    assert json.loads(decided.content) == {"decision": "reject", "reason": "keep it", "stream": True}
    rated = json.loads(next(r for r in seen if r.url.path == "/v1/feedback").content)
    assert rated["turn_id"] == "turn_2"  # the continued answer is the one rated
