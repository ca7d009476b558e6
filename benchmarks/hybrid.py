"""Hybrid models through ``ts.LLM`` (issue 36's figures): a Qwen3-Next shape of 24 layers,
hidden 2048, 18 gated-DeltaNet layers to 6 gated attention layers (dense MLPs), beside a
dense Qwen3 of the same size, both with random weights.

    python -m benchmarks.hybrid [--shapes qwen3-next-24l qwen3-24l] [--batches 1 32]
                                [--prefill 8192 32768] [--hf-batches 1] [--json results/hybrid.json]
    python -m benchmarks.hybrid --tiny      (CPU, tiny shapes: runs in seconds, means nothing)

Decode: ``decode_prompt``-token prompts, then the time per token of ``new_tokens`` more,
from the batch's last first token to its last token (the prefill's breaks, which read the
host, vary by more than the decode steps take, so runs are not subtracted). Floor: the
weights, the attention layers' cache halfway through the tokens timed, and each
sequence's recurrent states read and written once a step, over the measured
device-to-device copy bandwidth. Prefill: one prompt of each
``--prefill`` length to its first token (prefix caching off: each timing computes it).
Memory: the states a sequence holds, the cache bytes a token holds, one ``kv_tokens``-token
sequence, and how many of those fit in ``--memory-gib``. transformers (eager ``generate``;
on CUDA its Qwen3-Next layers call fla's kernels too) runs the hybrid shape at
``--hf-batches``.
"""

import argparse
import statistics
import sys

import attrs
import torch

import tokenspeed as ts
from benchmarks import common
from benchmarks.quantized import prompts
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.random import random_model

_BASE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
             num_attention_heads=16, num_key_value_heads=2, head_dim=256, max_position_embeddings=65536,
             rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=151645)
SHAPES = {
    "qwen3-next-24l": dict(_BASE, architectures=["Qwen3NextForCausalLM"], linear_num_key_heads=16,
                           linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                           linear_conv_kernel_dim=4, num_experts=0, full_attention_interval=4,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}),
    "qwen3-24l": dict(_BASE, architectures=["Qwen3ForCausalLM"],
                      rope_parameters={"rope_type": "default", "rope_theta": 1e7}),
}
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16,
            eos_token_id=2)   # one of its own ids: the shape's is past this vocabulary


@attrs.frozen
class Workload:
    """What every shape measures (field names as ``quantized``'s timings read them)."""
    device: str
    dtype: str
    batches: tuple[int, ...]
    hf_batches: tuple[int, ...]
    prefills: tuple[int, ...]
    decode_prompt: int
    new_tokens: int
    repeats: int
    kv_tokens: int

    def engine_options(self) -> dict:
        longest = max(self.prefills + (self.decode_prompt + self.new_tokens + 1,))
        return dict(device=self.device, max_num_seqs=max(self.batches), max_model_len=longest + 1,
                    max_num_batched_tokens=min(8192, longest), enable_prefix_caching=False)


WORKLOADS = {"full": Workload("cuda", "bfloat16", (1, 32), (1,), (8192, 32768), 512, 64, 3, 32768),
             "tiny": Workload("cpu", "float32", (1, 2), (1,), (64,), 16, 2, 1, 32768)}


def shape_config(shape: str, tiny: bool) -> dict:
    return {**SHAPES[shape], **TINY} if tiny else SHAPES[shape]


def state_bytes(model) -> int:
    """One sequence's recurrent states (0 for a model without recurrent layers)."""
    return model.model.state_pools.slot_bytes if model.config.hybrid is not None else 0


