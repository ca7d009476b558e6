"""Mixtures of experts through ``ts.LLM`` (issue 34's speed figures): Qwen3-30B-A3B and
DeepSeek-V2-Lite with random weights, decode time per output token beside the floor and
transformers on random weights of the same law, a long prompt's prefill, and the cache a token holds.

    python -m benchmarks.moe_decode [--shapes qwen3-30b-a3b deepseek-v2-lite] [--kv-memory-gib 100]
                                    [--batches 1 8 32 128] [--hf-batches 1 32]   (none after it: no peer)
    python -m benchmarks.moe_decode --tiny        (CPU, tiny configs: runs in seconds, means nothing)
    python -m benchmarks.moe_decode --shapes deepseek-v2-lite --batches 1 --hf-batches \
        --skip-kernels triton_rope._rope_kernel     (a bound: see ``common.kernels_skipped``)

On the H200 (bfloat16), a shape a command (where one outlasts a device command's limit, split
its batches with ``--batches`` and ``--hf-batches``):

    python -m benchmarks.moe_decode --shapes qwen3-30b-a3b --json results/moe_decode_qwen3.json
    python -m benchmarks.moe_decode --shapes deepseek-v2-lite --json results/moe_decode_deepseek.json

Decode: ``decode_prompt``-token prompts, then the time per token of ``new_tokens`` more
(greedy, to the length asked), at each batch. Floor (``moe_bytes.step_bytes``): the dense
weights, the routed experts the batch is expected to touch under uniform routing (the
routing of a compiled run is not read back: the JSON's ``floor_routing`` says so), and the
cache read, over the measured device-to-device copy bandwidth. transformers runs at the
``hf_batches``: a greedy loop over a ``StaticCache`` with the one-token forward compiled
(``reduce-overhead``, as ``benchmarks.decode``), or ``generate`` eager where that does not
compile; ``hf_mode`` says which (``oom`` where its model does not fit), and the JSON keeps
the error. Ours runs first, on its own random weights, and is freed before transformers'
model is built: two copies of Qwen3-30B-A3B (57 GiB each) would leave little room for the
cache and graphs.

Per shape, on its first row: one ``prefill_tokens`` prompt to its first token; the cache
bytes per token against the multi-head equivalent (heads x (qk_head_dim + v_head_dim) x
layers x dtype bytes); the ``kv_tokens``-token sequences whose cache fits in
``--kv-memory-gib`` GiB, each way.
"""

import argparse
import sys

import attrs
import torch

import tokenspeed as ts
from benchmarks import common, moe_bytes
from benchmarks.quantized import decode_seconds, prefill_seconds, prompts
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.random import random_model

PAGE_SIZE = 16   # the engine's default (``CompileConfig.page_size``)
SHAPES = ("qwen3-30b-a3b", "deepseek-v2-lite", "moonlight-16b-a3b")
TINY_SIZES = {   # each shape's features at a size the CPU runs in seconds
    "qwen3-30b-a3b": dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=8, num_experts_per_tok=2, eos_token_id=2),
    "deepseek-v2-lite": dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                             qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8,
                             num_experts_per_tok=2, n_shared_experts=2, eos_token_id=2),
    "moonlight-16b-a3b": dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                              qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8,
                              num_experts_per_tok=2, n_shared_experts=2, n_group=4, topk_group=2, eos_token_id=2),
}


