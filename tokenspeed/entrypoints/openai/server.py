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

import attrs
import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from tokenspeed.entrypoints.engine_client import EngineClient
from tokenspeed.entrypoints.engine_process import EngineProcess, EngineSpec
from tokenspeed.entrypoints.frozen_heap import frozen_heap
from tokenspeed.entrypoints.messages import StepReport
from tokenspeed.entrypoints.openai import responses
from tokenspeed.entrypoints.openai.access import Access, error_bodies, guard
from tokenspeed.entrypoints.openai.lifecycle import SHUTDOWN_TIMEOUT_S, check_timeout, run, uvicorn_config
from tokenspeed.entrypoints.openai.mailbox import Mailbox
from tokenspeed.entrypoints.openai.metrics import ServerMetrics
from tokenspeed.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                                    DetokenizeRequest, TokenizeRequest)
from tokenspeed.entrypoints.output_processor import PromptOutput
from tokenspeed.entrypoints.prompts import Prompt, chat_prompt, parse_prompts
from tokenspeed.errors import RefusedRequest
from tokenspeed.runtime.prompt_limits import check_request
from tokenspeed.tokenizer import load_tokenizer

MAX_BODY_BYTES = 4 << 20
DISCONNECT_POLL_S = 0.5


@attrs.frozen
class Waiting:
    """A prompt in flight: its answers so far, and where its handler reads them (as
    ``(index, GroupUpdate)``: the prompt's index in its request)."""
    mailbox: Mailbox
    index: int
    output: PromptOutput


class Server:
    """What the handlers share: the link to the engine process, the tokenizer, the served
    name, the metrics, and each prompt in flight (by key).
    ``connect()``: this server's channel to the engine, the engine's ``EngineInfo``, and
    the ``EngineProcess`` where this server owns it (blocking; called once, at start).
    ``request_timeout``: seconds a request may take from its submission (None: no limit);
    past them it is aborted and answered 504. ``stop_serving``: called once the engine
    has gone (``lifecycle.DrainingServer`` sets it); ``exit_message`` then says why."""

    def __init__(self, connect: Callable, tokenizer: str | None, model_name: str, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, metrics_dir: str | None = None,
                 request_timeout: float | None = None):
        check_timeout("request_timeout", request_timeout)
        self.model_name, self.api_key, self.max_body_bytes = model_name, api_key, max_body_bytes
        self.request_timeout = request_timeout
        self.tokenizer = load_tokenizer(tokenizer) if tokenizer is not None else None
        self.metrics = ServerMetrics(metrics_dir)
        self.connect = connect
        self.engine: EngineClient | None = None
        self.stop_serving: Callable[[], None] | None = None
        self.exit_message: str | None = None
        self._in_flight: dict[int, Waiting] = {}
        self._keys = itertools.count()

    async def start(self) -> None:
        """Connect to the engine (starting it where this server owns it), then take its
        reports on this loop."""
        if self.engine is None:
            channel, info, process = await asyncio.to_thread(self.connect)
            self.engine = EngineClient(channel, info, self._dispatch, self._fail_all, process)
        await self.engine.listen()

    @property
    def limits(self):
        return self.engine.info.limits

    def _dispatch(self, report: StepReport) -> None:
        """Each prompt's token update through its ``PromptOutput`` (the text, the stop
        strings: a completion one ended is finished in the engine), then to its mailbox;
        a prompt aborted here (its client left) is only counted once the engine ends it."""
        self.metrics.load(report.load)
        for key, update in report.updates:
            waiting = self._in_flight.get(key)
            if waiting is None:
                if update.finished:
                    self.metrics.finished_group(update.completed)
                continue
            answer, stopped = waiting.output.update(update)
            for index in stopped:
                with contextlib.suppress(OSError):   # a dead engine has nothing to finish
                    self.engine.finish(key, index)
            if answer is not None:
                waiting.mailbox.put((waiting.index, answer))
            if update.finished:
                self.metrics.finished_group(waiting.output.completed(update.completed))
                del self._in_flight[key]

    def _fail_all(self, message: str) -> None:
        """The engine process exited (or its loop failed): its requests fail at once, and
        the server stops serving, so that the process exits and its supervisor restarts it."""
        self.exit_message = message
        self.fail_all(APIError(503, f"{message}; the server is stopping", None, "ServiceUnavailableError"))
        if self.stop_serving is not None:
            self.stop_serving()

    def fail_all(self, error: APIError) -> None:
        """End every request in flight with ``error`` (their prompts are aborted as their
        handlers finish)."""
        for waiting in self._in_flight.values():
            waiting.mailbox.fail(error)

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
                check_request(self.limits, i, prompt.token_ids, params,
                              has_tokenizer=self.engine.info.has_tokenizer)
            except RefusedRequest as exc:
                raise APIError(400, str(exc), field if exc.field == "prompt" else exc.field) from exc

    def submit(self, prompts: list[Prompt], params) -> tuple[list[int], Mailbox]:
        """Queue the prompts; their updates arrive as ``(prompt index, GroupUpdate)``."""
        updates, keys = Mailbox(), []
        try:
            if not self.engine.alive:
                raise OSError("the engine process is gone")
            for i, prompt in enumerate(prompts):
                keys.append(next(self._keys))
                self._in_flight[keys[-1]] = Waiting(updates, i, PromptOutput(self.tokenizer, params,
                                                                             len(prompt.token_ids)))
                self.engine.submit(keys[-1], prompt, params)
                self.metrics.admitted(len(prompt.token_ids) * params.n)
        except OSError as exc:
            self.abort(keys)
            raise APIError(503, f"the engine is not running ({exc}; {self.engine.exit_message()})", None,
                           "ServiceUnavailableError") from exc
        if self.request_timeout is not None:
            updates.fail_after(self.request_timeout, APIError(
                504, f"the request took longer than the server's limit of {self.request_timeout:g} s", None,
                "TimeoutError"))
        return keys, updates

    def abort(self, keys) -> None:
        """Stop the prompts of ``keys`` whose answers are not final (one that is waits
        for the engine's end of it, to count it as answered)."""
        for key in keys:
            waiting = self._in_flight.get(key)
            if waiting is not None and not waiting.output.finished:
                del self._in_flight[key]
                with contextlib.suppress(OSError):   # a dead engine has nothing to abort
                    self.engine.abort(key)

    async def collect(self, request: Request, keys, updates) -> list:
        """Every prompt's updates, in order, until all finish; aborts if the client leaves,
        or if the mailbox fails (the engine exited, the deadline passed: that error)."""
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
            updates.close()
            self.abort(keys)
        return per_prompt


