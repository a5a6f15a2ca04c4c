"""The one typed config tree.

Built once at an entrypoint with :func:`load_config`: the shipped defaults in
``config/whet.yaml``, then an optional user file (``--config FILE``), then
``WHET_*`` environment variables (``WHET_MODEL__ID=...``; ``__`` descends a
level). Everything below the entrypoint receives the resulting
:class:`WhetConfig` and never reads the environment itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict


class ConfigError(Exception):
    """A config problem a person can fix: names the key and the fix."""

    def __init__(self, key: str, problem: str, fix: str = "") -> None:
        self.key, self.problem, self.fix = key, problem, fix
        message = f"config error at '{key}': {problem}"
        if fix:
            message += f"\n  fix: {fix}"
        super().__init__(message)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # bearer API key -> user id; when empty, the request's `user` field or default_user
    api_keys: dict[str, str] = Field(default_factory=dict)
    default_user: str = "default"
    max_body_bytes: int = Field(1_000_000, gt=0)


class ModelConfig(Section):
    backend: Literal["transformers", "openai", "vllm"] = "transformers"
    # HF model id, local folder, or "demo" (the demo policy built into the data dir)
    id: str = "demo"
    # name clients use in the `model` field; defaults to the id
    served_name: str | None = None
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_new_tokens: int = Field(256, gt=0)
    max_context_tokens: int = Field(4096, gt=0)
    temperature: float = Field(0.7, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # remote backends (openai, vllm)
    base_url: str | None = None
    api_key: str | None = None
    request_timeout: float = Field(120.0, gt=0)
    # in-process generation worker threads: requests beyond this wait, never the event loop
    workers: int = Field(2, ge=1)

    @property
    def name(self) -> str:
        return self.served_name or self.id


class AgentConfig(Section):
    system_prompt: str = (
        "You are whet, a helpful personal assistant. Use the tools when they help; "
        "answer briefly and plainly."
    )
    max_steps: int = Field(6, ge=1, le=64)
    lessons_k: int = Field(4, ge=0)
    lesson_token_budget: int = Field(256, ge=0)
    # above this many tools, only the tools_k most relevant to the request are shown
    tools_k: int = Field(16, ge=1)


class McpConfig(Section):
    # path of an mcpServers JSON file; None means the shipped config/mcp.json (bundled servers)
    config: Path | None = None
    call_timeout: float = Field(30.0, gt=0)
    max_result_chars: int = Field(16_000, gt=0)
    start_timeout: float = Field(20.0, gt=0)
    restart_backoff_max: float = Field(30.0, gt=0)


class StoreConfig(Section):
    # SQLAlchemy URL; None means SQLite (WAL) at <data_dir>/whet.db
    url: str | None = None


class BusConfig(Section):
    # None: in-process bus; mqtt://host:port[/prefix]: MQTT broker
    url: str | None = None
    client_id: str | None = None

    @field_validator("url")
    @classmethod
    def _mqtt_only(cls, v: str | None) -> str | None:
        if v and not v.startswith(("mqtt://", "mqtts://")):
            raise ValueError("bus.url must start with mqtt:// or mqtts:// (or be empty for the in-process bus)")
        return v


class MemoryConfig(Section):
    embedder: Literal["auto", "minilm", "hashing"] = "auto"


class LearnerConfig(Section):
    # one adapter for everyone, or one per user (multi-LoRA); the learner itself is issue #3
    scope: Literal["global", "user"] = "global"


class LogConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    json_logs: bool = False


class WhetConfig(BaseSettings):
    """The whole resolved configuration."""

    model_config = SettingsConfigDict(env_prefix="WHET_", env_nested_delimiter="__", extra="forbid")

    data_dir: Path = Path("~/.local/share/whet")
    server: ServerConfig = Field(default_factory=ServerConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    mcp: McpConfig = Field(default_factory=McpConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    bus: BusConfig = Field(default_factory=BusConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    log: LogConfig = Field(default_factory=LogConfig)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # env beats the merged files handed in as init kwargs
        return (env_settings, init_settings)

    @property
    def data_path(self) -> Path:
        return self.data_dir.expanduser()

    @property
    def store_url(self) -> str:
        return self.store.url or f"sqlite:///{self.data_path / 'whet.db'}"

    def mcp_config_path(self) -> Path:
        return self.mcp.config.expanduser() if self.mcp.config else shipped_path("mcp.json")

    def redacted(self) -> dict[str, Any]:
        """The config as logged at start: secrets masked."""
        data = self.model_dump(mode="json")
        data["server"]["api_keys"] = [f"*** -> {user}" for user in data["server"]["api_keys"].values()]
        if data["model"]["api_key"]:
            data["model"]["api_key"] = "***"
        return data


def shipped_path(name: str) -> Path:
    return Path(str(resources.files("whet.config") / name))


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read the config file ({exc.strerror})", "pass an existing file to --config") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), f"not valid YAML: {exc}", "fix the YAML syntax at the position shown") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "the top level must be a mapping of sections", "start the file with e.g. 'model:'")
    return data


def load_config(path: Path | str | None = None, overrides: Mapping[str, Any] | None = None) -> WhetConfig:
    """Shipped defaults, then ``path``, then ``WHET_*`` env, then ``overrides`` (CLI flags).

    Raises :class:`ConfigError` naming the first bad key and how to fix it.
    """
    data = _read_yaml(shipped_path("whet.yaml"))
    if path is not None:
        data = _merge(data, _read_yaml(Path(path).expanduser()))
    try:
        config = WhetConfig(**data)
        if overrides:
            config = WhetConfig(**_merge(config.model_dump(), overrides))
    except ValidationError as exc:
        raise _config_error(exc) from None
    return config


def _config_error(exc: ValidationError) -> ConfigError:
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"]) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        section = key.rsplit(".", 1)[0] if "." in key else "the top level"
        return ConfigError(key, "unknown key", f"remove it or check the spelling; see config/whet.yaml for the keys of {section}")
    if kind == "literal_error":
        return ConfigError(key, err["msg"], "use one of the values listed")
    return ConfigError(key, err["msg"], f"set {key} to a valid value (env: WHET_{key.upper().replace('.', '__')})")
