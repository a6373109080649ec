"""Domain errors and their gRPC status codes: one mapping used by every service.

Core code raises these (it never imports grpc); the server's interceptor turns them into a
status with the offending field named, so a bad request never kills a service.
"""

from __future__ import annotations

import grpc


class TemperError(Exception):
    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


class InvalidArgument(TemperError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(TemperError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(TemperError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(TemperError):
    """Too busy now; ``retry_after_ms`` (if set) goes to the caller as retry advice (gRPC's retry pushback)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, field: str | None = None, retry_after_ms: int = 0):
        super().__init__(message, field)
        self.retry_after_ms = retry_after_ms


class DeadlineExceeded(TemperError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(TemperError):
    """The caller went away (its RPC is no longer active): nothing was done for it."""

    code = grpc.StatusCode.CANCELLED


class Unimplemented(TemperError):
    code = grpc.StatusCode.UNIMPLEMENTED


def require(condition: bool, field: str, message: str) -> None:
    """Raise InvalidArgument naming ``field`` unless ``condition`` holds."""
    if not condition:
        raise InvalidArgument(message, field=field)


def reject_unknown_fields(message, field: str) -> None:
    """INVALID_ARGUMENT if ``message`` (or a sub-message) carries fields this schema does not know.

    Protobuf keeps unknown fields silently; for request parameters that means a client's
    setting would be ignored without a word, so it is refused instead.
    """
    from google.protobuf.unknown_fields import UnknownFieldSet

    unknown = UnknownFieldSet(message)
    if len(unknown):
        numbers = sorted({f.field_number for f in unknown})
        raise InvalidArgument(f"unknown field number(s) {numbers}", field=field)
    for desc, value in message.ListFields():
        if desc.message_type is not None and not desc.is_repeated:
            reject_unknown_fields(value, f"{field}.{desc.name}")
