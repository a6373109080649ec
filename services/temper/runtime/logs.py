"""Structured (JSON lines) logs for every service, via structlog."""

from __future__ import annotations

import logging
import sys

import structlog


def setup_logging(service: str, level: str = "INFO") -> structlog.stdlib.BoundLogger:
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger(service=service)


def get_logger(**bind) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(**bind)