def floor_seconds(model, batch: int, work: Workload, bandwidth: float | None) -> float | None:
    if bandwidth is None:
        return None
    element = next(model.parameters()).element_size()
    cache = common.kv_bytes(model.config, batch, work.decode_prompt + work.new_tokens // 2, element)
    return (common.weight_bytes(model) + cache + 2 * batch * state_bytes(model)) / bandwidth


def decode_seconds(llm, batch: int, work: Workload) -> float:
    """The median over repeats of the time per step once every request has its first token:
    the last first token to the last finish (the requests of an earlier prefill chunk
    finish a step or two before it, so the last steps may run fewer rows)."""
    batch_prompts = prompts(batch, work.decode_prompt, llm.model.config.vocab_size)
    params = ts.SamplingParams(temperature=0.0, max_tokens=work.new_tokens, ignore_eos=True)
    llm.generate(batch_prompts, params, use_tqdm=False)
    per_run = []
    for _ in range(work.repeats):
        m = [o.metrics for o in llm.generate(batch_prompts, params, use_tqdm=False)]
        per_run.append((max(r.finish_time for r in m) - max(r.first_token_time for r in m)) / (work.new_tokens - 1))
    return statistics.median(per_run)


def prefill_ms(llm, tokens: int, work: Workload) -> float:
    prompt = prompts(1, tokens, llm.model.config.vocab_size)
    params = ts.SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(prompt, params, use_tqdm=False)
    return common.median_time(lambda: llm.generate(prompt, params, use_tqdm=False), work.repeats) * 1e3


def bench_shape(shape: str, work: Workload, tiny: bool, bandwidth: float | None, memory_bytes: int) -> list[dict]:
    config = shape_config(shape, tiny)
    model = random_model(config, getattr(torch, work.dtype), work.device)
    llm = ts.LLM(model, **work.engine_options())
    rows = []
    with torch.inference_mode():
        for batch in work.batches:
            seconds, floor = decode_seconds(llm, batch, work), floor_seconds(model, batch, work, bandwidth)
            rows.append({"shape": shape, "batch": batch, "ours_ms": seconds * 1e3,
                         "floor_ms": floor * 1e3 if floor else None, "x_floor": seconds / floor if floor else None})
        prefills = {f"prefill_{n}_ms": prefill_ms(llm, n, work) for n in work.prefills}
    rows[0] = {**rows[0], **prefills, **memory_figures(model, work, memory_bytes)}
    del llm, model
    common.release_memory()
    return with_hf(rows, config, work) if "Next" in config["architectures"][0] else rows


def memory_figures(model, work: Workload, memory_bytes: int) -> dict:
    element = next(model.parameters()).element_size()
    per_token = common.kv_bytes(model.config, 1, 1, element)
    sequence = state_bytes(model) + per_token * work.kv_tokens
    return {"state_mb_per_seq": state_bytes(model) / 1e6, "kv_bytes_per_token": per_token,
            "seq_gb": sequence / 1e9, "seqs_fit": memory_bytes // sequence}


def with_hf(rows: list[dict], config: dict, work: Workload) -> list[dict]:
    """transformers' eager ``generate`` beside ours at ``hf_batches``."""
    if not work.hf_batches:
        return rows
    hf = common.hf_model_of(config, getattr(torch, work.dtype), work.device)
    out = []
    for row in rows:
        if row["batch"] in work.hf_batches:
            ids = torch.tensor(prompts(row["batch"], work.decode_prompt, config["vocab_size"]), device=work.device)
            run = lambda n: hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,  # noqa: E731
                                        pad_token_id=0, eos_token_id=None)
            with torch.inference_mode():
                run(work.new_tokens)
                seconds = (common.median_time(lambda: run(work.new_tokens + 1), work.repeats) -
                           common.median_time(lambda: run(1), work.repeats)) / work.new_tokens
            row = {**row, "hf_eager_ms": seconds * 1e3, "x_vs_hf": seconds * 1e3 / row["ours_ms"]}
        out.append(row)
    del hf
    common.release_memory()
    return out


def columns(work: Workload) -> list[str]:
    return (["shape", "batch", "ours_ms", "floor_ms", "x_floor", "hf_eager_ms", "x_vs_hf"] +
            [f"prefill_{n}_ms" for n in work.prefills] + ["state_mb_per_seq", "kv_bytes_per_token", "seq_gb",
                                                          "seqs_fit"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (checks that it runs)")
    parser.add_argument("--batches", nargs="+", type=int)
    parser.add_argument("--prefill", nargs="*", type=int, help="prompt lengths to time (full: 8192 32768)")
    parser.add_argument("--hf-batches", nargs="*", type=int, help="transformers' (full: 1; none: no peer)")
    parser.add_argument("--memory-gib", type=float, default=100.0, help="memory of the seqs_fit figure")
    parser.add_argument("--json", default="results/hybrid.json")
    args = parser.parse_args()
    work = WORKLOADS["tiny" if args.tiny else "full"]
    work = attrs.evolve(work, batches=tuple(args.batches or work.batches),
                        prefills=work.prefills if args.prefill is None else tuple(args.prefill),
                        hf_batches=work.hf_batches if args.hf_batches is None else tuple(args.hf_batches))
    bandwidth = common.copy_bandwidth() if work.device == "cuda" else None
    common.release_memory()
    header = {"commit": common.git_commit(), "device": common.device_name() if work.device == "cuda" else "cpu",
              "bandwidth": bandwidth, "memory_gib": args.memory_gib, "workload": attrs.asdict(work)}
    rows = []
    for shape in args.shapes:
        rows += bench_shape(shape, work, args.tiny, bandwidth, int(args.memory_gib * 2**30))
        common.write_json(args.json, {**header, "rows": rows})
        print(common.table(rows, columns(work)), file=sys.stderr, flush=True)
    band = f"copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else "no floor on the CPU"
    print(f"\n# Hybrid decode, {work.dtype}, {header['device']}, commit {header['commit']}, {band}; decode: ms per "
          f"token after {work.decode_prompt}-token prompts; seqs_fit: {work.kv_tokens}-token sequences in "
          f"{args.memory_gib} GiB")
    print(common.table(rows, columns(work)))


if __name__ == "__main__":
    main()
