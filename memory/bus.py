"""The event bus: events carry ids, not data.

The store is the source of truth. An event only says *what changed*
(``{"turn_id": ...}``), and is published after the store write committed; a
consumer that was away catches up from the store, so the bus may be
at-least-once (MQTT QoS 1 can deliver twice) and consumers stay idempotent.

Two implementations behind one :class:`Bus` protocol: :class:`MemoryBus`
(in-process fan-out, the default and the tests' twin) and :class:`MqttBus`
(aiomqtt; scale-out across replicas and a separate ``whet learn`` process).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import uuid
from collections import deque
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

import aiomqtt
import structlog

TURN_CLOSED = "turn.closed"
FEEDBACK_ADDED = "feedback.added"
ADAPTER_PUBLISHED = "adapter.published"
LESSON_ADDED = "lesson.added"
LESSON_DELETED = "lesson.deleted"  # {"lesson_id"}: every replica drops it from its index
USER_FORGOTTEN = "user.forgotten"  # {"user_id"}: every replica drops the user's lessons and adapter
# {"connects"}: local only, never sent: this process's broker link came back, and events published
# meanwhile may be lost (a broker restarted without persistence forgets sessions): catch up from the store
BUS_RECONNECTED = "bus.reconnected"

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Event:
    name: str
    data: dict[str, Any]


class Bus(Protocol):
    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    async def publish(self, name: str, data: dict[str, Any]) -> None: ...

    def subscribe(self, *names: str) -> AbstractAsyncContextManager[AsyncIterator[Event]]:
        """``async with bus.subscribe(TURN_CLOSED) as events: async for event in events``;
        no names means every event. Iteration ends when the bus closes."""
        ...


def _encode(name: str, data: dict[str, Any]) -> bytes:
    """Check an event before it leaves: a dotted name and JSON-serialisable ids."""
    if not name or any(c in name for c in "/#+") or not isinstance(data, dict):
        raise ValueError(f"bad event {name!r}: the name must be non-empty without '/', '#', '+', data a dict")
    try:
        return json.dumps(data, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"event {name!r} data must be JSON-serialisable ids: {exc}") from None


_CLOSED = object()


class _Subscription:
    """One subscriber's queue and its async iterator of events."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = frozenset(names)
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def wants(self, name: str) -> bool:
        return not self.names or name in self.names

    def __aiter__(self) -> _Subscription:
        return self

    async def __anext__(self) -> Event:
        item = await self.queue.get()
        if item is _CLOSED:
            self.queue.put_nowait(_CLOSED)  # stay ended for any later __anext__
            raise StopAsyncIteration
        return item


class _FanOut:
    """The subscriber registry both buses share."""

    def __init__(self) -> None:
        self.subscriptions: set[_Subscription] = set()

    def deliver(self, name: str, payload: bytes) -> None:
        for sub in list(self.subscriptions):
            if sub.wants(name):
                # each subscriber decodes its own copy, so no one can mutate another's event
                data = json.loads(payload)
                if not isinstance(data, dict):
                    raise ValueError(f"event {name!r} payload is not a JSON object")
                sub.queue.put_nowait(Event(name, data))

    def close_all(self) -> None:
        for sub in self.subscriptions:
            sub.queue.put_nowait(_CLOSED)


class MemoryBus:
    """In-process fan-out: every subscriber registered before a publish receives it."""

    def __init__(self) -> None:
        self._fanout = _FanOut()
        self._closed = False

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        self._closed = True
        self._fanout.close_all()

    async def publish(self, name: str, data: dict[str, Any]) -> None:
        payload = _encode(name, data)
        if self._closed:  # shutting down: the store has the data, consumers catch up from it
            log.warning("bus.publish_after_close", event=name)
            return
        self._fanout.deliver(name, payload)

    async def flush(self, timeout: float | None = None) -> None:
        """Nothing to wait for: delivery happens inside ``publish``."""
        return None

    @contextlib.asynccontextmanager
    async def subscribe(self, *names: str) -> AsyncIterator[AsyncIterator[Event]]:
        sub = _Subscription(names)
        if self._closed:
            sub.queue.put_nowait(_CLOSED)
        self._fanout.subscriptions.add(sub)
        try:
            yield sub
        finally:
            self._fanout.subscriptions.discard(sub)


