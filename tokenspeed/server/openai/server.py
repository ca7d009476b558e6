"""``tokenspeed serve``: an OpenAI-compatible server over an engine in its own process.

Handlers (``routes``) parse and check a request, submit its prompts to the engine process
(``engine_process``) and read their answers from a mailbox that its reports feed; they
never touch the engine. The engine sends token ids: this process makes each prompt's
text, cuts it at its stop strings and decides its finish (``PromptOutput``), and tells
the engine to finish a completion a stop string ended. Every refusal is an OpenAI error body naming the field; an
internal error is a 500 (a failing engine step fails the requests then in the engine) and
the server serves on; a client that disconnects has its requests aborted at the next step.
"""

import asyncio
import contextlib
import itertools
import re
import time
from collections.abc import Callable

import attrs
from fastapi import FastAPI, Request
from pydantic import ValidationError

from tokenspeed.server.engine_client import EngineClient
from tokenspeed.server.engine_process import EngineProcess, EngineSpec
from tokenspeed.server.frozen_heap import frozen_heap
from tokenspeed.api.messages import StepReport
from tokenspeed.server.openai.access import Access, error_bodies, guard
from tokenspeed.server.openai.chat_parsers import ParserFlags
from tokenspeed.server.openai.grammar_check import Constraint, GrammarCheck
from tokenspeed.server.openai.lifecycle import SHUTDOWN_TIMEOUT_S, check_timeout, run, uvicorn_config
from tokenspeed.server.openai.listening import listening
from tokenspeed.server.openai.mailbox import Mailbox
from tokenspeed.server.openai.metrics import ServerMetrics
from tokenspeed.server.openai.api_error import APIError, failed_in_engine
from tokenspeed.server.openai.routes import add_routes
from tokenspeed.api.output_processor import PromptOutput
from tokenspeed.api.prompts import Prompt
from tokenspeed.errors import RefusedRequest
from tokenspeed.execution.sampling_params import SamplingParams
from tokenspeed.scheduling.prompt_limits import check_request
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
    """What the handlers share: the link to the engine process, the tokenizer (and the
    grammar check over its vocabulary), the chat parsers, the served name, the metrics,
    and each prompt in flight (by key).
    ``connect()``: this server's channel to the engine, the engine's ``EngineInfo``, and
    the ``EngineProcess`` where this server owns it (blocking; called once, at start).
    ``request_timeout``: seconds a request may take from its submission (None: no limit);
    past them it is aborted and answered 504. ``stop_serving``: called once the engine
    has gone (``lifecycle.DrainingServer`` sets it); ``exit_message`` then says why.
    ``parser_flags``: ``--tool-call-parser`` and ``--reasoning-parser``, resolved against
    the chat template (``parsers``)."""

    def __init__(self, connect: Callable, tokenizer: str | None, model_name: str, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, metrics_dir: str | None = None,
                 request_timeout: float | None = None, parser_flags: ParserFlags = ParserFlags()):
        check_timeout("request_timeout", request_timeout)
        self.model_name, self.api_key, self.max_body_bytes = model_name, api_key, max_body_bytes
        self.request_timeout = request_timeout
        self.tokenizer = load_tokenizer(tokenizer) if tokenizer is not None else None
        template = self.tokenizer.chat_template if self.tokenizer is not None else None
        self.parsers = parser_flags.resolve(template.source if template is not None else None)
        self.grammars = GrammarCheck(self.tokenizer)
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
            self.metrics.engine_ready(info.limits.usable_pages)
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
        """The body as ``model``: 415 unless it is declared JSON and not compressed, 413
        past the size limit, 400 for bad JSON or fields, 404 for a model not served here."""
        _check_json(request.headers.get("content-type"), request.headers.get("content-encoding"))
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
        self.check_model(body.model)
        return body

    def check_model(self, model: str | None) -> None:
        """404 for a model not served here (None: the served one)."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} is not served here (serving {self.model_name!r})",
                           "model", "NotFoundError")

    def check(self, prompts: list[Prompt], params: list[SamplingParams], field: str) -> None:
        """Refuse what the engine cannot serve, ``params[i]`` for ``prompts[i]``."""
        for i, (prompt, sampling) in enumerate(zip(prompts, params, strict=True)):
            try:
                check_request(self.limits, i, prompt.token_ids, sampling,
                              has_tokenizer=self.engine.info.has_tokenizer)
                if sampling.token_bias is not None:
                    sampling.token_bias.check_vocabulary(self.limits.vocab_size)
            except RefusedRequest as exc:
                raise APIError(400, str(exc), field if exc.field == "prompt" else exc.field) from exc

    def check_constraint(self, constraint: Constraint | None) -> None:
        """Compile ``constraint`` against the model's vocabulary: a 400 naming its field if
        it does not compile (blocking: call it off the event loop)."""
        self.grammars.check(constraint, self.limits.vocab_size)

    def submit(self, prompts: list[Prompt], params: list[SamplingParams],
               streamed: bool = True) -> tuple[list[int], Mailbox]:
        """Queue the prompts, ``params[i]`` for ``prompts[i]``; their updates arrive as
        ``(prompt index, GroupUpdate)``. ``streamed`` False (an answer sent whole): a prompt
        without stop strings gets its tokens from the engine, and its text, only once a
        completion ends, not every step (``EngineCore.add``'s ``at_end``)."""
        updates, keys = Mailbox(), []
        try:
            if not self.engine.alive:
                raise OSError("the engine process is gone")
            for i, (prompt, sampling) in enumerate(zip(prompts, params, strict=True)):
                keys.append(next(self._keys))
                output = PromptOutput(self.tokenizer, sampling, len(prompt.token_ids), streamed)
                self._in_flight[keys[-1]] = Waiting(updates, i, output)
                self.engine.submit(keys[-1], prompt, sampling, at_end=output.at_end)
                self.metrics.admitted(len(prompt.token_ids) * sampling.n)
        except OSError as exc:
            self.abort(keys)
            raise APIError(503, f"the engine is not running ({exc}; {self.engine.exit_message()})", None,
                           "ServiceUnavailableError") from exc
        except BaseException:   # a record that would not go (say, not encodable): no prompt of the
            self.abort(keys)    # request stays in flight, nor runs on in the engine with no one to read it
            raise
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
                        raise failed_in_engine(update)
                    per_prompt[index].append(update)
                    if update.finished:
                        pending.discard(index)
        finally:
            updates.close()
            self.abort(keys)
        return per_prompt


def create_app(spec: EngineSpec, model_name: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, access: Access = Access(),
               request_timeout: float | None = None, parser_flags: ParserFlags = ParserFlags()) -> FastAPI:
    """The app and its own engine process, which starts (unless started already: see
    ``serve``) and stops with the app's lifespan. ``access``: CORS and whether
    ``/metrics`` needs the key; ``parser_flags``: the chat parsers (``Server``)."""
    process = EngineProcess(spec)
    connect = lambda: (process.channels[0], process.start(), process)   # noqa: E731
    return server_app(Server(connect, spec.tokenizer, model_name, api_key, max_body_bytes,
                             request_timeout=request_timeout, parser_flags=parser_flags), access)


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
    add_routes(app, server, access)
    return app


def _check_json(content_type: str | None, encoding: str | None) -> None:
    """A body must say it is JSON: a web page may post any other type (a form's, text, a
    blob without a type) to any server without the CORS preflight that would stop it. It
    is read as sent (a compressed one would be refused as bad JSON, which it is not)."""
    if content_type is None or content_type.split(";", 1)[0].strip().lower() != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {content_type!r}", None,
                       "UnsupportedMediaTypeError")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise APIError(415, f"Content-Encoding {encoding!r} is not supported: send the body uncompressed", None,
                       "UnsupportedMediaTypeError")


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """The deepest error: of a union's branches (a message's content, a string or a list
    of parts), the one that got furthest into the value says what is wrong with it; where
    every branch of plain types failed at the top, the message lists them. The branches'
    labels (``list[...]``, a model's name, a tag) are left out of the field's path."""
    errors = exc.errors()
    error = max(errors, key=lambda e: len(e["loc"]))
    if error["type"] == "json_invalid":
        surrogate = " (a \\uD800-\\uDFFF escape is half of a UTF-16 pair: a high one, then a low one)" \
            if "hex escape" in error["msg"] else ""
        return f"invalid JSON: {error['msg'].removeprefix('Invalid JSON: ')}{surrogate}", None
    loc = error["loc"]
    branches = [e["loc"][-1] for e in errors if loc and len(e["loc"]) == len(loc) and e["loc"][:-1] == loc[:-1]]
    plain = len(branches) > 1 and all(PLAIN_TYPE.fullmatch(str(b)) for b in branches)
    message = f"expected {', '.join(branches[:-1])} or {branches[-1]}" if plain else error["msg"]
    param = str(loc[0]) if loc else None
    value = error.get("input")
    shown = f", got {value!r:.80}" if isinstance(value, (str, int, float)) and error["type"] != "missing" else ""
    return f"{_path(loc) or 'body'}: {message}{shown}", param


