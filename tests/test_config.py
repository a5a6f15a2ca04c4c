"""The config tree: defaults, file, env, flags; and one clear error for bad input."""

from __future__ import annotations

import json

import pytest

from whet.config.settings import ConfigError, load_config


def test_shipped_defaults_load_and_point_at_sqlite_and_the_bundled_servers():
    config = load_config()
    assert config.model.id == "smollm2" and config.model.backend == "transformers"
    assert config.store_url.startswith("sqlite:///") and config.store_url.endswith("whet.db")
    assert config.bus.url is None
    assert config.mcp_config_path().name == "mcp.json"


def test_a_file_then_env_then_flags_override_in_that_order(tmp_path, monkeypatch):
    path = tmp_path / "whet.yaml"
    path.write_text("model:\n  id: from-file\n  temperature: 0.1\nserver:\n  port: 9000\n")
    monkeypatch.setenv("WHET_MODEL__ID", "from-env")
    monkeypatch.setenv("WHET_SERVER__PORT", "9050")
    config = load_config(path, overrides={"server": {"port": 9100}})
    assert config.model.id == "from-env"
    assert config.model.temperature == 0.1  # the file's value survives where env is silent
    assert config.server.port == 9100  # a flag beats the env (which beats the file)
    assert load_config(path).server.port == 9050


def test_an_unknown_key_names_the_key_and_the_fix(tmp_path):
    path = tmp_path / "whet.yaml"
    path.write_text("model:\n  temprature: 0.2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.key == "model.temprature"
    assert "unknown key" in str(err.value) and "fix:" in str(err.value)


def test_a_bad_bus_url_is_refused_with_the_schemes_that_work(monkeypatch):
    monkeypatch.setenv("WHET_BUS__URL", "redis://localhost")
    with pytest.raises(ConfigError) as err:
        load_config()
    assert err.value.key == "bus.url" and "mqtt://" in str(err.value)


def test_model_id_demo_is_refused_saying_what_replaced_it(tmp_path):
    path = tmp_path / "whet.yaml"
    path.write_text("model:\n  id: demo\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.key == "model.id" and "replaced by smollm2" in err.value.problem
    assert "\n" not in err.value.problem


def test_the_logged_config_masks_every_api_key_and_keeps_every_user():
    config = load_config(overrides={"server": {"api_keys": {"sk-a": "alice", "sk-b": "bob"}}, "model": {"api_key": "sk-x"}})
    logged = config.redacted()
    assert logged["server"]["api_keys"] == ["*** -> alice", "*** -> bob"]
    assert "sk-" not in str(logged)


def test_model_dtype_takes_auto_float32_or_bfloat16_and_names_the_key_otherwise(tmp_path):
    assert load_config(overrides={"model": {"dtype": "bfloat16"}}).model.dtype == "bfloat16"
    path = tmp_path / "whet.yaml"
    path.write_text("model:\n  dtype: float16\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.key == "model.dtype" and "bfloat16" in str(err.value)


def test_the_logged_config_masks_every_secret_by_its_type():
    secrets = ["sk-server", "sk-model", "sk-judge", "pg-pass", "mq-pass", "vllm-pass", "judge-pass"]
    config = load_config(overrides={
        "server": {"api_keys": {"sk-server": "alice"}},
        "model": {"api_key": "sk-model", "base_url": "http://u:vllm-pass@gpu:8000/v1"},
        "store": {"url": "postgresql+psycopg://whet:pg-pass@db.internal:5432/whet"},
        "bus": {"url": "mqtt://whet:mq-pass@broker:1883/whet"},
        "learner": {"judge": {"api_key": "sk-judge", "base_url": "https://j:judge-pass@judge.example/v1"}},
    })  # fmt: skip
    logged = json.dumps(config.redacted())
    assert [s for s in secrets if s in logged] == []
    redacted = config.redacted()
    assert redacted["store"]["url"] == "postgresql+psycopg://whet:***@db.internal:5432/whet"
    assert redacted["bus"]["url"] == "mqtt://whet:***@broker:1883/whet"
    assert redacted["learner"]["judge"]["api_key"] == "***"
    assert config.store.url.endswith("pg-pass@db.internal:5432/whet")  # the values themselves are untouched


def test_every_field_that_names_a_secret_is_typed_as_one():
    from pydantic import BaseModel

    from whet.config.settings import _MARKERS, WhetConfig

    def untyped(model: type[BaseModel], path: str) -> list[str]:
        found = []
        for name, info in model.model_fields.items():
            annotation = info.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                found += untyped(annotation, f"{path}{name}.")
            # "..._per_key" counts something per key (server.max_concurrent_per_key): no secret
            elif set(name.removesuffix("_per_key").split("_")) & {"key", "keys", "password", "secret", "url"}:
                if not any(isinstance(m, _MARKERS) for m in info.metadata):
                    found.append(path + name)
        return found

    assert untyped(WhetConfig, "") == []


def test_an_admin_user_without_a_key_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"server": {"api_keys": {"sk-a": "alice"}, "admin_users": ["ops"]}})
    assert err.value.key == "server.admin_users" and "'ops'" in err.value.problem
    assert load_config(overrides={"server": {"api_keys": {"sk-o": "ops"}, "admin_users": ["ops"]}}).server.admin_users


def test_an_env_variable_naming_an_unknown_section_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv("WHET_SERVERR__PORT", "9000")
    with pytest.raises(ConfigError) as err:
        load_config()
    assert err.value.key == "WHET_SERVERR__PORT" and "'serverr'" in str(err.value)
    assert "server" in err.value.fix
    monkeypatch.delenv("WHET_SERVERR__PORT")
    monkeypatch.setenv("WHET_SCREENSHOTS", "/tmp/x")  # no section named: not whet config, left alone
    assert load_config().server.port == 8000


@pytest.mark.parametrize(("log", "is_json"), [({}, False), ({"format": "json"}, True), ({"json_logs": True}, True)])
def test_log_format_json_writes_one_object_per_line_and_json_logs_still_means_it(log, is_json, capsys):
    import structlog

    from whet.runtime.logs import configure_logging

    config = load_config(overrides={"log": log})
    assert config.log.is_json is is_json
    configure_logging(config.log)
    structlog.contextvars.bind_contextvars(request_id="req_1")
    try:
        structlog.get_logger().info("hello", user="alice")
    finally:
        structlog.contextvars.clear_contextvars()
        structlog.reset_defaults()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    if is_json:
        assert json.loads(line) | {"timestamp": None} == {
            "event": "hello", "user": "alice", "request_id": "req_1", "level": "info", "timestamp": None}
    else:
        assert "hello" in line and "alice" in line and "req_1" in line
        with pytest.raises(json.JSONDecodeError):
            json.loads(line)
    with pytest.raises(ConfigError, match="log.format"):
        load_config(overrides={"log": {"format": "xml"}})
