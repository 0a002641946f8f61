"""Errors the serving logic raises, each with its HTTP status and OpenAI error type."""

from __future__ import annotations


class ServingError(Exception):
    status = 500
    type = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        if status is not None:  # an HTTP error raised by the framework itself (404 route, 405 method)
            self.status, self.type = status, "invalid_request_error"


class BadRequest(ServingError):
    status, type = 400, "invalid_request_error"


class PayloadTooLarge(ServingError):
    status, type = 413, "invalid_request_error"


class Unauthorized(ServingError):
    status, type = 401, "invalid_request_error"


class ModelNotFound(ServingError):
    status, type = 404, "invalid_request_error"


class Overloaded(ServingError):
    """The bounded queue is full: 429 with Retry-After."""

    status, type = 429, "rate_limit_exceeded"


class Timeout(ServingError):
    status, type = 504, "timeout"


class Unavailable(ServingError):
    status, type = 503, "service_unavailable"
