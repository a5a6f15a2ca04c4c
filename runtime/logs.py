"""structlog set-up, called only by entrypoints; ids are bound per request with contextvars."""

from __future__ import annotations

import logging
import sys

import structlog

from whet.config.settings import LogConfig


def configure_logging(config: LogConfig) -> None:
    level = getattr(logging, config.level.upper())
    renderer = structlog.processors.JSONRenderer() if config.is_json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(level, logging.WARNING), stream=sys.stderr)
