"""What a JSON-schema constraint costs outside the model: building llguidance's view of the
vocabulary (once per model), compiling a typical schema (once per request), filling a
batch's masks at each step (on the engine's thread, overlapping the forward) and applying
them to the logits (on the device, in the step).

    python -m benchmarks.grammar_masks [--batches 1 32] [--out results/grammar_masks.json]

Every row of a batch follows one valid answer of the schema token by token, so a fill
measures masks along a real generation (keys, enums, numbers, strings). The model's
tokenizer is the default model's (SmolLM2, 49k tokens); the kernel is timed on
``[batch, vocab]`` bf16 logits, against copying the bitmask to the device.
"""

import argparse
import json
import statistics
import time

import torch

from benchmarks import common
from tokenspeed.models import default_model_path
from tokenspeed.structured import (GrammarMatcher, MaskFiller, MaskRow, StructuredOutputs,
                                   apply_token_bitmask_, compile_grammar, guidance_tokenizer, new_bitmask)
from tokenspeed.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "format": "email"}, "role": {"enum": ["admin", "editor", "viewer"]},
    "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 8},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city"]}},
    "required": ["name", "age", "role", "address"]}
ANSWER = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "role": "editor",
          "scores": [9.5, 7.25, 10], "address": {"street": "12 St James's Square", "city": "London",
                                                 "zip": "10115"}}


def seconds(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fill_times(guide, grammar, tokens: list[int], batch: int) -> list[float]:
    """Seconds per step to fill ``batch`` rows, each row at the same point of the answer."""
    matchers = [GrammarMatcher(grammar, guide) for _ in range(batch)]
    filler, bitmask, times = MaskFiller(), new_bitmask(batch, guide.vocab_size, torch.cuda.is_available()), []
    for token in tokens:
        start = time.perf_counter()
        filler.fill([MaskRow(m, row) for row, m in enumerate(matchers)], bitmask)
        times.append(time.perf_counter() - start)
        for m in matchers:
            m.accept(token)
    return times


def apply_times(vocab: int, batch: int) -> dict:
    logits = torch.randn(batch, vocab, device="cuda", dtype=torch.bfloat16)
    host = new_bitmask(batch, vocab, pin_memory=True)
    device = host.to("cuda")
    return {"apply_us": common.gpu_time(lambda: apply_token_bitmask_(logits, device), iters=200) * 1e6,
            "copy_us": common.gpu_time(lambda: device.copy_(host, non_blocking=True), iters=200) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--out", default="results/grammar_masks.json")
    args = parser.parse_args()
    tokenizer = load_tokenizer(default_model_path())
    build_s = seconds(lambda: guidance_tokenizer(tokenizer), repeats=3)
    guide = guidance_tokenizer(tokenizer)
    spec = StructuredOutputs(json=SCHEMA)
    compile_ms = seconds(lambda: GrammarMatcher(compile_grammar(spec, guide), guide)) * 1e3
    tokens = tokenizer.encode(json.dumps(ANSWER), add_special_tokens=False)
    rows = []
    for batch in args.batches:
        times = sorted(fill_times(guide, compile_grammar(spec, guide), tokens, batch))
        row = {"batch": batch, "fill_mean_us": statistics.mean(times) * 1e6,
               "fill_p50_us": times[len(times) // 2] * 1e6, "fill_max_us": times[-1] * 1e6}
        rows.append({**row, **(apply_times(guide.vocab_size, batch) if torch.cuda.is_available() else {})})
    print(f"vocabulary: {guide.vocab_size} tokens, built in {build_s:.3f} s; schema compiled "
          f"(grammar + matcher) in {compile_ms:.2f} ms; {len(tokens)} answer tokens")
    print(common.table(rows, list(rows[0])))
    common.write_json(args.out, {"commit": common.git_commit(), "device": common.device_name(),
                                 "vocab_build_s": build_s, "schema_compile_ms": compile_ms, "rows": rows})


if __name__ == "__main__":
    main()
