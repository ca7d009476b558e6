"""``tokenspeed serve``: an OpenAI-compatible server over an engine in its own process.

Handlers parse and check a request, submit its prompts to the engine process
(``engine_process``) and read their updates from a mailbox that its reports feed;
they never touch the engine. Every refusal is an OpenAI error body naming the field; an
internal error is a 500 (a failing engine step fails the requests then in the engine) and
the server serves on; a client that disconnects has its requests aborted at the next step.
"""

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from collections.abc import Callable

import jinja2
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from tokenspeed.entrypoints.engine_loop import GroupUpdate, StepReport
from tokenspeed.entrypoints.engine_process import EngineClient, EngineProcess, EngineSpec
from tokenspeed.entrypoints.frozen_heap import frozen_heap
from tokenspeed.entrypoints.openai import responses
from tokenspeed.entrypoints.openai.access import Access, error_bodies, guard
from tokenspeed.entrypoints.openai.mailbox import Mailbox
from tokenspeed.entrypoints.openai.metrics import ServerMetrics
from tokenspeed.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                                    DetokenizeRequest, TokenizeRequest)
from tokenspeed.entrypoints.prompts import Prompt, chat_prompt, check_request, parse_prompts
from tokenspeed.tokenizer import load_tokenizer

MAX_BODY_BYTES = 4 << 20
DISCONNECT_POLL_S = 0.5