@attrs.frozen
class Workload:
    """What every shape measures, and where (field names as ``quantized``'s timings read them)."""
    device: str
    dtype: str
    batches: tuple[int, ...]
    hf_batches: tuple[int, ...]  # the batches transformers runs at too
    hf_compile: bool             # try torch.compile for transformers (eager where it fails)
    decode_prompt: int
    new_tokens: int
    prefill_tokens: int
    repeats: int
    max_model_len: int
    kv_tokens: int               # the sequence length of the "sequences that fit" figure

    def __attrs_post_init__(self):
        if not set(self.hf_batches) <= set(self.batches):
            raise ValueError(f"transformers' batches {list(self.hf_batches)} must be among the batches "
                             f"measured {list(self.batches)}")

    def engine_options(self) -> dict:
        return dict(device=self.device, max_num_seqs=max(self.batches), max_model_len=self.max_model_len,
                    max_num_batched_tokens=self.prefill_tokens, num_kv_pages=self.kv_pages(),
                    enable_prefix_caching=False)  # each timing computes its prompts

    def kv_pages(self) -> int:
        """The pages the largest batch holds at once (a page to spare a row), or the long
        prompt's: a pool no larger, so that Qwen3-30B-A3B's 57 GiB of weights leave room for
        the cache on an 80 GB card (8,192 pages of it were 12.9 GB)."""
        pages = lambda tokens: -(-tokens // PAGE_SIZE) + 1  # noqa: E731
        return max(max(self.batches) * pages(self.decode_prompt + self.new_tokens + 1),
                   pages(self.prefill_tokens)) + 1


WORKLOADS = {"full": Workload("cuda", "bfloat16", (1, 8, 32, 128), (1, 32), True, 512, 64, 2048, 3, 4096,
                              32768),
             "tiny": Workload("cpu", "float32", (1, 2), (1, 2), False, 16, 2, 32, 1, 128, 32768)}


def shape_config(shape: str, tiny: bool) -> dict:
    return {**common.SHAPES[shape], **TINY_SIZES[shape]} if tiny else common.SHAPES[shape]


# ---------------------------------------------------------------- transformers


def hf_tpot(model, batch: int, work: Workload) -> tuple[float, str, str | None]:
    """(seconds per token, mode, the compile error where compiling failed)."""
    ids = torch.tensor(prompts(batch, work.decode_prompt, model.config.vocab_size), device=work.device)
    if not work.hf_compile:
        return hf_eager_tpot(model, ids, work), "eager", None
    try:
        return hf_compiled_tpot(model, ids, work), "compile", None
    except Exception as error:  # noqa: BLE001 - the table reports the eager peer and the JSON why
        torch._dynamo.reset()
        return hf_eager_tpot(model, ids, work), "eager", f"{type(error).__name__}: {error}"[:500]


def hf_eager_tpot(model, ids: torch.Tensor, work: Workload) -> float:
    run = lambda n: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,  # noqa: E731
                                   pad_token_id=0, eos_token_id=None)
    run(work.new_tokens)
    return (common.median_time(lambda: run(work.new_tokens + 1), work.repeats) -
            common.median_time(lambda: run(1), work.repeats)) / work.new_tokens


def hf_compiled_tpot(model, ids: torch.Tensor, work: Workload) -> float:
    return common.hf_static_loop_tpot(model, ids, work.new_tokens, work.repeats)


# ---------------------------------------------------------------- one shape


def ours_rows(shape: str, config: dict, work: Workload, bandwidth: float | None) -> tuple[list[dict], float]:
    """Our decode rows and our prefill seconds; the models freed before returning. Our random
    weights are drawn apart from transformers' (the same law): two copies of a 30B shape do not
    fit on one GPU."""
    ours = random_model(config, getattr(torch, work.dtype), work.device)
    llm = ts.LLM(ours, **work.engine_options())
    print(f"{shape}: weights and cache hold {memory_gib():.1f} GiB", file=sys.stderr)
    rows = []
    with torch.inference_mode():
        prefill = prefill_seconds(llm, work)
        for batch in work.batches:
            rows.append(decode_row(shape, llm, batch, work, bandwidth))
    del llm, ours
    common.release_memory()
    return rows, prefill


def decode_row(shape: str, llm, batch: int, work: Workload, bandwidth: float | None) -> dict:
    """``kernels``: the CUDA kernels a decode step of this batch launches (None on the CPU)."""
    seconds = decode_seconds(llm, batch, work)
    routing = moe_bytes.routing_of(llm.model.config)
    floor = floor_seconds(llm.model, batch, work, bandwidth)
    kernels = llm.compiled.kernels_per_step(batch) if work.device == "cuda" else None
    return {"shape": shape, "batch": batch, "ours_ms": seconds * 1e3, "kernels": kernels,
            "experts_touched": routing.experts * routing.touched_fraction(batch),
            "floor_ms": floor * 1e3 if floor else None, "x_floor": seconds / floor if floor else None}


