"""Where a decode step and a prefill go: graph replay time, host time, top kernels.

    python -m benchmarks.profile_step [--shape llama-3.2-1b] [--batches 1 32] [--top 12] [--format Q4_K]

``--top``: the kernels listed per profile, by total device time (each table ends with the
count of every kernel launched, so a replay's line says how many kernels a step runs).
``--format``: the random model written as a GGUF file of that block format (as
``benchmarks.quantized`` writes it) and loaded with its blocks kept; bf16 by default.
"""

import argparse
import tempfile
from pathlib import Path

import torch

import tokenspeed as ts
from benchmarks import common, quantized
from benchmarks.decode import PROMPT, our_tpot
from tokenspeed.backends.metadata import DecodeRow
from tokenspeed.execution.ladders import bucket_for
from tokenspeed.execution.sampler import RowSampling
from tokenspeed.models.random import random_model


def top_kernels(fn, n: int = 12) -> str:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    launched = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return (prof.key_averages().table(sort_by="cuda_time_total", row_limit=n, max_name_column_width=60) +
            f"\n{launched} kernels launched (as Compiled.kernels_per_step counts them)")


def model_of(shape: str, block_format: str | None, tmp: Path):
    """The random model, bf16, or written as a GGUF file of ``block_format`` and loaded with
    its blocks kept."""
    if block_format is None:
        return random_model(common.SHAPES[shape], torch.bfloat16, "cuda")
    work = quantized.Workload(shape, "cuda", "bfloat16", (1,), 0, 0, 0, 0, 0, 0)
    path = quantized.written_sources([block_format], work, tmp)[block_format]
    return ts.models.load(path, dtype=torch.bfloat16, device="cuda", quantized=True)


def decode_rows(llm, batch):
    pages = PROMPT // llm.compiled.config.page_size + 1
    return [DecodeRow(1, PROMPT, tuple(range(1 + i * pages, 1 + (i + 1) * pages))) for i in range(batch)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.2-1b", choices=common.SHAPES)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--top", type=int, default=12, help="kernels listed per profile")
    parser.add_argument("--format", choices=quantized.GGUF_FORMATS, help="GGUF blocks kept (default: bf16)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ts_profile_") as tmp:
        ours = model_of(args.shape, args.format, Path(tmp))
    llm = ts.LLM(ours, device="cuda", max_num_seqs=max(args.batches), max_model_len=4096,
                 enable_prefix_caching=False)
    greedy = ts.SamplingParams(temperature=0.0)
    with torch.inference_mode():
        for batch in args.batches:
            rung = bucket_for(llm.compiled.decode.ladder, batch)
            llm.compiled.decode.run(decode_rows(llm, batch), [RowSampling(greedy, 0)] * batch)
            graph = llm.compiled.decode.graphs[rung]
            replay = common.gpu_time(graph.replay, iters=50)
            step = common.gpu_time(lambda: llm.compiled.decode.run(decode_rows(llm, batch), [RowSampling(greedy, 0)] * batch), iters=50)
            tpot = our_tpot(llm, batch, 32)
            print(f"\n## {args.shape} decode batch {batch} (rung {rung}): replay {replay * 1e3:.3f} ms, "
                  f"runner step {step * 1e3:.3f} ms, engine TPOT {tpot * 1e3:.3f} ms")
            view = llm.compiled.decode.slots.publish(llm.compiled.decode.refresh(decode_rows(llm, batch), batch))
            sampling = llm.compiled.decode.sampling.publish(llm.compiled.decode._padded([RowSampling(greedy, 0)] * batch, batch))
            print("eager step:\n" + top_kernels(lambda: llm.compiled.decode.step(view, sampling,
                                                                            llm.compiled.decode.out[:batch]), args.top))
            print("graph replay:\n" + top_kernels(graph.replay, args.top))
        prompt = [[100 + j % 900 for j in range(512)]]
        params = ts.SamplingParams(temperature=0.0, max_tokens=1)
        llm.generate(prompt, params, use_tqdm=False)
        print("\n## prefill 512 tokens, graphs:",
              f"{common.median_time(lambda: llm.generate(prompt, params, use_tqdm=False), 5) * 1e3:.3f} ms")
        print(top_kernels(lambda: llm.generate(prompt, params, use_tqdm=False), args.top))


if __name__ == "__main__":
    main()
