"""The one structlog set-up of every pagedserve process: the API server (``server/cli.py``)
and each engine-core process (``actors/engine_core/proc.py``) call ``configure_logging``.

Key-value lines on stderr, one event name each, with the level and an ISO time; exceptions
with their traceback. ``context`` is bound to every line of the process (an engine-core
process's ``engine`` rank), so interleaved lines say whose they are."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str, **context: object) -> None:
    """Log at ``level`` (``debug``, ``info``, ``warning``, ``error``) and above."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    if context:
        structlog.contextvars.bind_contextvars(**context)
