"""Structured logging: JSON lines (default) or text, one format for every service."""

from __future__ import annotations

import json
import logging
import sys
import time

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line; ``extra=`` fields become top-level keys."""

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """Human-readable lines; ``extra=`` fields are appended as key=value."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extras = {k: v for k, v in vars(record).items() if k not in _STANDARD}
        if extras:
            text += " " + " ".join(f"{k}={v}" for k, v in extras.items())
        return text


def setup_logging(service: str, level: str = "INFO", fmt: str = "json") -> None:
    """Configure the root logger for a service process (call once, from main)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(TextFormatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
