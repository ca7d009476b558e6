"""The OpenAI-compatible endpoints: each reads and checks its request, submits its prompts
through the ``Server`` and answers whole or as a stream of server-sent events. A request's
constraint on its output (``response_format``, ``structured_outputs``, a required or named
tool call) is compiled before it is queued, off the event loop (``Server.check_constraint``);
a request without one makes no trip to a worker thread for it."""

import asyncio
import importlib.metadata
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING

import attrs
import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from tokenspeed.server.openai import responses
from tokenspeed.server.openai.access import Access
from tokenspeed.server.openai.api_error import failed_in_engine, internal_error, named_as_sent
from tokenspeed.server.openai.chat_protocol import ChatCompletionRequest, TokenizeRequest
from tokenspeed.server.openai.chat_replies import ReplyParsing
from tokenspeed.server.openai.protocol import APIError, CompletionRequest, DetokenizeRequest
from tokenspeed.server.openai.tool_use import tool_use
from tokenspeed.api.prompts import Prompt, chat_prompt, parse_prompts
from tokenspeed.scheduling.prompt_limits import fitted
from tokenspeed.tokenizer.chat_template import ChatTemplateRefusal

if TYPE_CHECKING:
    from tokenspeed.server.openai.server import Server

MAX_HEADER_ID = 256   # characters of a body's request_id sent back as the X-Request-Id header


