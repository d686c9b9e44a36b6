"""Structured logs: one JSON object per line, `extra=` fields included.

Daemons log through the standard `logging` module; this formatter turns each
record (and whatever the call put in `extra`) into a JSON line that log
shippers can index without parsing prose.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
}


class JsonFormatter(logging.Formatter):
    def __init__(self, static: dict[str, str] | None = None) -> None:
        super().__init__()
        self.static = static or {}

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **self.static,
        }
        for k, v in record.__dict__.items():
            if k not in _STANDARD and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(fmt: str, level: str = "INFO", static: dict[str, str] | None = None) -> None:
    """Route the root logger to stderr as JSON lines (`fmt="json"`) or plain text."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(static))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # pysyncobj logs every reconnect attempt at WARNING; keep them out of INFO-level
    # operation logs unless asked for.
    logging.getLogger("pysyncobj").setLevel("ERROR" if level.upper() != "DEBUG" else "DEBUG")
