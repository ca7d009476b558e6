"""Decode time per output token with a JSON-schema constraint on every row, against the same
engine unconstrained; and what compiling a typical schema costs.

    python -m benchmarks.structured_decode [--shapes smollm2-135m llama-3.2-1b] [--batches 1 32]
    python -m benchmarks.structured_decode --shapes tiny --batches 1 2 --new-tokens 4 --device cpu

Random weights of each shape (bf16 on a GPU), over the default model's tokenizer (SmolLM2's
49,152 tokens): the 1B shape's vocabulary is wider (128,256), and the grammar's view of it
is padded with empty tokens no mask allows. Every row decodes greedily through a schema it
cannot complete within the run (an array of at least a thousand objects of enums, bounded
integers and short strings), so each row runs its whole length under masks; the ratio
``x_plain`` is constrained over unconstrained time per token, both with overlap (the
engine's default). ``fill_ms`` and ``accept_ms`` are the host's share of a constrained
step, on the engine's thread, replayed from the run's own tokens through the engine's
grammars (a batch's masks, its tokens fed to the matchers): a step is host-bound when
they, with the plain step's host work, pass the forward. Writes one table and a JSON file.
"""

import argparse
import json
import statistics
import time

import torch

import tokenspeed as ts
from benchmarks import common
from tokenspeed.models import default_model_path
from tokenspeed.models.random import random_model
from tokenspeed.structured import (GrammarMatcher, MaskFiller, MaskRow, StructuredOutputs, compile_grammar,
                                   guidance_tokenizer, new_bitmask)
from tokenspeed.tokenizer import load_tokenizer

PROMPT = 512
ITEM = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 100000},
    "kind": {"enum": ["book", "film", "song", "game"]},
    "title": {"type": "string", "maxLength": 24},
    "rating": {"type": "number", "minimum": 0, "maximum": 5},
    "tags": {"type": "array", "items": {"enum": ["new", "classic", "popular"]}, "maxItems": 3}},
    "required": ["id", "kind", "title"], "additionalProperties": False}
ENDLESS = {"type": "array", "items": ITEM, "minItems": 1000}    # no row completes it in a run
TYPICAL = {"type": "object", "properties": {"user": ITEM, "items": {"type": "array", "items": ITEM}},
           "required": ["user"]}
TINY = {**common.SHAPES["smollm2-135m"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def shape_config(shape: str) -> dict:
    return TINY if shape == "tiny" else common.SHAPES[shape]


def tpot(llm, batch: int, new_tokens: int, spec: StructuredOutputs | None) -> tuple[float, list]:
    """Seconds per output token (the difference of a run of ``new_tokens + 1`` and one of 1),
    and the last long run's token ids per row."""
    prompts = [[100 + (7 * i + j) % 900 for j in range(PROMPT)] for i in range(batch)]
    outputs = []
    run = lambda n: outputs.append(llm.generate(prompts, ts.SamplingParams(  # noqa: E731
        temperature=0.0, max_tokens=n, ignore_eos=True, structured_outputs=spec), use_tqdm=False))
    run(4)
    long = common.median_time(lambda: run(new_tokens + 1), 3)
    tokens = [list(o.outputs[0].token_ids) for o in outputs[-1]]
    return (long - common.median_time(lambda: run(1), 3)) / new_tokens, tokens


def host_costs(llm, spec: StructuredOutputs, tokens: list[list[int]]) -> dict:
    """Milliseconds per step of a batch's mask fill and of feeding its tokens to the matchers."""
    matchers = llm.engine.grammars.matchers(spec, len(tokens))
    filler, bitmask = MaskFiller(), new_bitmask(len(tokens), llm.engine.vocab_size)
    fill = accept = 0.0
    for step in range(len(tokens[0])):
        start = time.perf_counter()
        filler.fill([MaskRow(m, row) for row, m in enumerate(matchers)], bitmask)
        middle = time.perf_counter()
        for m, row in zip(matchers, tokens):
            m.accept(row[step])
        fill, accept = fill + middle - start, accept + time.perf_counter() - middle
    return {"fill_ms": fill / len(tokens[0]) * 1e3, "accept_ms": accept / len(tokens[0]) * 1e3}


def compile_times(tokenizer) -> dict:
    """The vocabulary's view, built once per model; a typical schema compiled with its matcher."""
    start = time.perf_counter()
    guide = guidance_tokenizer(tokenizer)
    build_s = time.perf_counter() - start
    spec, times = StructuredOutputs(json=TYPICAL), []
    for _ in range(5):
        start = time.perf_counter()
        GrammarMatcher(compile_grammar(spec, guide), guide)
        times.append(time.perf_counter() - start)
    return {"vocab_build_s": build_s, "schema_compile_ms": statistics.median(times) * 1e3}


def bench_shape(shape: str, batches, new_tokens: int, device: str, tokenizer, done: list) -> None:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = random_model(shape_config(shape), dtype, device)
    llm = ts.LLM(model, device=device, tokenizer=tokenizer, max_num_seqs=max(batches), max_model_len=4096,
                 max_num_batched_tokens=2048, enable_prefix_caching=False)   # repeated prompts would hit
    spec = StructuredOutputs(json=ENDLESS)
    for batch in batches:
        with torch.inference_mode():
            plain, _ = tpot(llm, batch, new_tokens, None)
            constrained, tokens = tpot(llm, batch, new_tokens, spec)
        row = {"shape": shape, "vocab": model.config.vocab_size, "batch": batch, "plain_ms": plain * 1e3,
               "constrained_ms": constrained * 1e3, "x_plain": constrained / plain,
               **host_costs(llm, spec, tokens)}
        done.append(row)
        print(common.table([row], list(row)), flush=True)
    del llm, model
    common.release_memory()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama-3.2-1b"],
                        choices=["tiny", *common.SHAPES])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer directory or GGUF file (default: the default model's)")
    parser.add_argument("--json", default="results/structured_decode.json")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.tokenizer or default_model_path())
    compiled = compile_times(tokenizer)
    rows = []
    for shape in args.shapes:
        bench_shape(shape, args.batches, args.new_tokens, args.device, tokenizer, rows)
    print(f"\n# decode under a JSON schema, greedy, prompt {PROMPT}, {common.device_name()} (host: "
          f"{common.host_name()}), commit {common.git_commit()}; vocabulary view built in "
          f"{compiled['vocab_build_s']:.3f} s, a typical schema compiled in {compiled['schema_compile_ms']:.2f} ms")
    print(common.table(rows, list(rows[0])))
    common.write_json(args.json, {"commit": common.git_commit(), "device": common.device_name(),
                                  "host": common.host_name(), **compiled,
                                  "schema": json.dumps(ENDLESS), "rows": rows})


if __name__ == "__main__":
    main()
