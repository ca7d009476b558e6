"""Who may call the server, what a request may make it run, and how a refusal looks: the
API key, CORS, a request's own chat template, and OpenAI error bodies for every error
(unknown routes and methods included, not FastAPI's ``detail``).

The key guards every route but ``/health`` (a supervisor's probe) and, unless
``Access.metrics_need_key``, ``/metrics`` (a scraper's). CORS headers are sent only for
the origins named (``vllm serve --allowed-origins`` allows every origin by default; here
none is, so that a web page cannot read a local server's answers unless it is named). A
preflight (``OPTIONS`` with ``Access-Control-Request-Method``) never needs the key: the
browser sends none with it.
"""

import secrets

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from tokenspeed.server.openai.api_error import internal_error
from tokenspeed.server.openai.protocol import APIError

OPEN_PATHS = frozenset({"/health"})
METRICS_PATH = "/metrics"
ERROR_TYPES = {401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
               413: "RequestTooLargeError", 415: "UnsupportedMediaTypeError"}


@attrs.frozen
class Access:
    """``allowed_*``: CORS, as ``vllm serve``'s ``--allowed-origins/--allowed-methods/
    --allowed-headers`` and ``--allow-credentials`` (no origin: no CORS headers at all).
    ``metrics_need_key``: whether ``/metrics`` is guarded by the server's API key too.
    ``request_chat_template``: whether a chat request may bring its own ``chat_template``
    (``--trust-request-chat-template``, as vLLM names it): the server renders it, and a
    template's loops and string products are not bounded by the body's size (a two-line
    template can build a prompt of gigabytes), so it is off unless the operator trusts the
    callers."""
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    metrics_need_key: bool = False
    request_chat_template: bool = False

    @property
    def open_paths(self) -> frozenset[str]:
        return OPEN_PATHS if self.metrics_need_key else OPEN_PATHS | {METRICS_PATH}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    error = APIError(status, message, param, ERROR_TYPES.get(status, "BadRequestError"))
    return JSONResponse(error.body(), status_code=status)


class RequireKey:
    """ASGI middleware: every route but ``open_paths`` needs ``Authorization: Bearer KEY``.
    Plain ASGI, not Starlette's ``BaseHTTPMiddleware``, which relays every streamed chunk
    through a memory stream of its own (per token, per client)."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str]):
        self.app, self.expected, self.open_paths = app, f"Bearer {api_key}".encode(), open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths and not _preflight(scope):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response(401, "missing or wrong API key (Authorization: Bearer KEY)")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _preflight(scope) -> bool:
    return scope["method"] == "OPTIONS" and b"access-control-request-method" in dict(scope["headers"])


def guard(app: FastAPI, api_key: str | None, access: Access) -> None:
    """The key check, then CORS outside it (the last added runs first), so that a
    preflight is answered before any key is asked for."""
    if api_key:
        app.add_middleware(RequireKey, api_key=api_key, open_paths=access.open_paths)
    if access.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(access.allowed_origins),
                           allow_methods=list(access.allowed_methods),
                           allow_headers=list(access.allowed_headers),
                           allow_credentials=access.allow_credentials)


def error_bodies(app: FastAPI) -> None:
    """Every error as OpenAI's ``{"error": {...}}``: refusals, routing's 404 and 405, and
    internal faults (500, naming the exception)."""
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        message = f"{request.method} {request.url.path}: {exc.detail}"
        response = error_response(exc.status_code, message)
        response.headers.update(exc.headers or {})      # 405's Allow
        return response

    @app.exception_handler(Exception)
    async def fault(request: Request, exc: Exception):
        return JSONResponse(internal_error(exc).body(), status_code=500)
