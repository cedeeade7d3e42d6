"""Failure classes a request can end in, and their HTTP status codes, in one place.

A bad request is not a dead engine: each class names what went wrong so the edge (HTTP now, gRPC
later) can answer with the right code and a message that says why.
"""

from __future__ import annotations


class RequestError(Exception):
    """A request that cannot be served; `http_status` and `kind` go into the error body."""

    http_status = 500
    kind = "internal_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(RequestError):
    http_status = 400
    kind = "invalid_request_error"


class Unauthorized(RequestError):
    http_status = 401
    kind = "authentication_error"


class ModelNotFound(RequestError):
    http_status = 404
    kind = "model_not_found"


class Overloaded(RequestError):
    """Queues are full: retry later (HTTP 429 with Retry-After)."""

    http_status = 429
    kind = "rate_limit_exceeded"


class PoolUnavailable(RequestError):
    """No healthy node can take the request (HTTP 503)."""

    http_status = 503
    kind = "service_unavailable"


class DeadlineExceeded(RequestError):
    http_status = 504
    kind = "timeout"


class EngineFailed(RequestError):
    """The engine failed while serving the request after output had started."""

    http_status = 500
    kind = "engine_error"


def error_body(error: RequestError) -> dict:
    """OpenAI-style error JSON."""
    return {
        "error": {
            "message": error.message,
            "type": error.kind,
            "param": error.param,
            "code": error.http_status,
        }
    }