class MqttBus:
    """Events over an MQTT broker (aiomqtt 2.x): topic ``{prefix}/{name}``, JSON payload, QoS 1.

    One background task owns the connection and reconnects with capped exponential
    backoff. ``publish`` appends to an outbox that the task drains; an event leaves
    the outbox only once the broker acknowledged it, so events published while
    disconnected go out after reconnecting. With a ``client_id`` the broker session
    is persistent (``clean_session=False``): events for our subscription published
    while we were away are delivered when we come back.

    After every reconnect, subscriptions that name :data:`BUS_RECONNECTED` receive it (from this
    process, not the broker): whatever was published while the link was down may not come.

    The broker subscription is one wildcard ``{prefix}/#`` held while any
    ``subscribe`` context is open (and renewed after every reconnect); each context
    filters by name locally. Overlapping per-name subscriptions could make the
    broker deliver one message twice.
    """

    def __init__(
        self,
        host: str,
        port: int = 1883,
        *,
        prefix: str = "whet",
        client_id: str | None = None,
        tls: bool = False,
        username: str | None = None,
        password: str | None = None,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        connect_timeout: float = 5.0,
        drain_timeout: float = 5.0,
    ) -> None:
        prefix = prefix.strip("/")
        if not prefix or any(c in prefix for c in "#+"):
            raise ValueError(f"MQTT topic prefix {prefix!r} must be non-empty and free of '#' and '+'")
        self.host, self.port, self.prefix = host, port, prefix
        self.client_id, self.tls = client_id, tls
        self._username, self._password = username, password
        self._backoff = (backoff_initial, backoff_max)
        self._connect_timeout, self._drain_timeout = connect_timeout, drain_timeout
        self._fanout = _FanOut()
        self._outbox: deque[tuple[str, bytes]] = deque()
        self._changed = asyncio.Condition()
        self._client: aiomqtt.Client | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.connects = 0  # successful connections so far (a reconnect adds one)

    @property
    def connected(self) -> bool:
        return self._client is not None

    @property
    def pending(self) -> int:
        """Events published but not yet acknowledged by the broker."""
        return len(self._outbox)

    async def start(self) -> None:
        """Start the connection task and wait (at most ``connect_timeout``) for the first
        connection. A broker that is down is not an error: the task keeps retrying."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"mqtt-bus-{self.prefix}")
        try:
            await self.wait_connected(timeout=self._connect_timeout)
        except TimeoutError:
            log.warning("mqtt.not_connected_yet", host=self.host, port=self.port, retrying=True)

    async def wait_connected(self, *, after: int = 0, timeout: float | None = None) -> None:
        """Wait until more than ``after`` connections have been made (and subscriptions renewed)."""
        async with asyncio.timeout(timeout):
            async with self._changed:
                await self._changed.wait_for(lambda: self.connects > after and self.connected)

    async def publish(self, name: str, data: dict[str, Any]) -> None:
        """Queue an event for the broker; returns at once, delivery happens in the background."""
        payload = _encode(name, data)
        if self._closed:  # shutting down: the store has the data, consumers catch up from it
            log.warning("bus.publish_after_close", event=name)
            return
        self._outbox.append((f"{self.prefix}/{name}", payload))
        await self._notify()

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until the broker acknowledged every event published so far
        (``TimeoutError`` after ``timeout`` seconds)."""
        async with asyncio.timeout(timeout):
            async with self._changed:
                await self._changed.wait_for(lambda: not self._outbox)

    @contextlib.asynccontextmanager
    async def subscribe(self, *names: str) -> AsyncIterator[AsyncIterator[Event]]:
        """Events named ``names`` (all if none) from now on. When connected, this waits for
        the broker to acknowledge the subscription, so a publish after entering is seen."""
        sub = _Subscription(names)
        if self._closed:
            sub.queue.put_nowait(_CLOSED)
        self._fanout.subscriptions.add(sub)
        try:
            client = self._client
            if client is not None:  # re-subscribing is idempotent and waits for the SUBACK
                with contextlib.suppress(aiomqtt.MqttError):  # a reconnect will subscribe
                    await client.subscribe(self._wildcard, qos=1)
            yield sub
        finally:
            self._fanout.subscriptions.discard(sub)
            client = self._client
            if not self._fanout.subscriptions and client is not None and not self._closed:
                with contextlib.suppress(aiomqtt.MqttError):
                    await client.unsubscribe(self._wildcard)

    async def aclose(self) -> None:
        """Send what is queued (at most ``drain_timeout`` while connected), then disconnect
        and end every subscription's iteration."""
        if self._closed:
            return
        self._closed = True
        if self._outbox and self.connected:
            with contextlib.suppress(TimeoutError):
                await self.flush(timeout=self._drain_timeout)
        if self._outbox:
            log.warning("mqtt.closed_with_unsent_events", unsent=len(self._outbox))
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fanout.close_all()

    # ---- the connection task

    @property
    def _wildcard(self) -> str:
        return f"{self.prefix}/#"

    def _new_client(self) -> aiomqtt.Client:
        return aiomqtt.Client(
            self.host,
            self.port,
            identifier=self.client_id,
            clean_session=self.client_id is None,
            username=self._username,
            password=self._password,
            tls_context=ssl.create_default_context() if self.tls else None,
        )

    async def _run(self) -> None:
        delay, cap = self._backoff
        while True:
            try:
                async with self._new_client() as client:
                    delay = self._backoff[0]
                    await self._serve(client)
            except* aiomqtt.MqttError as group:
                log.warning("mqtt.disconnected", host=self.host, port=self.port,
                            error=str(group.exceptions[0]), retry_in=delay)  # fmt: skip
            except* Exception:
                # a bug must not end event delivery for the life of the process
                log.exception("mqtt.connection_task_failed", retry_in=delay)
            finally:
                self._client = None
                await self._notify()
            await asyncio.sleep(delay)
            delay = min(delay * 2, cap)

    async def _serve(self, client: aiomqtt.Client) -> None:
        """One connection's life: renew the subscription, then read and send until it drops."""
        self._client = client
        if self._fanout.subscriptions:
            await client.subscribe(self._wildcard, qos=1)
        self.connects += 1
        await self._notify()
        if self.connects > 1:
            self._fanout.deliver(BUS_RECONNECTED, _encode(BUS_RECONNECTED, {"connects": self.connects}))
        async with asyncio.TaskGroup() as group:
            group.create_task(self._read(client))
            group.create_task(self._send(client))

    async def _read(self, client: aiomqtt.Client) -> None:
        """Dispatch incoming messages; raises MqttError when the connection drops."""
        start = len(self.prefix) + 1
        async for message in client.messages:
            topic = message.topic.value
            try:
                self._fanout.deliver(topic[start:], bytes(message.payload))
            except (ValueError, TypeError):
                log.warning("mqtt.malformed_event_dropped", topic=topic)

    async def _send(self, client: aiomqtt.Client) -> None:
        """Drain the outbox in order; an event leaves it only after the broker's PUBACK."""
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: bool(self._outbox))
            topic, payload = self._outbox[0]
            await client.publish(topic, payload, qos=1)
            self._outbox.popleft()
            await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()


def open_bus(url: str | None, client_id: str | None = None) -> Bus:
    """None or "" -> :class:`MemoryBus`; ``mqtt://[user:pw@]host[:port][/prefix]`` (or
    ``mqtts://`` for TLS) -> :class:`MqttBus`. Anything else raises ``ValueError``."""
    if not url:
        return MemoryBus()
    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
        raise ValueError(
            f"bus URL {url!r} is not supported: use mqtt://host:1883[/prefix] "
            "(mqtts:// for TLS), or leave it empty for the in-process bus"
        )
    tls = parts.scheme == "mqtts"
    try:
        port = parts.port or (8883 if tls else 1883)
    except ValueError:
        raise ValueError(f"bus URL {url!r} has a bad port: use mqtt://host:1883") from None
    return MqttBus(
        parts.hostname,
        port,
        prefix=parts.path.strip("/") or "whet",
        client_id=client_id,
        tls=tls,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
    )


def new_client_id(role: str) -> str:
    """A unique client id for a role, for callers that want a fresh persistent session."""
    return f"whet-{role}-{uuid.uuid4().hex[:12]}"
