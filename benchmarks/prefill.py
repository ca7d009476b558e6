"""Time to first token: our eager prefill, our prefill graphs with attention breaks
(attention eagerly between graphs), and our prefill graphs with attention captured (one
graph per stage, the default).

    python -m benchmarks.prefill [--shapes ...] [--lengths 512 2048]
"""

import argparse

import torch

import tokenspeed as ts
from benchmarks import common
from tokenspeed.backends.paged import PagedAttentionBackend
from tokenspeed.backends.support import CudaGraphSupport


class AttentionBreaks(PagedAttentionBackend):
    """The paged backend lowered with every prefill attention in an eager break."""
    cuda_graph_support = CudaGraphSupport(prefill_attention=False)


def ttft(llm, length: int) -> float:
    prompt = [[100 + j % 900 for j in range(length)]]
    params = ts.SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(prompt, params, use_tqdm=False)
    return common.median_time(lambda: llm.generate(prompt, params, use_tqdm=False), 5)


def bench_shape(shape: str, lengths) -> list[dict]:
    hf = common.hf_model(shape)
    ours = common.our_model(shape, hf)
    del hf
    kw = dict(device="cuda", max_num_seqs=32, max_model_len=4096, max_num_batched_tokens=2048,
              num_kv_pages=8192, enable_prefix_caching=False)  # each timing computes the prompt
    rows = []
    eager, graphs = ts.LLM(ours, enforce_eager=True, **kw), ts.LLM(ours, **kw)
    breaks = ts.LLM(ours, backend=AttentionBreaks(), **kw)
    for length in lengths:
        with torch.inference_mode():
            e, b, g = ttft(eager, length), ttft(breaks, length), ttft(graphs, length)
        rows.append({"shape": shape, "new_tokens": length, "eager_ms": e * 1e3, "breaks_ms": b * 1e3,
                     "graph_ms": g * 1e3, "speedup": e / g, "over_breaks": b / g,
                     "capture_s": graphs.compiled.startup.capture_seconds,
                     "graphs": graphs.compiled.startup.num_graphs,
                     "graphs_with_breaks": breaks.compiled.startup.num_graphs})
        print(common.table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=list(common.DENSE_SHAPES))
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 512, 2048])
    parser.add_argument("--json", default="results/prefill.json")
    args = parser.parse_args()
    rows = [r for s in args.shapes for r in bench_shape(s, args.lengths)]
    print(f"\n# prefill TTFT, bf16, {common.device_name()}, commit {common.git_commit()}")
    print(common.table(rows, list(rows[0])))
    common.write_json(args.json, {"commit": common.git_commit(), "device": common.device_name(), "rows": rows})


if __name__ == "__main__":
    main()
