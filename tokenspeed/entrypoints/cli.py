"""``tokenspeed`` command line: demo, inspect, generate."""

import argparse
import os
from pathlib import Path

import torch

import tokenspeed as ts
from tokenspeed.models.random import TINY_LLAMA, save_random

DEFAULT_MODEL_DIR = Path(os.environ.get("TOKENSPEED_HOME", Path.home() / ".cache" / "tokenspeed")) / "tiny-llama"


def default_model() -> Path:
    """The embedded default: a small random Llama, built and saved on first use."""
    if not (DEFAULT_MODEL_DIR / "config.json").exists():
        save_random(TINY_LLAMA, DEFAULT_MODEL_DIR, seed=0)
    return DEFAULT_MODEL_DIR


def cmd_inspect(args) -> None:
    model = ts.models.load(args.model or default_model(), device=args.device)
    traced = ts.trace(model)
    for mode in ("prefill", "decode"):
        lowered = traced.lower(mode)
        print(lowered.as_text() if args.full else _summary(lowered))


def cmd_generate(args) -> None:
    llm = ts.LLM(args.model or default_model(), device=args.device, enforce_eager=args.enforce_eager)
    prompts = [[int(t) for t in p.split(",")] for p in args.prompt]
    params = ts.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for out in llm.generate(prompts, params):
        print(f"prompt {list(out.prompt_token_ids)} -> {list(out.token_ids)} ({out.finish_reason})")


def cmd_demo(args) -> None:
    path = args.model or default_model()
    print(f"# model: {path}")
    llm = ts.LLM(path, device=args.device)
    for lowered in llm.compiled.lowered.values():
        print(f"\n# {_summary(lowered)}")
    prefill = llm.compiled.lowered["prefill"]
    for stage, segments in prefill.stages.items():
        print(f"\n## prefill stage {stage}\n" + "\n\n".join(s.as_text() for s in segments[-2:]))
    print("\n# pass history (prefill): " + " -> ".join(h.pass_name for h in prefill.history))
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    for out in llm.generate(prompts, ts.SamplingParams(temperature=0.0, max_tokens=8)):
        print(f"prompt {list(out.prompt_token_ids)} -> {list(out.token_ids)} ({out.finish_reason})")


def _summary(lowered) -> str:
    kinds = [s.kind for s in lowered.segments]
    return (f"{lowered.mode}: {len(kinds)} segments ({kinds.count('graph')} graph, "
            f"{kinds.count('break')} break); " + ", ".join(s.name for s in lowered.segments))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="tokenspeed")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn in (("demo", cmd_demo), ("inspect", cmd_inspect), ("generate", cmd_generate)):
        p = sub.add_parser(name)
        p.add_argument("--model", default=None, help="Hugging Face model directory (default: tiny random Llama)")
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        p.set_defaults(fn=fn)
    sub.choices["inspect"].add_argument("--full", action="store_true", help="print every segment's IR")
    gen = sub.choices["generate"]
    gen.add_argument("--prompt", action="append", required=True, help="comma-separated token ids")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
