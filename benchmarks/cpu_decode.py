"""Decode on the CPU: the embedded default model through ``ts.LLM`` (``float32``: its
default, the file's Q4_1 and Q8_0 blocks with float32 activations and sums; and
``quantization="int4"``) against transformers on the same file (dequantized to float32),
side by side in one run, and the memory floors.

    python -m benchmarks.cpu_decode [--batches 1 4] [--prompt 128] [--new-tokens 32] [--rounds 5]
                                    [--ours float32 int4]

transformers reads the same GGUF file (``gguf_file=``, dequantized to float32) and runs its
eager ``generate`` (greedy, its dynamic cache); all use the threads ``ts.LLM`` sized from
the CPU affinity. A time per output token is the difference of a run of ``new_tokens + 1``
and one of 1, over ``new_tokens``. The machines this runs on are shared and noisy, so the
engines alternate, ``rounds`` times each, and each figure is the median of its rounds.
Floor: the weight bytes a decode step of each of ours reads over the measured read
bandwidth (a sum over a tensor far larger than the caches).
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

import tokenspeed as ts
from benchmarks import common
from tokenspeed.models import default_model_path


def read_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes a second torch's threads read (``torch.sum`` of a float32 tensor of ``nbytes``)."""
    data = torch.ones(nbytes // 4)
    float(data.sum())
    return nbytes / common.median_time(lambda: float(data.sum()), 5)


def run_seconds(generate, tokens: int) -> float:
    start = time.perf_counter()
    generate(tokens)
    return time.perf_counter() - start


def per_token(generate, new_tokens: int) -> float:
    return (run_seconds(generate, new_tokens + 1) - run_seconds(generate, 1)) / new_tokens


def ours(llm, prompts):
    params = lambda n: ts.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    return lambda n: llm.generate(prompts, params(n), use_tqdm=False)


def theirs(model, prompts):
    ids = torch.tensor(prompts)

    def generate(n):
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
    return generate


OURS = {"float32": None, "int4": "int4"}   # our engines: name -> ts.LLM's quantization (None: the blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ours", nargs="+", default=list(OURS), choices=list(OURS),
                        help="our engines: the default float32 and quantization='int4' (transformers' stays float32)")
    parser.add_argument("--json", default="results/cpu_decode.json")
    args = parser.parse_args()
    import transformers
    llms = {name: ts.LLM(quantization=OURS[name]) for name in args.ours}   # threads sized from the affinity
    path = Path(default_model_path())
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    bandwidth = read_bandwidth()
    floors = {name: common.weight_bytes(llm.model) / bandwidth for name, llm in llms.items()}
    rows = []
    for batch in args.batches:
        prompts = [[100 + (7 * i + j) % 900 for j in range(args.prompt)] for i in range(batch)]
        engines = {**{name: ours(llm, prompts) for name, llm in llms.items()}, "transformers": theirs(hf, prompts)}
        times = {name: [] for name in engines}
        for generate in engines.values():
            generate(2)   # warm-up
        for _ in range(args.rounds):
            for name, generate in engines.items():
                times[name].append(per_token(generate, args.new_tokens))
        median = {name: statistics.median(t) for name, t in times.items()}
        row = {"batch": batch, **{f"{name}_ms": s * 1e3 for name, s in median.items()}}
        row.update({f"{name}_speedup": median["transformers"] / median[name] for name in llms})
        row.update({f"{name}_floor_ms": floors[name] * 1e3 for name in llms})
        rows.append(row)
        print(common.table(rows[-1:], list(rows[-1])), flush=True)
    print(common.table(rows, list(rows[0])))
    common.write_json(args.json, {"benchmark": "cpu_decode", "commit": common.git_commit(),
                                  "threads": torch.get_num_threads(), "prompt": args.prompt,
                                  "new_tokens": args.new_tokens, "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