def add_routes(app: FastAPI, server: "Server", access: Access = Access()) -> None:
    @app.api_route("/health", methods=["GET", "HEAD"])   # load balancers probe with either
    async def health():
        return Response(status_code=200 if server.engine.responsive() else 503)

    @app.get("/version")
    async def version():   # vLLM's route; behind the key, as every route but /health is here
        return {"version": importlib.metadata.version("tokenspeed")}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return responses.model_list(server.model_name, server.limits.max_model_len,
                                    server.limits.vocab_size)

    @app.get("/v1/models/{model:path}")   # a path: model names hold slashes (owner/name)
    async def model(model: str):
        server.check_model(model)
        return responses.model_card(server.model_name, server.limits.max_model_len, server.limits.vocab_size)

    @app.post("/v1/completions")
    async def completions(request: Request, response: Response):
        body = await server.read(request, CompletionRequest)
        body.unsupported()
        prompts = await _prompts(body.prompt, server.tokenizer)
        constraint = body.output_constraint()
        if constraint is not None:
            await asyncio.to_thread(server.check_constraint, constraint)
        params = body.sampling_params(body.max_tokens, body.logprobs,
                                      server.engine.info.sampling_defaults, constraint)
        per_prompt = _completion_params(server, body, prompts, params)
        server.check(prompts, per_prompt, "prompt")   # before echo spells ids: they are in the vocabulary
        echoed = await asyncio.to_thread(_echoed, server, prompts) if body.echo else ()
        return await _answer(server, request, response, body, prompts, per_prompt, responses.CompletionFormat(
            server.model_name, server.tokenizer, params.n, params.skip_special_tokens, echoed,
            continuous_usage=body.continuous_usage))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, response: Response):
        body = await server.read(request, ChatCompletionRequest)
        _check_template(access, body)
        tools, constraint = await _chat_constraint(server, body)
        prompts = [await _chat_prompt(server, body)]
        with named_as_sent("max_tokens" if body.max_completion_tokens is None else "max_completion_tokens",
                           "max_tokens"):
            params = _chat_params(server, body, tools, constraint)
            server.check(prompts, [params], "messages")
            parsing = ReplyParsing.of(_reasoning_parser(server, constraint), tools.parser, tools.single,
                                      prompts[0].text)
            return await _answer(server, request, response, body, prompts, [params], responses.ChatFormat(
                server.model_name, server.tokenizer, params.n, params.skip_special_tokens, parsing,
                continuous_usage=body.continuous_usage, echoed=body.echoed()))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await server.read(request, TokenizeRequest)
        body.check_input()
        _check_template(access, body)
        tokenizer = _tokenizer(server, "prompt" if body.prompt is not None else "messages")
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens) \
            if body.prompt is not None else \
            (await _chat_prompt(server, body)).token_ids
        return {"tokens": list(ids), "count": len(ids),
                "max_model_len": server.limits.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await server.read(request, DetokenizeRequest)
        vocab = server.limits.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        # special tokens kept, as vLLM's /detokenize keeps them: /tokenize's ids come back whole
        return {"prompt": await asyncio.to_thread(_tokenizer(server, "tokens").decode, body.tokens, False)}


async def _answer(server: "Server", request: Request, response: Response, body, prompts, params, fmt):
    """``params[i]`` for ``prompts[i]``, checked by the caller (``Server.check``). The
    answer's id is the request's (``_request_id``), and goes back as its header too."""
    request_id = _request_id(request, body)
    headers = {"X-Request-Id": request_id} if _fits_a_header(request_id) else {}
    keys, updates = server.submit(prompts, params, streamed=bool(body.stream))
    if body.stream:
        prompt_tokens = [len(prompt.token_ids) for prompt in prompts]
        return StreamingResponse(_stream(server, keys, updates, fmt, body.include_usage, request_id, prompt_tokens),
                                 media_type="text/event-stream", headers=headers)
    per_prompt = await server.collect(request, keys, updates)
    response.headers.update(headers)
    return fmt.complete(per_prompt, created=int(time.time()), request_id=request_id)


def _request_id(request: Request, body) -> str:
    """As vLLM names a request: by the client's ``X-Request-Id`` header, else the body's
    ``request_id``, else a fresh one; the answer's ``id`` ends with it, so that a client
    (or a proxy that set the header) finds its request by the id it chose."""
    return request.headers.get("x-request-id") or body.request_id or uuid.uuid4().hex


def _fits_a_header(value: str) -> bool:
    """Whether a body's ``request_id`` can go back as a header as it is (a header's own
    value always can): printable ASCII, not a page of it."""
    return len(value) <= MAX_HEADER_ID and value.isascii() and value.isprintable()


async def _stream(server: "Server", keys, updates, fmt, include_usage: bool, request_id: str,
                  prompt_tokens: list[int]):
    """The answer's events; a failure ends the stream with an error event and [DONE]: the
    engine's (its request's error), the server's (an ``APIError``: stopping, the deadline) or
    a fault formatting the reply (a 500, logged), never a connection cut mid-stream."""
    try:
        async for text in _events(keys, updates, fmt, include_usage, request_id, prompt_tokens):
            yield text
    except APIError as exc:
        yield _error_event(exc)
    except Exception as exc:
        logging.getLogger(__name__).exception("a streamed reply failed")
        yield _error_event(internal_error(exc))
    finally:
        updates.close()
        server.abort(keys)


async def _events(keys, updates, fmt, include_usage: bool, request_id: str, prompt_tokens: list[int]):
    created = int(time.time())
    pending, usage = set(range(len(keys))), responses.Usage()
    prefix = fmt.chunk_prefix(request_id, created)
    if first := _event(fmt.first_chunks(request_id, created, prompt_tokens)):
        yield first
    while pending:
        events = []
        for index, update in await updates.take_all():   # one write for all that arrived
            if update.error:
                if events:
                    yield "".join(events)
                raise failed_in_engine(update)
            events.append(fmt.events(prefix, index, update))
            if update.finished:
                pending.discard(index)
                usage = usage.add(update)
        if not pending:   # the last tokens, the usage and the end go out in one write
            if include_usage:
                events.append(_event([fmt.usage_chunk(usage, request_id, created)]))
            events.append("data: [DONE]\n\n")
        yield "".join(events)


def _error_event(error: APIError) -> str:
    """A stream's last write when it fails: the error's body as an event, then the end."""
    return f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n"


def _event(chunks: list[dict]) -> str:
    return "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks)


async def _prompts(prompt, tokenizer) -> list[Prompt]:
    """The request's prompts; text is tokenized off the event loop (a long prompt would
    hold up every stream for as long as it takes)."""
    texts = isinstance(prompt, str) or (isinstance(prompt, list) and any(isinstance(p, str) for p in prompt))
    try:
        return await asyncio.to_thread(parse_prompts, prompt, tokenizer) if texts else \
            parse_prompts(prompt, tokenizer)
    except (TypeError, ValueError) as exc:
        raise APIError(400, str(exc), "prompt") from exc


async def _chat_constraint(server: "Server", body: ChatCompletionRequest):
    """The request's tool use and its constraint (the tool choice's or the output's),
    compiled off the event loop; a request with neither tools nor a constraint has
    nothing to compile, and stays on it."""
    compiles = body.tools or body.response_format or body.structured_outputs
    return await asyncio.to_thread(_compiled_constraint, server, body) if compiles else \
        _compiled_constraint(server, body)


def _compiled_constraint(server: "Server", body: ChatCompletionRequest):
    tools = tool_use(body, server.parsers, server.tokenizer)
    constraint = body.output_constraint()
    if tools.constraint is not None and constraint is not None:
        raise APIError(400, f"tool_choice and {constraint.field} both constrain the output: give one",
                       "tool_choice")
    constraint = tools.constraint or constraint
    server.check_constraint(constraint)
    return tools, constraint


def _completion_params(server: "Server", body: CompletionRequest, prompts: list[Prompt], params) -> list:
    """``params`` for each prompt; a default ``max_tokens`` (16, the request sent none) cut
    to the room the context leaves a prompt (``prompt_limits.fitted``), as ``LLM.generate``
    cuts its defaults: the request never asked for it. One it sent is refused past the room."""
    if "max_tokens" in body.model_fields_set:
        return [params] * len(prompts)
    return [fitted(server.limits, len(prompt.token_ids), params) for prompt in prompts]


def _chat_params(server: "Server", body: ChatCompletionRequest, tools, constraint):
    """Special tokens stay in a reply whose calls are parsed: a format's marker may be one
    (vLLM's parsers keep them likewise). No max_tokens: each prompt's output runs to the
    context's end (``SamplingParams``' None)."""
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = body.sampling_params(limit, body.logprobs_count(),
                                  server.engine.info.sampling_defaults, constraint)
    return attrs.evolve(params, skip_special_tokens=False) if tools.parser is not None else params


def _reasoning_parser(server: "Server", constraint) -> str | None:
    """None for a constrained reply: its grammar holds from the first token, so the reply
    has no thought to split off (a ``deepseek_r1`` parser would take it all for one)."""
    return None if constraint is not None else server.parsers.reasoning_parser


def _check_template(access: Access, body) -> None:
    """A request's own chat template only where the operator trusts requests with one."""
    if body.chat_template is not None and not access.request_chat_template:
        raise APIError(400, "chat_template: this server renders its model's chat template only; start it with "
                       "--trust-request-chat-template to let a request bring its own", "chat_template")


async def _chat_prompt(server: "Server", body) -> Prompt:
    """The conversation (with the tools and ``chat_template_kwargs``) through the chat
    template, off the event loop (as ``_prompts``)."""
    _tokenizer(server, "messages")
    messages, variables = body.checked_messages(), body.template_variables()
    try:
        return await asyncio.to_thread(chat_prompt, server.tokenizer, messages, body.add_generation_prompt,
                                       chat_template=body.chat_template,
                                       continue_final_message=body.continue_final_message, **variables)
    except (ValueError, jinja2.TemplateError) as exc:
        field = exc.field if isinstance(exc, ChatTemplateRefusal) else "messages"
        raise APIError(400, f"the chat template refused the messages: {exc}", field) from exc


def _echoed(server: "Server", prompts: list[Prompt]) -> tuple[str, ...]:
    """Each prompt's text as sent, or its token ids spelled, special tokens kept (``echo``)."""
    return tuple(p.text if p.text is not None else _tokenizer(server, "echo").decode(list(p.token_ids), False)
                 for p in prompts)


def _tokenizer(server: "Server", field: str):
    """The tokenizer, or a 400 naming the ``field`` that needs one (a prompt's text, a chat's
    messages, ids to spell)."""
    if server.tokenizer is None:
        raise APIError(400, f"{field}: this model has no tokenizer, so only token-id prompts to "
                       "/v1/completions are served", field)
    return server.tokenizer
