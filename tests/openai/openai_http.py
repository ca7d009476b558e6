"""Plain HTTP to the session's server (see conftest.py): the request helpers and the
OpenAI error body's check, shared by the endpoint checks."""

import json

import httpx

KEY = "sesame"
MODEL = "tiny-text"
ORIGIN = "http://allowed.example"


class Api:
    """Plain HTTP to the server: the key and a JSON content type unless told otherwise."""

    def __init__(self, base_url: str):
        self.base_url = base_url

    def post(self, path: str, body, key: str | None = KEY, content_type: str | None = "application/json", **kw):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if content_type is not None:
            headers["Content-Type"] = content_type
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return httpx.post(f"{self.base_url}{path}", content=content, headers={**headers, **kw.pop("headers", {})},
                          timeout=60, **kw)

    def request(self, method: str, path: str, key: str | None = KEY, **kw):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.request(method, f"{self.base_url}{path}", headers={**headers, **kw.pop("headers", {})},
                             timeout=60, **kw)

    def stream_lines(self, path: str, body) -> list[str]:
        """A streamed answer's ``data:`` payloads, ``[DONE]`` included."""
        with httpx.stream("POST", f"{self.base_url}{path}", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status_code == 200, response.read()
            return [line.removeprefix("data: ") for line in response.iter_lines() if line]

    def stream_chunks(self, path: str, body) -> list[dict]:
        lines = self.stream_lines(path, body)
        assert lines[-1] == "[DONE]"
        return [json.loads(line) for line in lines[:-1]]


def assert_error(response, status: int, error_type: str, param: str | None = None, says: str = "") -> dict:
    """An OpenAI error body: ``{"error": {message, type, param, code}}``."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["type"] == error_type and error["param"] == param and says in error["message"], error
    return error
