"""``whet doctor``: real MCP servers (stdio), a real store, the tiny model; a broken deployment exits non-zero.

The command runs as a subprocess, as a person runs it (it configures logging for its process).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import yaml

from whet.runtime import doctor

CALC = {"command": sys.executable, "args": ["-m", "whet.servers.calc"]}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("doctor-data")  # shared: the tiny model is built once


def write_config(tmp_path: Path, data_dir: Path, servers: dict, **sections) -> Path:
    (tmp_path / "mcp.json").write_text(json.dumps({"mcpServers": servers}))
    config = {"data_dir": str(data_dir), "model": {"id": "tiny"}, "memory": {"embedder": "hashing"},
              "mcp": {"config": str(tmp_path / "mcp.json"), "start_timeout": 20}, **sections}  # fmt: skip
    path = tmp_path / "whet.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def doctor_json(config: Path) -> tuple[int, dict[str, dict]]:
    done = subprocess.run([sys.executable, "-m", "whet.runtime.cli", "doctor", "--config", str(config), "--json"],
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, {check["name"]: check for check in json.loads(done.stdout)}


def test_doctor_reports_broken_mcp_servers_with_their_fix_and_exits_non_zero(tmp_path, data_dir, capsys):
    servers = {
        "calc": CALC,
        "missing": {"command": "/nonexistent/whet-no-such-server"},
        "quits": {"command": sys.executable, "args": ["-c", "pass"]},  # exits at once
        "hangs": {"command": sys.executable, "args": ["-c", "import time; time.sleep(3600)"]},  # never answers
    }
    code, checks = doctor_json(write_config(tmp_path, data_dir, servers))
    assert code == 1
    assert checks["mcp server calc"]["ok"] and "calculate" in checks["mcp server calc"]["detail"]
    missing = checks["mcp server missing"]
    assert not missing["ok"] and "FileNotFoundError" in missing["detail"]
    assert "'/nonexistent/whet-no-such-server' was not found" in missing["fix"]
    assert "mcpServers.missing" in missing["fix"]
    quits = checks["mcp server quits"]
    assert not quits["ok"] and "-c pass` by hand" in quits["fix"] and "mcpServers.quits" in quits["fix"]
    hangs = checks["mcp server hangs"]
    assert not hangs["ok"] and hangs["detail"].startswith("failed after 2")
    assert "no answer within mcp.start_timeout (20s)" in hangs["detail"]
    assert "did not answer within mcp.start_timeout (20s)" in hangs["fix"] and "raise mcp.start_timeout" in hangs["fix"]
    # everything else in this deployment is fine, and says so
    for name in ("config", "data dir", "store", "bus", "model"):
        assert checks[name]["ok"], checks[name]
    assert "one token" in checks["model"]["detail"] and "GiB free" in checks["data dir"]["detail"]

    doctor.print_report([doctor.Check(**check) for check in checks.values()])
    table = capsys.readouterr().out
    assert (
        "FAIL" in table
        and "was not found" in table
        and "3 failed: mcp server missing, mcp server quits, mcp server hangs" in table
    )


def test_doctor_passes_a_healthy_tiny_deployment_and_exits_zero(tmp_path, data_dir):
    code, checks = doctor_json(write_config(tmp_path, data_dir, {"calc": CALC}))
    assert [name for name, check in checks.items() if not check["ok"]] == []
    assert code == 0
    assert list(checks) == ["config", "data dir", "mcp server calc", "store", "bus", "model"]


def test_doctor_names_a_bad_config_key_and_stops_there(tmp_path):
    path = tmp_path / "whet.yaml"
    path.write_text("modle:\n  id: tiny\n")
    code, checks = doctor_json(path)
    assert code == 1 and list(checks) == ["config"]
    assert "modle" in checks["config"]["detail"] and "spelling" in checks["config"]["fix"]


def test_doctor_round_trips_an_event_over_mqtt_and_says_when_the_broker_is_not_there(
    tmp_path, data_dir, mqtt_url, monkeypatch
):
    monkeypatch.setattr(doctor, "BUS_TIMEOUT", 3.0)
    healthy = write_config(tmp_path, data_dir, {}, bus={"url": mqtt_url})
    checks = {c.name: c for c in anyio.run(doctor.run_checks, healthy)}
    assert checks["bus"].ok and "came back" in checks["bus"].detail
    assert checks["mcp servers"].ok  # no servers is a valid deployment
    broken = write_config(tmp_path, data_dir, {}, bus={"url": "mqtt://127.0.0.1:1"})
    bus = {c.name: c for c in anyio.run(doctor.run_checks, broken)}["bus"]
    assert not bus.ok and "no event came back" in bus.detail and "start the MQTT broker" in bus.fix
