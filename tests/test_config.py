"""The config tree: defaults, file, env, flags; and one clear error for bad input."""

from __future__ import annotations

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
    config = load_config(path, overrides={"server": {"port": 9100}})
    assert config.model.id == "from-env"
    assert config.model.temperature == 0.1  # the file's value survives where env is silent
    assert config.server.port == 9100


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
