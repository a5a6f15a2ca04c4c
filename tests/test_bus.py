"""The event bus: in-process fan-out, and MQTT against Mosquitto on 127.0.0.1:1883."""

from __future__ import annotations

import asyncio
import uuid
from contextlib import suppress

import aiomqtt
import anyio
import pytest

from whet.memory import (
    ADAPTER_PUBLISHED,
    BUS_RECONNECTED,
    FEEDBACK_ADDED,
    TURN_CLOSED,
    Event,
    MemoryBus,
    MqttBus,
    open_bus,
)

pytestmark = pytest.mark.anyio

DEADLINE = 10.0  # seconds any single wait may take before the test fails


async def test_memory_bus_fans_out_each_event_to_every_matching_subscriber():
    bus = MemoryBus()
    await bus.start()
    async with bus.subscribe(TURN_CLOSED) as closed, bus.subscribe() as everything:
        await bus.publish(TURN_CLOSED, {"turn_id": "turn_1"})
        await bus.publish(FEEDBACK_ADDED, {"feedback_id": 3})
        with anyio.fail_after(DEADLINE):
            assert await anext(closed) == Event(TURN_CLOSED, {"turn_id": "turn_1"})
            assert await anext(everything) == Event(TURN_CLOSED, {"turn_id": "turn_1"})
            assert await anext(everything) == Event(FEEDBACK_ADDED, {"feedback_id": 3})
        await bus.aclose()
        assert [event async for event in closed] == []  # the feedback event never reached it
    assert bus._fanout.subscriptions == set()


async def test_memory_bus_subscriber_gets_its_own_copy_of_the_data():
    bus = MemoryBus()
    async with bus.subscribe(TURN_CLOSED) as first, bus.subscribe(TURN_CLOSED) as second:
        data = {"turn_ids": ["turn_1"]}
        await bus.publish(TURN_CLOSED, data)
        data["turn_ids"].append("changed later")
        mine = await anext(first)
        mine.data["turn_ids"].append("mutated by a subscriber")
        assert (await anext(second)).data == {"turn_ids": ["turn_1"]}
    await bus.aclose()


async def test_publish_refuses_data_that_is_not_json_ids():
    bus = MemoryBus()
    with pytest.raises(ValueError, match="JSON-serialisable"):
        await bus.publish(TURN_CLOSED, {"turn": object()})
    with pytest.raises(ValueError, match="bad event"):
        await bus.publish("a/b", {})


async def test_open_bus_chooses_by_url():
    assert isinstance(open_bus(None), MemoryBus)
    bus = open_bus("mqtt://broker.local:1884/site-a/whet", client_id="replica-1")
    assert isinstance(bus, MqttBus)
    assert (bus.host, bus.port, bus.prefix, bus.client_id, bus.tls) == (
        "broker.local", 1884, "site-a/whet", "replica-1", False)  # fmt: skip
    secure = open_bus("mqtts://broker.local")
    assert (secure.port, secure.prefix, secure.tls) == (8883, "whet", True)
    for bad in ("redis://localhost:6379", "mqtt://", "broker:1883", "mqtt://h:notaport"):
        with pytest.raises(ValueError, match="mqtt://host"):
            open_bus(bad)


# ----------------------------------------------------------------------------- MQTT (loopback)


