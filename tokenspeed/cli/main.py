"""``tokenspeed`` command line: generate, chat, inspect, bench (and serve).

Every command runs the embedded SmolLM2-135M-Instruct unless ``--model`` names a Hugging
Face directory or a GGUF file. A bad argument or input ends the command with one line
on stderr, not a traceback. Sampling flags left out take the model's defaults
(``LLM.get_default_sampling_params``), as Python and the server do. Nothing here imports
torch until a command runs: ``--help`` answers at once.
"""

import argparse
import os
import sys

from tokenspeed.cli import bench, inspect_cmd, serve_cmd
from tokenspeed.cli.arg_types import at_least
from tokenspeed.cli.help_format import show_defaults
from tokenspeed.execution.ladders import MAX_DRAFT_TOKENS

SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "seed", "stop")
MODEL_DEFAULT = "the model's generation_config.json, else {}"


def main(argv=None) -> None:
    """Bad input (a ``RefusedRequest`` among the ``ValueError``s) ends the command with one
    line; an ``InternalError`` is a fault in tokenspeed, so it passes with its traceback. A
    reader that closes the pipe early (``| head``) ends it quietly, as it ends other tools."""
    args = parser().parse_args(argv)
    try:
        args.run(args)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # the exit's flush finds no pipe
        sys.exit(1)
    except (ValueError, TypeError, FileNotFoundError, NotImplementedError, ConnectionError) as exc:
        sys.exit(f"{_prog(args)}: error: {exc}")
    except KeyboardInterrupt:
        sys.exit(130)


def _prog(args) -> str:
    """The command as argparse names it in its own errors: ``tokenspeed bench latency``,
    not ``tokenspeed bench``, for a subcommand of bench."""
    return " ".join(filter(None, ("tokenspeed", args.command, getattr(args, "kind", None))))


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="tokenspeed", description=__doc__.split("\n\n")[0].replace("``", ""))
    commands = top.add_subparsers(dest="command", required=True)
    generate = _engine_command(commands, "generate", "complete a prompt, streaming the text", cmd_generate)
    generate.add_argument("prompt", help="the prompt text")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _sampling_options(generate, max_tokens=128)
    chat = _engine_command(commands, "chat", "talk to the model (an empty line, /exit, /quit or Ctrl-D ends; "
                                             "Ctrl-C stops a reply)", cmd_chat)
    chat.add_argument("--system", default=None, help="a system message")
    _sampling_options(chat, max_tokens=256)
    serve_cmd.add_options(_engine_command(commands, "serve", "an OpenAI-compatible HTTP server",
                                          lambda args: serve_cmd.run(args, llm_options(args, max_num_seqs=args.max_num_seqs))))
    inspect_cmd.add_command(commands)
    bench.add_command(commands, _engine_options)
    show_defaults(top)
    return top


def _engine_command(commands, name: str, help_text: str, run) -> argparse.ArgumentParser:
    command = commands.add_parser(name, help=help_text, description=help_text)
    _engine_options(command)
    command.set_defaults(run=run)
    return command


def _engine_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--model", default=None,
                         help="a Hugging Face model directory or id (owner/name, through the Hugging Face cache) "
                              "or a GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    command.add_argument("--revision", default=None,
                         help="with a model id: its branch, tag or commit (default: main)")
    command.add_argument("--device", default=None, help="cpu or cuda (default: cuda when a GPU is available, else cpu)")
    command.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    command.add_argument("--quantization", default=None,
                         help="quantize a 16- or 32-bit model's weights at load: fp8 (e4m3, one scale per "
                              "output channel) or int4 (the CPU: int4 layers with a scale and zero per 32 "
                              "inputs, an int8 head; a GGUF file's weights are read dequantized, then "
                              "quantized); default: the weights as stored")
    command.add_argument("--max-model-len", type=at_least(1), default=None,
                         help="the longest context, prompt and output (default: the model's)")
    command.add_argument("--max-chunk-tokens", type=at_least(1), default=None,
                         help="the most prompt tokens a step computes for one request, so that others keep "
                              "flowing during a long prompt (default: 256 on the CPU, else the step's budget)")
    command.add_argument("--enforce-eager", action="store_true", help="capture no graphs")
    command.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                         help="share of the GPU's memory the engine may fill, weights, graphs and KV "
                              "pool included (the pool is sized after the captures)")
    command.add_argument("--num-kv-pages", type=at_least(2), default=None,
                         help="the KV pool's pages of 16 tokens, as vLLM's --num-gpu-blocks-override sets its "
                              "blocks (default: sized by --gpu-memory-utilization on a GPU, 512 MiB on the CPU, "
                              "at most as many sequences at full length as run at once)")
    command.add_argument("--kv-cache-dtype", default="auto",
                         help="what the KV cache stores: auto (the model's dtype), fp8 or fp8_e4m3 (float8 "
                              "e4m3 with per-layer scales: twice the tokens fit)")
    command.add_argument("--speculative-tokens", type=at_least(0, MAX_DRAFT_TOKENS), default=0,
                         help="verify up to K drafts per decode step, n-grams or --draft-model's (0: off; "
                              "outputs are unchanged)")
    command.add_argument("--draft-model", default=None,
                         help="with --speculative-tokens: drafts from this smaller model of the same "
                              "vocabulary instead of n-grams")


