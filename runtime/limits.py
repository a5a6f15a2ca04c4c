"""Request limits: what one chat request may ask for, and how much one client may ask at once.

Two halves, one module. :func:`body_limit` checks a parsed chat request against the ``server``
limits (message count, ``max_tokens``) and names the setting it broke; the route calls it with the
other field checks. :class:`AdmissionMiddleware` admits a generating request (a chat completion,
an approval's continuation) only while its client has fewer than ``max_concurrent_per_key`` in
flight and a token left in its bucket of ``rate_limit_per_minute``; otherwise a 429 with
``Retry-After`` in whole seconds, before the body is read.

The client is the user its API key names (the same lookup as the key check). With keys off every
request counts as one client: the ``user`` field is whatever the client claims, and a limit keyed
on it could be dodged by changing it.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

from whet.config.settings import ServerConfig
from whet.runtime.middleware import HttpMiddleware, error_body, key_user

GENERATING = re.compile(r"^/v1/(chat/completions|approvals/[^/]+)$")
"""POST paths that run the model: the ones limited per client."""
ANYONE = ""  # the one client when keys are off


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str
    code: str
    param: str | None = None
    retry_after: int | None = None  # whole seconds


def body_limit(server: ServerConfig, messages: int, tokens: Mapping[str, int | None]) -> Refusal | None:
    """The first limit a chat request breaks: ``messages`` counted, ``tokens`` the asked-for output
    fields (``max_tokens``, ``max_completion_tokens``) by name; None when it keeps them all."""
    if messages > server.max_messages:
        return Refusal(400, f"messages: {messages} messages is more than this server takes in one request "
                       f"({server.max_messages}, server.max_messages); send fewer (drop the oldest)",
                       "too_many_messages", "messages")  # fmt: skip
    for name, asked in tokens.items():
        if asked is not None and asked > server.max_tokens_cap:
            return Refusal(400, f"{name}: {asked} is above this server's cap of {server.max_tokens_cap} "
                           "(server.max_tokens_cap); ask for fewer", "max_tokens_too_large", name)  # fmt: skip
    return None


@dataclass
class TokenBucket:
    """``per_minute`` requests a minute, in bursts of up to ``per_minute``; refilled continuously."""

    per_minute: int
    at: float  # when tokens was last counted
    tokens: float = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = float(self.per_minute)

    def take(self, now: float) -> float:
        """Take a token: 0.0 when one was there, else the seconds until one will be (nothing taken)."""
        rate = self.per_minute / 60.0
        self.tokens = min(float(self.per_minute), self.tokens + (now - self.at) * rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / rate


class Admission:
    """Per-client requests in flight and rate buckets. One event loop, no awaits inside: no lock."""

    def __init__(self, server: ServerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_in_flight = server.max_concurrent_per_key
        self.per_minute = server.rate_limit_per_minute
        self.clock = clock
        self.in_flight: dict[str, int] = {}
        self.buckets: dict[str, TokenBucket] = {}

    def enter(self, client: str) -> Refusal | None:
        """Admit one request of ``client`` (then :meth:`leave` when it ends), or say why not."""
        if self.max_in_flight and self.in_flight.get(client, 0) >= self.max_in_flight:
            return Refusal(429, f"{self.max_in_flight} requests of this client are already in flight "
                           "(server.max_concurrent_per_key); retry after one finishes, in about 1 s",
                           "too_many_concurrent_requests", retry_after=1)  # fmt: skip
        if self.per_minute:
            now = self.clock()
            wait = self.buckets.setdefault(client, TokenBucket(self.per_minute, now)).take(now)
            if wait:
                seconds = max(1, math.ceil(wait))
                return Refusal(429, f"rate limit of {self.per_minute} requests a minute reached "
                               f"(server.rate_limit_per_minute); retry in {seconds} s",
                               "rate_limit_exceeded", retry_after=seconds)  # fmt: skip
        self.in_flight[client] = self.in_flight.get(client, 0) + 1
        return None

    def leave(self, client: str) -> None:
        left = self.in_flight.pop(client, 1) - 1
        if left:
            self.in_flight[client] = left


class AdmissionMiddleware(HttpMiddleware):
    """Holds a slot of :class:`Admission` for the whole of a generating request, streams included.

    Sits inside the API key check (an unauthenticated request is a 401 and costs no token)."""

    def __init__(self, app: ASGIApp, server: ServerConfig, keys: Mapping[str, str]) -> None:
        super().__init__(app)
        self.admission = Admission(server)
        self.keys = dict(keys)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("method") != "POST" or not GENERATING.match(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        client = self._client(scope)
        refused = self.admission.enter(client)
        if refused is not None:
            await self._refuse(refused, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.leave(client)

    def _client(self, scope: Scope) -> str:
        if not self.keys:
            return ANYONE
        authorization = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        return key_user(self.keys, authorization) or ANYONE

    @staticmethod
    async def _refuse(refused: Refusal, send: Send) -> None:
        body = error_body(refused.message, refused.code)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"retry-after", str(refused.retry_after).encode())]  # fmt: skip
        await send({"type": "http.response.start", "status": refused.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