class Proxy:
    """A TCP relay in front of the broker that a test can cut and restore."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(source, sink))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with suppress(OSError):
            while chunk := await source.read(65536):
                sink.write(chunk)
                await sink.drain()
        sink.close()

    async def drop_connections(self) -> None:
        for writer in list(self._writers):
            writer.close()
        await asyncio.gather(*self._pipes, return_exceptions=True)
        for writer in list(self._writers):
            with suppress(OSError):
                await writer.wait_closed()
        self._writers.clear()

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self.drop_connections()
        await self._server.wait_closed()


@pytest.fixture
def prefix() -> str:
    return f"whet-test/{uuid.uuid4().hex}"


@pytest.fixture
async def proxy(mqtt_url):
    proxy = Proxy(target_port=int(mqtt_url.rsplit(":", 1)[1]))
    await proxy.start()
    yield proxy
    if proxy._server is not None and proxy._server.is_serving():
        await proxy.stop()


def fast_bus(port: int, prefix: str, **kwargs) -> MqttBus:
    return MqttBus("127.0.0.1", port, prefix=prefix, backoff_initial=0.05, backoff_max=0.5, **kwargs)


@pytest.mark.loopback
async def test_mqtt_bus_delivers_a_published_event_to_a_subscriber(mqtt_url, prefix):
    publisher, subscriber = open_bus(f"{mqtt_url}/{prefix}"), open_bus(f"{mqtt_url}/{prefix}")
    await publisher.start()
    await subscriber.start()
    try:
        async with subscriber.subscribe(TURN_CLOSED) as events:
            await publisher.publish(ADAPTER_PUBLISHED, {"adapter_id": "global-0002"})
            await publisher.publish(TURN_CLOSED, {"turn_id": "turn_1"})
            with anyio.fail_after(DEADLINE):
                assert await anext(events) == Event(TURN_CLOSED, {"turn_id": "turn_1"})
    finally:
        await publisher.aclose()
        await subscriber.aclose()


@pytest.mark.loopback
async def test_mqtt_bus_sends_events_queued_while_disconnected_after_reconnecting(mqtt_url, prefix, proxy):
    publisher = fast_bus(proxy.port, prefix)
    subscriber = open_bus(f"{mqtt_url}/{prefix}")
    await publisher.start()
    await subscriber.start()
    try:
        async with subscriber.subscribe(TURN_CLOSED) as events:
            connects = publisher.connects
            await proxy.stop()
            for i in range(3):
                await publisher.publish(TURN_CLOSED, {"turn_id": f"turn_{i}"})
            assert publisher.pending == 3  # nothing can be acknowledged with the broker out of reach
            await proxy.start()
            with anyio.fail_after(DEADLINE):
                await publisher.wait_connected(after=connects)
                received = [await anext(events) for _ in range(3)]
                await publisher.flush()
            assert [e.data["turn_id"] for e in received] == ["turn_0", "turn_1", "turn_2"]
    finally:
        await publisher.aclose()
        await subscriber.aclose()


@pytest.mark.loopback
async def test_mqtt_bus_renews_its_subscription_after_a_reconnect(mqtt_url, prefix, proxy):
    # a clean session: the broker forgets the subscription when the link drops
    subscriber = fast_bus(proxy.port, prefix)
    publisher = open_bus(f"{mqtt_url}/{prefix}")
    await subscriber.start()
    await publisher.start()
    try:
        async with subscriber.subscribe(FEEDBACK_ADDED) as events:
            connects = subscriber.connects
            await proxy.drop_connections()
            with anyio.fail_after(DEADLINE):
                await subscriber.wait_connected(after=connects)
                await publisher.publish(FEEDBACK_ADDED, {"feedback_id": 42})
                assert await anext(events) == Event(FEEDBACK_ADDED, {"feedback_id": 42})
    finally:
        await subscriber.aclose()
        await publisher.aclose()


@pytest.mark.loopback
async def test_mqtt_bus_with_a_client_id_receives_events_sent_while_it_was_away(mqtt_url, prefix, proxy):
    client_id = f"whet-test-{uuid.uuid4().hex[:12]}"
    subscriber = fast_bus(proxy.port, prefix, client_id=client_id)
    publisher = open_bus(f"{mqtt_url}/{prefix}")
    await subscriber.start()
    await publisher.start()
    try:
        async with subscriber.subscribe(TURN_CLOSED) as events:
            connects = subscriber.connects
            await proxy.stop()
            await publisher.publish(TURN_CLOSED, {"turn_id": "while_away"})
            with anyio.fail_after(DEADLINE):
                await publisher.flush()  # the broker holds it for the persistent session
                await proxy.start()
                await subscriber.wait_connected(after=connects)
                assert await anext(events) == Event(TURN_CLOSED, {"turn_id": "while_away"})
    finally:
        await subscriber.aclose()
        await publisher.aclose()
        host, port = mqtt_url.removeprefix("mqtt://").split(":")
        async with aiomqtt.Client(host, int(port), identifier=client_id, clean_session=True):
            pass  # wipe the persistent session this test left on the broker


@pytest.mark.loopback
async def test_mqtt_bus_tells_its_own_subscribers_when_its_link_comes_back(mqtt_url, prefix, proxy):
    """Events sent while the link was down may be gone (a broker restarted without persistence):
    consumers that name bus.reconnected hear of every reconnect and catch up from the store."""
    bus = fast_bus(proxy.port, prefix)
    await bus.start()
    try:
        async with bus.subscribe(BUS_RECONNECTED) as events, bus.subscribe(TURN_CLOSED) as others:
            for _ in range(2):
                connects = bus.connects
                await proxy.drop_connections()
                with anyio.fail_after(DEADLINE):
                    await bus.wait_connected(after=connects)
                    assert await anext(events) == Event(BUS_RECONNECTED, {"connects": connects + 1})
            await bus.publish(TURN_CLOSED, {"turn_id": "turn_1"})
            with anyio.fail_after(DEADLINE):  # a subscription that did not name it never sees it
                assert await anext(others) == Event(TURN_CLOSED, {"turn_id": "turn_1"})
    finally:
        await bus.aclose()
