"""The server's answers other than 200, in OpenAI's error shape."""


class APIError(Exception):
    """An answer other than 200: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "BadRequestError"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}
