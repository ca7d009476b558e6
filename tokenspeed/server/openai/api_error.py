"""The server's answers other than 200, in OpenAI's error shape."""

import contextlib
import re


class APIError(Exception):
    """An answer other than 200: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "BadRequestError"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}


def failed_in_engine(update) -> APIError:
    """A prompt's update that ended it with an error, as the answer: a 400 where the request's
    own settings ended it (``refused``: its constraints left it no token), else a 500."""
    if update.refused:
        return APIError(400, update.error, None, "BadRequestError")
    return APIError(500, f"the request failed in the engine: {update.error}", None, "InternalServerError")


def internal_error(exc: Exception) -> APIError:
    """A fault in the server (a 500 naming the exception)."""
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", None, "InternalServerError")


@contextlib.contextmanager
def named_as_sent(sent: str, read_as: str):
    """Refusals naming ``read_as`` name ``sent`` instead: the field the request gave its value
    in (chat's ``max_completion_tokens``, read as ``max_tokens``), as the refused field or
    as another's bound (``min_tokens=5: must be <= max_tokens=3``)."""
    try:
        yield
    except APIError as exc:
        if sent == read_as or read_as not in exc.message:
            raise
        param = sent if exc.param == read_as else exc.param
        raise APIError(exc.status, re.sub(rf"\b{read_as}\b", sent, exc.message), param, exc.type) from exc
