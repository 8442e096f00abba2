"""Log configuration: human text, or one JSON object per line with the request id.

``request_id`` is a context variable the request handlers set, so every line logged
while serving a request (the guard's, the upstream pool's) carries it without
being passed around. Prompts, answers and keys are never logged, in either format.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Any

import orjson

request_id: ContextVar[str | None] = ContextVar("vllm_guard_request_id", default=None)

_LEVELS = {"trace": "DEBUG"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        current = request_id.get()
        if current is not None:
            entry["request_id"] = current
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):  # structured fields of the line (log.info(extra=))
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def log_config(level: str, fmt: str) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for uvicorn's loggers and ours."""
    formatter = (
        {"()": "gateway.observe.logs.JsonFormatter"}
        if fmt == "json"
        else {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}
    )
    python_level = _LEVELS.get(level, level.upper())
    handler = {
        "class": "logging.StreamHandler",
        "formatter": "default",
        "stream": "ext://sys.stderr",
    }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": formatter},
        "handlers": {"default": handler},
        "loggers": {
            name: {"handlers": ["default"], "level": python_level, "propagate": False}
            for name in ("uvicorn", "uvicorn.error", "vllm_guard", "gateway")
        },
    }
