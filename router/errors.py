"""Failure classes a request can end in, and their HTTP and gRPC status codes, in one place.

A bad request is not a dead engine: each class names what went wrong so both edges (HTTP in
openai_http.py, gRPC in grpc_api.py) answer with the right code and a message that says why.
`kind` is also the `outcome` label of `pdserve_requests_total`.
"""

from __future__ import annotations


class RequestError(Exception):
    """A request that cannot be served; `http_status` and `kind` go into the error body."""

    http_status = 500
    grpc_status = "INTERNAL"
    """Name of the grpc.StatusCode member (kept as a name so this module imports nothing)."""
    kind = "internal_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(RequestError):
    http_status = 400
    grpc_status = "INVALID_ARGUMENT"
    kind = "invalid_request_error"


class Unauthorized(RequestError):
    http_status = 401
    grpc_status = "UNAUTHENTICATED"
    kind = "authentication_error"


class ModelNotFound(RequestError):
    http_status = 404
    grpc_status = "NOT_FOUND"
    kind = "model_not_found"


class PayloadTooLarge(RequestError):
    http_status = 413
    grpc_status = "RESOURCE_EXHAUSTED"
    kind = "request_too_large"


class RequestTimeout(RequestError):
    """The client did not send the request's body in time (`router.body_timeout_s`)."""

    http_status = 408
    grpc_status = "DEADLINE_EXCEEDED"
    kind = "request_timeout"


class SlowReader(RequestError):
    """A streaming client stopped reading while its request ran on: the router held its
    deltas up to a bound (router/links/token_stream.py) and then cancelled the request."""

    http_status = 408
    grpc_status = "DEADLINE_EXCEEDED"
    kind = "client_too_slow"


class Overloaded(RequestError):
    """Queues are full: retry later (HTTP 429 with Retry-After)."""

    http_status = 429
    grpc_status = "RESOURCE_EXHAUSTED"
    kind = "rate_limit_exceeded"


class PoolUnavailable(RequestError):
    """No healthy node can take the request (HTTP 503)."""

    http_status = 503
    grpc_status = "UNAVAILABLE"
    kind = "service_unavailable"


class DeadlineExceeded(RequestError):
    http_status = 504
    grpc_status = "DEADLINE_EXCEEDED"
    kind = "timeout"


class EngineFailed(RequestError):
    """The engine failed while serving the request after output had started."""

    http_status = 500
    kind = "engine_error"


class NodeFailed(EngineFailed):
    """The node died or became unreachable while serving (router/decides/retry.py may run the
    request again); `pool` names the pool it belonged to, once the pool has seen it. `died`: its
    engine or its actor died while running the request, which may be what killed it (unreachable or
    silent nodes are not counted so)."""

    def __init__(self, message: str, pool: str | None = None, died: bool = False) -> None:
        super().__init__(message)
        self.pool = pool
        self.died = died


class KVTransferFailed(EngineFailed):
    """The decode node could not load the prefill's KV and the failure policy is `fail`."""

    kind = "kv_transfer_failed"


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


def for_status(status: int, message: str = "") -> RequestError:
    """The error a face answered with `status` stands for (its `kind` labels the count): the
    first class with that HTTP status, any other 4xx a bad request, any other 5xx internal."""
    for cls in (
        InvalidRequest, Unauthorized, ModelNotFound, PayloadTooLarge, RequestTimeout,
        Overloaded, PoolUnavailable, DeadlineExceeded,
    ):  # fmt: skip
        if cls.http_status == status:
            return cls(message)
    return InvalidRequest(message) if 400 <= status < 500 else RequestError(message)