def floor_seconds(model, batch: int, work: Workload, bandwidth: float | None) -> float | None:
    """The step's bytes (the cache halfway through the tokens timed) over the bandwidth;
    ``None`` without one (the CPU)."""
    if bandwidth is None:
        return None
    return moe_bytes.step_bytes(model, batch, work.decode_prompt + work.new_tokens // 2) / bandwidth


def with_hf(rows: list[dict], config: dict, work: Workload) -> list[dict]:
    """Each row at an ``hf_batches`` batch with transformers' time beside ours."""
    if not work.hf_batches:
        return rows
    try:
        hf = common.hf_model_of(config, getattr(torch, work.dtype), work.device)
    except torch.OutOfMemoryError as error:
        common.release_memory()
        return [{**row, "hf_mode": "oom", "hf_compile_error": str(error)[:500]} if row["batch"] in work.hf_batches
                else row for row in rows]
    out = []
    for row in rows:
        if row["batch"] in work.hf_batches:
            with torch.inference_mode():
                seconds, mode, error = hf_tpot(hf, row["batch"], work)
            row = {**row, "hf_ms": seconds * 1e3, "hf_mode": mode, "hf_compile_error": error,
                   "x_vs_hf": seconds * 1e3 / row["ours_ms"]}
        out.append(row)
    del hf
    common.release_memory()
    return out


def cache_figures(config: dict, work: Workload, memory_bytes: int) -> dict:
    parsed, element = ModelConfig.from_hf(config), getattr(torch, work.dtype).itemsize
    ours = moe_bytes.kv_bytes_per_token(parsed, element)
    multi_head = moe_bytes.multi_head_kv_bytes_per_token(parsed, element)
    return {"kv_bytes_per_token": ours, "mha_kv_bytes_per_token": multi_head, "kv_x_smaller": multi_head / ours,
            "seqs_fit": moe_bytes.sequences_that_fit(ours, work.kv_tokens, memory_bytes),
            "mha_seqs_fit": moe_bytes.sequences_that_fit(multi_head, work.kv_tokens, memory_bytes)}


def bench_shape(shape: str, work: Workload, tiny: bool, bandwidth: float | None, memory_bytes: int) -> list[dict]:
    config = shape_config(shape, tiny)
    rows, prefill = ours_rows(shape, config, work, bandwidth)
    print(f"{shape}, ours (transformers' model is built next):", flush=True)
    print(common.table(rows, [c for c in COLUMNS if c in rows[0]]), flush=True)
    rows = with_hf(rows, config, work)
    rows[0] = {**rows[0], "prefill_ms": prefill * 1e3, **cache_figures(config, work, memory_bytes)}
    return rows


def memory_gib() -> float:
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0



# ---------------------------------------------------------------- the driver


COLUMNS = ["shape", "batch", "ours_ms", "kernels", "experts_touched", "floor_ms", "x_floor", "hf_ms", "hf_mode",
           "x_vs_hf", "prefill_ms", "kv_bytes_per_token", "mha_kv_bytes_per_token", "kv_x_smaller", "seqs_fit",
           "mha_seqs_fit"]


def title(header: dict, work: Workload) -> str:
    bandwidth = header["bandwidth"]
    band = f"copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else "no floor on the CPU"
    skipped = f"; kernels skipped (tokens wrong): {' '.join(header['skipped_kernels'])}" \
        if header["skipped_kernels"] else ""
    return (f"\n# MoE decode, {work.dtype}, {header['device']}, commit {header['commit']}, {band}{skipped}; decode: ms "
            f"per token after {work.decode_prompt}-token prompts, floor's experts: {header['floor_routing']}; "
            f"prefill: one {work.prefill_tokens}-token prompt; seqs_fit: {work.kv_tokens}-token sequences "
            f"in {header['kv_memory_gib']} GiB of cache")


def chosen_workload(args) -> Workload:
    work = WORKLOADS["tiny" if args.tiny else "full"]
    batches = tuple(args.batches) if args.batches else work.batches
    hf_batches = work.hf_batches if args.hf_batches is None else tuple(args.hf_batches)
    return attrs.evolve(work, batches=batches, hf_batches=hf_batches)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--tiny", action="store_true", help="tiny configs on the CPU (checks that it runs)")
    parser.add_argument("--kv-memory-gib", type=float, default=100.0, help="cache memory of the seqs_fit figure")
    parser.add_argument("--batches", nargs="+", type=int, help="instead of the workload's (full: 1 8 32 128)")
    parser.add_argument("--hf-batches", nargs="*", type=int, help="transformers' (full: 1 32; none: no peer)")
    parser.add_argument("--json", default="results/moe_decode.json")
    parser.add_argument("--skip-kernels", nargs="+", default=[], metavar="MODULE.KERNEL",
                        help="Triton kernels that launch nothing: a bound on fusing them away (tokens wrong)")
    args = parser.parse_args()
    work = chosen_workload(args)
    bandwidth = common.copy_bandwidth() if work.device == "cuda" else None
    common.release_memory()
    header = {"commit": common.git_commit(), "device": common.device_name() if work.device == "cuda" else "cpu",
              "bandwidth": bandwidth, "floor_routing": moe_bytes.ROUTING, "kv_memory_gib": args.kv_memory_gib,
              "workload": attrs.asdict(work), "skipped_kernels": args.skip_kernels}
    rows = []
    with common.kernels_skipped(args.skip_kernels):
        for shape in args.shapes:
            rows += bench_shape(shape, work, args.tiny, bandwidth, int(args.kv_memory_gib * 2**30))
            print(common.table(rows, COLUMNS), flush=True)
            common.write_json(args.json, {**header, "rows": rows})
    print(title(header, work))
    print(common.table(rows, COLUMNS))


if __name__ == "__main__":
    main()