PLAIN_TYPE = re.compile(r"(str|int|float|bool|(list|dict)\[[\w\[\], ]*\])")


def _path(loc) -> str:
    """``messages[0].content``: indexes in brackets, a union's branch labels left out."""
    path, tagged = "", False   # tagged: the next name is a tagged union's tag (after an index, for a list's)
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
            continue
        if not (tagged or PLAIN_TYPE.fullmatch(part) or "[" in part or part[:1].isupper()):
            path += f".{part}" if path else part
        tagged = "tagged-union[" in part
    return path


def serve(spec: EngineSpec, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, shutdown_timeout: float = SHUTDOWN_TIMEOUT_S,
          request_timeout: float | None = None, access: Access = Access(),
          parser_flags: ParserFlags = ParserFlags()) -> None:
    """Start the engine (an ``EngineStartError`` says why it could not), then serve until
    SIGINT or SIGTERM (drained for ``shutdown_timeout`` seconds: ``lifecycle``); raise
    ``ServerExited`` if the engine process exits unasked."""
    check_timeout("shutdown_timeout", shutdown_timeout)
    with listening(host, port) as sock:   # a port in use is refused before the model is read
        app = create_app(spec, model_name, api_key, access=access, request_timeout=request_timeout,
                         parser_flags=parser_flags)
        config = uvicorn_config(app, host, port, "info", shutdown_timeout)
        app.state.server.connect()       # starts the engine process here, before the port is served
        print(f"tokenspeed: serving on http://{host}:{sock.getsockname()[1]}", flush=True)
        run(app, config, sockets=[sock])
