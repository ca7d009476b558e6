"""``tokenspeed serve``: its flags (the engine's own are the CLI's ``_engine_options``) and
how they become the server's options. Nothing here imports torch until the command runs."""

import argparse

from tokenspeed.cli.arg_types import at_least, non_blank
from tokenspeed.execution.ladders import MAX_NUM_SEQS


def add_options(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model, as `vllm serve MODEL` takes it (or --model)")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="the port to listen on")
    serve.add_argument("--api-key", type=non_blank, default=None,
                       help="require Authorization: Bearer KEY on every route but /health (and /metrics)")
    serve.add_argument("--served-model-name", type=non_blank, default=None,
                       help="the model name clients send (default: the model id, or its file or folder name)")
    serve.add_argument("--max-num-seqs", type=at_least(1, MAX_NUM_SEQS), default=64,
                       help="requests the engine runs at once")
    serve.add_argument("--api-servers", type=at_least(1), default=1,
                       help="HTTP processes sharing the port over one engine (many streaming clients)")
    serve.add_argument("--stream-interval", type=at_least(1), default=1,
                       help="send a streamed completion's tokens every N (its first and last at once): "
                            "fewer, larger chunks cost the engine less under many clients")
    _lifecycle_options(serve)
    _access_options(serve)
    _parser_options(serve)


def _lifecycle_options(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="on SIGTERM, seconds to let requests in flight finish before they are ended")
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="seconds a request may take before it is aborted with a 504 (default: none)")


def _access_options(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--allowed-origins", nargs="*", default=[],
                       help="origins whose web pages may call the server (CORS; '*' for any; default: none)")
    serve.add_argument("--allowed-methods", nargs="*", default=["*"], help="CORS: methods allowed")
    serve.add_argument("--allowed-headers", nargs="*", default=["*"], help="CORS: request headers allowed")
    serve.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    serve.add_argument("--metrics-need-key", action="store_true",
                       help="with --api-key: /metrics needs the key too (default: open to scrapers)")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="let a chat request bring its own chat_template (the server renders it; "
                            "default: refused with a 400)")


def _parser_options(serve: argparse.ArgumentParser) -> None:
    from tokenspeed.parsers.registry import REASONING_PARSERS, TOOL_PARSERS
    serve.add_argument("--tool-call-parser", default=None,
                       help=f"how replies write tool calls: {', '.join(sorted(TOOL_PARSERS))}, or none "
                            "(default: the format the chat template teaches, if it shows one)")
    serve.add_argument("--reasoning-parser", default=None,
                       help=f"how replies write their reasoning, split off as reasoning_content: "
                            f"{', '.join(sorted(REASONING_PARSERS))}, or none (default: from the chat "
                            "template's <think>, if it has one)")


def parser_flags(args):
    """The parser flags, checked (an unknown name is refused before the engine starts)."""
    from tokenspeed.server.openai.chat_parsers import ParserFlags
    return ParserFlags(args.tool_call_parser, args.reasoning_parser)


def run(args, llm_options: dict) -> None:
    from tokenspeed.server.engine_process import EngineSpec, EngineStartError
    from tokenspeed.api.llm import checked_device, checked_dtype
    from tokenspeed.server.openai.api_servers import ServerExited, serve_many
    from tokenspeed.server.openai.server import serve
    args.model = _served_model(args.model_tag, args.model)
    if args.metrics_need_key and args.api_key is None:
        raise ValueError("--metrics-need-key guards /metrics with the API key: give --api-key too")
    checked_device(llm_options["device"]), checked_dtype(args.dtype)   # here, not in the engine
    parsers = parser_flags(args)
    spec = EngineSpec.of(args.model, args.stream_interval, **llm_options)
    name = args.served_model_name or _model_name(args.model)
    options = dict(api_key=args.api_key, shutdown_timeout=args.shutdown_timeout,
                   request_timeout=args.request_timeout, access=access(args), parser_flags=parsers)
    try:
        if args.api_servers == 1:
            serve(spec, name, host=args.host, port=args.port, **options)
        else:
            serve_many(spec, name, args.host, args.port, count=args.api_servers, **options)
    except (EngineStartError, ServerExited) as exc:
        raise ValueError(str(exc)) from exc


def access(args):
    from tokenspeed.server.openai.access import Access
    return Access(tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                  args.allow_credentials, args.metrics_need_key, args.trust_request_chat_template)


def _served_model(positional, flag):
    """``serve MODEL`` or ``serve --model MODEL``; both only when they agree."""
    if positional is not None and flag is not None and positional != flag:
        raise ValueError(f"the model is given twice, as {positional!r} and --model {flag!r}: give one")
    return positional if positional is not None else flag


def _model_name(model) -> str:
    """A model id as it is (as vLLM names it); a path by its file or folder name, the
    path made absolute first (``..`` folded, links not followed): ``serve .`` in the
    model's folder named the model "", which no client could ask for."""
    import os
    from pathlib import Path

    from tokenspeed.models.gguf import default_model_path
    from tokenspeed.models.hub import is_repo_id
    if model is not None and is_repo_id(str(model)) and not Path(model).exists():
        return str(model)
    path = Path(os.path.abspath(model or default_model_path()))
    return (path.name or str(path)).removesuffix(".gguf")
