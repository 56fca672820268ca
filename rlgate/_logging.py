"""structlog, configured once per entry point: JSON lines in production, console in a terminal."""

from __future__ import annotations

import logging
import sys

import orjson
import structlog
import structlog.tracebacks


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    """Configure structlog (and route the standard library's logging through the same output).

    Request-scoped keys (rollout_id, task_id, policy_version) are bound with structlog's contextvars and
    merged into every line.
    """
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    numeric = logging.getLevelNamesMapping()[level.upper()]
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        # Tracebacks without local variables: locals hold request headers and bodies (keys, prompts).
        tracebacks = structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        )
        renderer: list = [tracebacks, structlog.processors.JSONRenderer(serializer=orjson.dumps)]
        factory = structlog.BytesLoggerFactory(sys.stderr.buffer)
    else:
        renderer = [
            structlog.dev.ConsoleRenderer(
                exception_formatter=structlog.dev.RichTracebackFormatter(show_locals=False)
                if structlog.dev.rich is not None
                else structlog.dev.plain_traceback
            )
        ]
        factory = structlog.PrintLoggerFactory(sys.stderr)
    structlog.configure(
        processors=[*shared, *renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(
        level=numeric, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s", force=True
    )
