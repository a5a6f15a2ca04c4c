"""whet.config: the typed settings tree, shipped defaults, and MCP server files."""

from whet.config.settings import ConfigError, WhetConfig, load_config, shipped_path

__all__ = ["ConfigError", "WhetConfig", "load_config", "shipped_path"]
