"""Pure ASGI middleware: request ids bound for logging, a catch-all 500, the API key check, a body size cap."""

from __future__ import annotations

import hmac
import json
import uuid
from collections.abc import Mapping

import structlog
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HttpMiddleware:
    """Pure ASGI middleware over HTTP requests (:meth:`http`); anything else passes through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class RequestContextMiddleware(HttpMiddleware):
    """Binds a request id (and echoes it as X-Request-Id) for every log line of the request."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = uuid.uuid4().hex[:16]
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=request_id, path=scope["path"])

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", []).append((b"x-request-id", request_id.encode()))
            await send(message)

        await self.app(scope, receive, send_with_id)


def error_body(message: str, code: str | None, kind: str = "invalid_request_error") -> bytes:
    """An OpenAI-style error body."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


class UnexpectedErrorMiddleware(HttpMiddleware):
    """Answers an exception no handler took with a 500 and *keeps the connection usable*.

    Starlette's own catch-all (``exception_handler(Exception)``) re-raises after it sends the
    500, and uvicorn then drops the connection, so a client's next request on that keep-alive
    connection failed with a reset. Here the exception is logged and ends with the response.
    Once a response has started (a stream) no status can be sent: it is re-raised, and the
    server closes the connection, the only honest signal left.
    """

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            structlog.get_logger().exception("unhandled error", path=scope.get("path"))
            message = f"internal error ({type(exc).__name__}); the server log has details"
            body = error_body(message, None, "server_error")
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 500, "headers": headers})
            await send({"type": "http.response.body", "body": body})


def key_user(keys: Mapping[str, str], authorization: str) -> str | None:
    """The user a ``Bearer <key>`` header names (compared in constant time), else None."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    presented = token.strip().encode()
    found = None
    for key, user in keys.items():
        if hmac.compare_digest(key.encode(), presented):
            found = user
    return found


class ApiKeyMiddleware(HttpMiddleware):
    """With API keys configured, every path (docs and schema included) needs a valid key, and the
    check comes first: a request without one is a 401 before its body is read or validated.

    ``public``: paths that hold no data and are served to anyone (the web page's static files,
    which ask for the key); one ending in ``*`` covers every path that starts with it."""

    def __init__(self, app: ASGIApp, keys: Mapping[str, str], public: tuple[str, ...] = ()) -> None:
        super().__init__(app)
        self.keys = dict(keys)
        self.public = public

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.keys or self._is_public(scope):
            await self.app(scope, receive, send)
            return
        authorization = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        if key_user(self.keys, authorization) is not None:
            await self.app(scope, receive, send)
            return
        body = error_body("missing or invalid API key: send 'Authorization: Bearer <key>'", "invalid_api_key")
        headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})


    def _is_public(self, scope: Scope) -> bool:
        if scope.get("method") not in ("GET", "HEAD"):
            return False
        path = scope.get("path", "")
        return any(path.startswith(p[:-1]) if p.endswith("*") else path == p for p in self.public)


class BodyLimitMiddleware(HttpMiddleware):
    """Refuses bodies over ``max_bytes`` with 413, by header or by counting what arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send)
            return
        seen = 0

        async def counted() -> Message:
            # a body without Content-Length (chunked) is counted as it arrives; the app's
            # exception handler turns this into the same 413 body
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"request body is larger than {self.max_bytes} bytes (server.max_body_bytes)"

    async def _refuse(self, send: Send) -> None:
        body = error_body(self._message(), "body_too_large")
        await send(
            {"type": "http.response.start", "status": 413, "headers": [(b"content-type", b"application/json")]}
        )
        await send({"type": "http.response.body", "body": body})