class Server:
    """What the handlers share: the link to the engine process, the tokenizer, the served
    name, the metrics, and the callbacks of the prompts in flight (by key).
    ``connect()``: this server's pipe to the engine, the engine's ``EngineInfo``, and the
    ``EngineProcess`` where this server owns it (blocking; called once, at start)."""

    def __init__(self, connect: Callable, tokenizer: str | None, model_name: str, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, metrics_dir: str | None = None):
        self.model_name, self.api_key, self.max_body_bytes = model_name, api_key, max_body_bytes
        self.tokenizer = load_tokenizer(tokenizer) if tokenizer is not None else None
        self.metrics = ServerMetrics(metrics_dir)
        self.connect = connect
        self.engine: EngineClient | None = None
        self._callbacks: dict[int, object] = {}
        self._keys = itertools.count()

    async def start(self) -> None:
        """Connect to the engine (starting it where this server owns it), then take its
        reports on this loop."""
        if self.engine is None:
            conn, info, process = await asyncio.to_thread(self.connect)
            self.engine = EngineClient(conn, info, self._dispatch, self._fail_all, process)
        self.engine.listen(asyncio.get_running_loop())

    @property
    def limits(self):
        return self.engine.info.limits

    def _dispatch(self, report: StepReport) -> None:
        """Each update to its prompt's handler; a prompt aborted here (its client left)
        has no handler any more, and its last update is dropped."""
        self.metrics.load(report.load)
        for key, update in report.updates:
            if update.finished:
                self.metrics.finished_group(update.completed)
                callback = self._callbacks.pop(key, None)
            else:
                callback = self._callbacks.get(key)
            if callback is not None:
                callback(update)

    def _fail_all(self, message: str) -> None:
        """The engine process died: its requests fail."""
        callbacks, self._callbacks = self._callbacks, {}
        for callback in callbacks.values():
            callback(GroupUpdate((), True, 0, 0, message))

    async def read(self, request: Request, model):
        """The body as ``model``: 415 unless it is declared JSON, 413 past the size limit,
        400 for bad JSON or fields, 404 for a model not served here."""
        _check_json(request.headers.get("content-type"))
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body_bytes:
                raise APIError(413, f"request body over {self.max_body_bytes} bytes", None,
                               "RequestTooLargeError")
        try:
            body = model.model_validate_json(bytes(raw))
        except ValidationError as exc:
            raise APIError(400, *_validation_message(exc)) from exc
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"model {body.model!r} is not served here (serving {self.model_name!r})",
                           "model", "NotFoundError")
        return body

    def check(self, prompts: list[Prompt], params, field: str) -> None:
        for i, prompt in enumerate(prompts):
            try:
                check_request(self.limits, self.engine.info.has_tokenizer, i, prompt, params)
            except ValueError as exc:
                raise APIError(400, str(exc), "max_tokens" if "max_tokens" in str(exc) else field) from exc

    def submit(self, prompts: list[Prompt], params) -> tuple[list[int], Mailbox]:
        """Queue the prompts; their updates arrive as ``(prompt index, GroupUpdate)``."""
        updates, keys = Mailbox(), []
        try:
            if not self.engine.alive:
                raise OSError("the engine process is gone")
            for i, prompt in enumerate(prompts):
                keys.append(next(self._keys))
                self._callbacks[keys[-1]] = lambda u, i=i: updates.put((i, u))
                self.engine.submit(keys[-1], prompt, params)
                self.metrics.admitted(len(prompt.token_ids) * params.n)
        except OSError as exc:
            self.abort(keys)
            raise APIError(503, f"the engine is not running ({exc}; {self.engine.exit_message()})", None,
                           "ServiceUnavailableError") from exc
        return keys, updates

    def abort(self, keys) -> None:
        """Stop the prompts of ``keys`` that have not finished."""
        for key in keys:
            if self._callbacks.pop(key, None) is not None:
                with contextlib.suppress(OSError):   # a dead engine has nothing to abort
                    self.engine.abort(key)

    async def collect(self, request: Request, keys, updates) -> list:
        """Every prompt's updates, in order, until all finish; aborts if the client leaves."""
        per_prompt, pending = [[] for _ in keys], set(range(len(keys)))
        checked = time.monotonic()
        try:
            while pending:
                if time.monotonic() - checked > DISCONNECT_POLL_S:   # on a clock: updates
                    checked = time.monotonic()                          # may never pause
                    if await request.is_disconnected():
                        raise APIError(499, "client disconnected")
                try:
                    arrived = await asyncio.wait_for(updates.take_all(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    continue
                for index, update in arrived:
                    if update.error:
                        raise APIError(500, f"the request failed in the engine: {update.error}", None,
                                       "InternalServerError")
                    per_prompt[index].append(update)
                    if update.finished:
                        pending.discard(index)
        finally:
            self.abort(keys)
        return per_prompt


def create_app(spec: EngineSpec, model_name: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, access: Access = Access()) -> FastAPI:
    """The app and its own engine process, which starts (unless started already: see
    ``serve``) and stops with the app's lifespan. ``access``: CORS and whether
    ``/metrics`` needs the key."""
    process = EngineProcess(spec)
    connect = lambda: (process.conns[0], process.start(), process)   # noqa: E731
    return server_app(Server(connect, spec.tokenizer, model_name, api_key, max_body_bytes), access)


def server_app(server: Server, access: Access = Access()) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await server.start()
        with frozen_heap():
            yield
        server.engine.stop()

    app = FastAPI(title="tokenspeed", lifespan=lifespan)
    app.state.server = server
    error_bodies(app)
    guard(app, server.api_key, access)
    _routes(app, server)
    return app


def _routes(app: FastAPI, server: Server) -> None:
    @app.get("/health")
    async def health():
        return Response(status_code=200 if server.engine.alive else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return responses.model_list(server.model_name, server.limits.max_model_len,
                                    server.limits.vocab_size)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await server.read(request, CompletionRequest)
        body.unsupported()
        prompts = await _prompts(body.prompt, server.tokenizer)
        params = body.sampling_params(_max_tokens(server, body.max_tokens, prompts), body.logprobs)
        return await _answer(server, request, body, prompts, params, "prompt", responses.CompletionFormat(
            server.model_name, server.tokenizer, params.n, params.skip_special_tokens))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await server.read(request, ChatCompletionRequest)
        body.unsupported()
        prompts = [await _chat_prompt(server, body.messages, body.add_generation_prompt)]
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling_params(_max_tokens(server, limit, prompts), body.logprobs_count())
        return await _answer(server, request, body, prompts, params, "messages", responses.ChatFormat(
            server.model_name, server.tokenizer, params.n, params.skip_special_tokens))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await server.read(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        tokenizer = _tokenizer(server)
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens) \
            if body.prompt is not None else \
            (await _chat_prompt(server, body.messages, body.add_generation_prompt)).token_ids
        return {"tokens": list(ids), "count": len(ids),
                "max_model_len": server.limits.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await server.read(request, DetokenizeRequest)
        vocab = server.limits.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": await asyncio.to_thread(_tokenizer(server).decode, body.tokens)}


async def _answer(server: Server, request: Request, body, prompts, params, field: str, fmt):
    server.check(prompts, params, field)
    keys, updates = server.submit(prompts, params)
    if body.stream:
        return StreamingResponse(_stream(server, keys, updates, fmt, body.include_usage),
                                 media_type="text/event-stream")
    per_prompt = await server.collect(request, keys, updates)
    return fmt.complete(per_prompt, created=int(time.time()), request_id=uuid.uuid4().hex)


async def _stream(server: Server, keys, updates, fmt, include_usage: bool):
    request_id, created = uuid.uuid4().hex, int(time.time())
    pending, usage = set(range(len(keys))), responses.Usage()
    prefix = fmt.chunk_prefix(request_id, created)
    try:
        if first := _event(fmt.first_chunks(request_id, created, len(keys))):
            yield first
        while pending:
            events = []
            for index, update in await updates.take_all():   # one write for all that arrived
                if update.error:
                    error = APIError(500, update.error, None, "InternalServerError").body()
                    yield "".join(events) + f"data: {json.dumps(error)}\n\n"
                    return
                events.append(fmt.events(prefix, index, update))
                if update.finished:
                    pending.discard(index)
                    usage = usage.add(update)
            if not pending:   # the last tokens, the usage and the end go out in one write
                if include_usage:
                    events.append(_event([fmt.usage_chunk(usage, request_id, created)]))
                events.append("data: [DONE]\n\n")
            yield "".join(events)
    finally:
        server.abort(keys)


def _event(chunks: list[dict]) -> str:
    return "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks)


def _check_json(content_type: str | None) -> None:
    """A body must say it is JSON: a web page may post any other type (a form's, text, a
    blob without a type) to any server without the CORS preflight that would stop it."""
    if content_type is None or content_type.split(";", 1)[0].strip().lower() != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {content_type!r}", None,
                       "UnsupportedMediaTypeError")


async def _prompts(prompt, tokenizer) -> list[Prompt]:
    """The request's prompts; text is tokenized off the event loop (a long prompt would
    hold up every stream for as long as it takes)."""
    texts = isinstance(prompt, str) or (isinstance(prompt, list) and any(isinstance(p, str) for p in prompt))
    try:
        return await asyncio.to_thread(parse_prompts, prompt, tokenizer) if texts else \
            parse_prompts(prompt, tokenizer)
    except (TypeError, ValueError) as exc:
        raise APIError(400, str(exc), "prompt") from exc


async def _chat_prompt(server: Server, messages, add_generation_prompt: bool) -> Prompt:
    """The conversation through the chat template, off the event loop (as ``_prompts``)."""
    _tokenizer(server)
    try:
        return await asyncio.to_thread(chat_prompt, server.tokenizer, [m.as_template_message() for m in messages],
                                       add_generation_prompt)
    except (ValueError, jinja2.TemplateError) as exc:
        raise APIError(400, f"the chat template refused the messages: {exc}", "messages") from exc


def _max_tokens(server: Server, requested: int | None, prompts: list[Prompt]) -> int:
    """``None`` (chat's default): as many as the context leaves the longest prompt."""
    if requested is not None:
        return requested
    room = server.limits.max_model_len - max(len(p.token_ids) for p in prompts)
    return max(room, 1)


def _tokenizer(server: Server):
    if server.tokenizer is None:
        raise APIError(400, "this model has no tokenizer: send token ids", "prompt")
    return server.tokenizer


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    error = exc.errors()[0]
    if error["type"] == "json_invalid":
        return f"invalid JSON: {error['msg']}", None
    location = [str(part) for part in error["loc"] if not isinstance(part, int) or error["loc"][0] != part]
    param = ".".join(str(p) for p in error["loc"][:1]) if error["loc"] else None
    return f"{'.'.join(location) or 'body'}: {error['msg']}", param


def serve(spec: EngineSpec, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None) -> None:
    """Start the engine (an ``EngineStartError`` says why it could not), then serve."""
    app = create_app(spec, model_name, api_key)
    app.state.server.connect()   # starts the engine process here, before the port is bound
    uvicorn.Server(uvicorn_config(app, host, port, "info")).run()


def uvicorn_config(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Config:
    """uvloop's event loop and httptools' parser, named rather than left to uvicorn's "auto"
    (which takes asyncio and h11 when they are missing): with 64 streaming clients the
    server's process does little else than per-token writes, which these make cheaper."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, loop="uvloop", http="httptools")