def create_app(spec: EngineSpec, model_name: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, access: Access = Access(),
               request_timeout: float | None = None) -> FastAPI:
    """The app and its own engine process, which starts (unless started already: see
    ``serve``) and stops with the app's lifespan. ``access``: CORS and whether
    ``/metrics`` needs the key."""
    process = EngineProcess(spec)
    connect = lambda: (process.channels[0], process.start(), process)   # noqa: E731
    return server_app(Server(connect, spec.tokenizer, model_name, api_key, max_body_bytes,
                             request_timeout=request_timeout), access)


def server_app(server: Server, access: Access = Access()) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await server.start()
        with frozen_heap():
            yield
        await server.engine.stop()

    app = FastAPI(title="tokenspeed", lifespan=lifespan)
    app.state.server = server
    error_bodies(app)
    guard(app, server.api_key, access)
    _routes(app, server)
    return app


def _routes(app: FastAPI, server: Server) -> None:
    @app.get("/health")
    async def health():
        return Response(status_code=200 if server.engine.responsive() else 503)

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
        params = body.sampling_params(_max_tokens(server, body.max_tokens, prompts), body.logprobs,
                                      server.engine.info.sampling_defaults)
        return await _answer(server, request, body, prompts, params, "prompt", responses.CompletionFormat(
            server.model_name, server.tokenizer, params.n, params.skip_special_tokens))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await server.read(request, ChatCompletionRequest)
        body.unsupported()
        prompts = [await _chat_prompt(server, body.messages, body.add_generation_prompt)]
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling_params(_max_tokens(server, limit, prompts), body.logprobs_count(),
                                      server.engine.info.sampling_defaults)
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
            try:
                arrived = await updates.take_all()
            except APIError as exc:   # the engine exited, the server is stopping, the deadline
                yield _error_event(exc)
                return
            for index, update in arrived:   # one write for all that arrived
                if update.error:
                    yield "".join(events) + _error_event(APIError(500, update.error, None, "InternalServerError"))
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
        updates.close()
        server.abort(keys)


def _error_event(error: APIError) -> str:
    """A stream's last write when it fails: the error's body as an event, then the end."""
    return f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n"


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
          api_key: str | None = None, shutdown_timeout: float = SHUTDOWN_TIMEOUT_S,
          request_timeout: float | None = None, access: Access = Access()) -> None:
    """Start the engine (an ``EngineStartError`` says why it could not), then serve until
    SIGINT or SIGTERM (drained for ``shutdown_timeout`` seconds: ``lifecycle``); raise
    ``ServerExited`` if the engine process exits unasked."""
    app = create_app(spec, model_name, api_key, access=access, request_timeout=request_timeout)
    config = uvicorn_config(app, host, port, "info", shutdown_timeout)   # bad options refused first
    app.state.server.connect()   # starts the engine process here, before the port is bound
    run(app, config)