def _sampling_options(command: argparse.ArgumentParser, max_tokens: int) -> None:
    """Sampling flags: each left out takes the model's default (vLLM's fields of its
    generation_config.json), else ``SamplingParams``' (``max_tokens``: this command's)."""
    command.set_defaults(fallback_max_tokens=max_tokens)
    command.add_argument("--max-tokens", type=int, help="tokens to generate at most (default: "
                         + MODEL_DEFAULT.format(max_tokens) + ")")
    for flag, kind, fallback, meaning in (("--temperature", float, "1.0", "0 is greedy"),
                                          ("--top-p", float, "1.0", "nucleus sampling's share"),
                                          ("--top-k", int, "0, off", "sample among the k most likely"),
                                          ("--min-p", float, "0.0", "drop tokens below this share of the best"),
                                          ("--repetition-penalty", float, "1.0", "Hugging Face's")):
        command.add_argument(flag, type=kind, help=f"{meaning} (default: {MODEL_DEFAULT.format(fallback)})")
    command.add_argument("--seed", type=int, help="makes the samples reproducible (default: none)")
    command.add_argument("--stop", action="append", help="a stop string (repeatable; default: none)")


def load_llm(args, **options):
    from tokenspeed.api.llm import LLM
    return LLM(args.model, **llm_options(args, **options))


def default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def llm_options(args, **options) -> dict:
    """``LLM`` keyword arguments from the engine options on the command line."""
    from tokenspeed.engine.speculative import SpeculativeConfig
    for name in ("max_model_len", "max_chunk_tokens", "num_kv_pages"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.draft_model is not None and not args.speculative_tokens:
        raise ValueError("--draft-model needs --speculative-tokens K (drafts per step)")
    if args.speculative_tokens:
        method = "ngram" if args.draft_model is None else "draft"
        options["speculative"] = SpeculativeConfig(method, args.speculative_tokens, draft_model=args.draft_model)
    for name in ("revision", "quantization"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    return dict(device=args.device or default_device(), dtype=args.dtype, enforce_eager=args.enforce_eager,
                gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_dtype=args.kv_cache_dtype,
                **options)


def sampling(args, model_defaults: dict | None = None):
    """The flags given over ``model_defaults`` (the LLM's ``sampling_defaults``), over the
    command's own ``max_tokens``; without ``model_defaults``, the flags alone are checked
    (before a model loads)."""
    from tokenspeed.execution.sampling_params import SamplingParams
    given = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    return SamplingParams(**{"max_tokens": args.fallback_max_tokens, **(model_defaults or {}), **given})


def cmd_generate(args) -> None:
    sampling(args)   # bad flags are refused before the model loads
    llm, prompt = load_llm(args, max_num_seqs=1), args.prompt
    params = sampling(args, llm.sampling_defaults)
    if args.chat:
        prompt = llm.chat_prompt([{"role": "user", "content": prompt}])
    _streamed_reply(llm, prompt, params, fit=args.max_tokens is None)


CHAT_ENDS = ("/exit", "/quit")   # typed to leave a chat, as other chat prompts take them


def cmd_chat(args) -> None:
    from tokenspeed.errors import RefusedRequest
    sampling(args)
    llm = load_llm(args, max_num_seqs=1)
    template = llm.tokenizer.chat_template if llm.tokenizer is not None else None
    if template is None or template.problem is not None:   # said now, not after a first message
        why = "has no chat template" if template is None else \
            f"has a chat template that cannot be used ({template.problem})"
        raise ValueError(f"{args.model}: this model {why}, so it cannot chat; use tokenspeed generate with a prompt")
    params = sampling(args, llm.sampling_defaults)
    history = [{"role": "system", "content": args.system}] if args.system else []
    print(f"chat with the model; an empty line, {' or '.join(CHAT_ENDS)} or Ctrl-D ends; Ctrl-C stops a reply",
          file=sys.stderr)
    while (line := _read_line()) and line not in CHAT_ENDS:
        turn = [*history, {"role": "user", "content": line}]
        try:
            reply = _streamed_reply(llm, llm.chat_prompt(turn), params, fit=args.max_tokens is None, stoppable=True)
        except RefusedRequest as exc:   # too long for the context: the chat goes on without it
            if exc.field not in ("prompt", "max_tokens"):
                raise
            print(f"tokenspeed chat: {exc} (the message was dropped; send a shorter one, or start a "
                  "new chat for more room)", file=sys.stderr)
            continue
        history = [*turn, {"role": "assistant", "content": reply}]


def _streamed_reply(llm, prompt, params, fit: bool, stoppable: bool = False) -> str:
    """``fit``: ``max_tokens`` is a default (the model's or the command's), cut to the room
    the context leaves the prompt rather than refused (``prompt_limits.fitted``).
    ``stoppable``: Ctrl-C ends the reply where it is (its request aborted), not the
    command, as llama.cpp's and Ollama's chats take it; the text so far is the reply."""
    if fit:
        from tokenspeed.api.prompts import parse_prompts
        from tokenspeed.scheduling.prompt_limits import fitted
        [prompt] = parse_prompts(prompt, llm.tokenizer)   # tokenized once: stream takes the record
        params = fitted(llm.engine.limits, len(prompt.token_ids), params)
    reply, pieces = [], llm.stream(prompt, params)
    try:
        for piece in pieces:
            reply.append(piece)
            print(piece, end="", flush=True)
    except KeyboardInterrupt:
        if not stoppable:
            raise
        pieces.close()
        print(" [stopped]", end="")
    print()
    return "".join(reply)


def _read_line() -> str:
    try:
        return input("> ").strip()
    except EOFError:
        return ""


if __name__ == "__main__":
    main()
