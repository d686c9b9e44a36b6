"""Client-facing errors: an HTTP status and an OpenAI-style JSON error body."""

from __future__ import annotations

import json


class RequestError(Exception):
    """A request the gateway refuses (4xx) or cannot serve (5xx), with a readable message."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> bytes:
        kind = "invalid_request_error" if self.status < 500 else "service_unavailable"
        err = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return json.dumps({"error": err}).encode()


def bad_request(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, param, "bad_request")
