"""OpenAI-style errors: ``{"error": {"message", "type", "code", "param"}}`` with the right HTTP status."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered to the client as OpenAI-style JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.kind, self.param = status, message, code, kind, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "code": self.code, "param": self.param}}


def bad_request(message: str, code: str = "invalid_request", param: str | None = None) -> APIError:
    return APIError(400, message, code, param=param)


def unauthorized(message: str = "missing or invalid API key: send 'Authorization: Bearer <key>'") -> APIError:
    return APIError(401, message, "invalid_api_key", kind="authentication_error")


def forbidden(message: str) -> APIError:
    return APIError(403, message, "forbidden", kind="permission_error")


def not_found(message: str, code: str) -> APIError:
    return APIError(404, message, code)


def busy(session_id: str) -> APIError:
    return APIError(
        409,
        f"session {session_id!r} is busy with another request; retry when it is done",
        "session_busy",
        kind="conflict_error",
    )


def too_large(message: str) -> APIError:
    return APIError(413, message, "request_too_large")


def memory_full(message: str) -> APIError:
    """The KV pool's cap (``--kv-memory``) left no room for this request even after paging out every idle
    session: the server is overloaded, the client may retry."""
    return APIError(503, message, "kv_memory_full", kind="server_error")
