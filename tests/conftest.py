"""Shared fixtures. Service-backed tests skip with one line on a fresh machine, fail under CI=true."""

from __future__ import annotations

import os
import socket

import pytest

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
def mqtt_url() -> str:
    require_service("Mosquitto", MQTT_HOST, MQTT_PORT)
    return f"mqtt://{MQTT_HOST}:{MQTT_PORT}"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
