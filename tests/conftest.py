"""Shared fixtures. Service-backed tests skip with one line on a fresh machine, fail under CI=true."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator

import pytest

# Tests never reach a model hub: a model id that is not local fails at once, where the hub client
# would retry an unreachable network for about a minute (a learner given the scripted backend's
# model id "scripted" tried just that in every test whose turns were judged).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The lesson check asks the served model about pinned turns whenever a lesson is made: a scripted
# backend would hand it replies written for the test's own requests. Tests of the check turn it on.
os.environ.setdefault("WHET_LEARNER__GATE__CHECK_LESSONS", "false")

POSTGRES_URL = os.environ.get("WHET_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
MQTT_HOST, MQTT_PORT = "127.0.0.1", 1883


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def require_service(name: str, host: str, port: int) -> None:
    """Skip (fresh machine) or fail loudly (CI=true) when a service is not listening."""
    if _reachable(host, port):
        return
    message = f"{name} is not reachable on {host}:{port}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message} (CI=true: service-backed tests must run)")
    pytest.skip(message)


@pytest.fixture
def postgres_url() -> str:
    require_service("PostgreSQL", "127.0.0.1", 5432)
    return POSTGRES_URL


@pytest.fixture
def postgres_schema_url(postgres_url: str) -> Iterator[str]:
    """A throwaway schema in the shared `test` database, dropped afterwards."""
    from sqlalchemy import create_engine, text

    schema = f"whet_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(postgres_url)
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    # plain postgresql:// also exercises the driver rewrite to psycopg 3
    url = postgres_url.replace("postgresql+psycopg://", "postgresql://", 1)
    yield f"{url}?options=-csearch_path%3D{schema}"
    with admin.begin() as connection:
        connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


@pytest.fixture
def mqtt_url() -> str:
    require_service("Mosquitto", MQTT_HOST, MQTT_PORT)
    return f"mqtt://{MQTT_HOST}:{MQTT_PORT}"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
