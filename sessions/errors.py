"""Session domain errors. Neither this package nor the stores raise HTTP errors: the gateway maps
these to statuses once (``gateway/controllers/sessions.py``).

    | error               | meaning                                             | HTTP |
    |---------------------|-----------------------------------------------------|------|
    | SessionNotFound     | no such session for this tenant (or it expired)     | 404  |
    | InvalidMessages     | appended messages break the conversation's rules    | 400  |
    | TurnInProgress      | the session is running another turn                | 409  |
    | VersionConflict     | a compare-and-set lost against a concurrent writer  | 409  |
    | SessionTooLarge     | the session would exceed the store's byte bound     | 413  |
    | StoreUnavailable    | the store cannot be reached                         | 503  |
"""

from __future__ import annotations


class SessionError(Exception):
    """Base class. ``param`` names the offending request parameter, where there is one."""

    code = "session_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class SessionNotFound(SessionError):
    code = "session_not_found"

    def __init__(self, session_id: str) -> None:
        super().__init__(f"No session found with id '{session_id}'.", param="session_id")
        self.session_id = session_id


class InvalidMessages(SessionError):
    code = "invalid_value"


class TurnInProgress(SessionError):
    code = "turn_in_progress"

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"Session '{session_id}' is running another turn; wait for it to end (or cancel it) "
            "before sending the next one.",
        )


class VersionConflict(SessionError):
    code = "conflict"

    def __init__(self, session_id: str, expected: int, found: int | None) -> None:
        super().__init__(
            f"Session '{session_id}' changed concurrently (expected version {expected}, "
            f"found {found})."
        )
        self.expected = expected
        self.found = found


class SessionTooLarge(SessionError):
    code = "session_too_large"

    def __init__(self, session_id: str, size_bytes: int, max_bytes: int) -> None:
        super().__init__(
            f"Session '{session_id}' would take {size_bytes} bytes; the session store keeps at "
            f"most {max_bytes} bytes per session.", param="messages",
        )


class StoreUnavailable(SessionError):
    code = "service_unavailable"
