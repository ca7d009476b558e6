"""Quantized weights through ``ts.LLM``: one random model of the Llama-3.2-1B shape as dense
bfloat16, as GGUF files of several block formats kept in their blocks, and as FP8
quantized at load; per row the weight bytes the model holds, the startup, one prompt's
prefill, the decode time per token at batch 1 and 32, and the floor beside each decode
time (bytes a step reads: weights and KV, over the measured device-to-device bandwidth).

    python -m benchmarks.quantized [--formats dense Q8_0 Q4_K Q6_K Q4_0 fp8] [--default-model]
    python -m benchmarks.quantized --tiny --formats Q8_0 Q4_K      (CPU, tiny shape: runs, means nothing)

The dense checkpoint (a Hugging Face directory) and the GGUF files are written from the
same random model into a temporary directory, removed at the end; ``gguf_writer`` quantizes
the simple formats from the weights and fills the K-quants with random blocks (the time
does not depend on the values). A GGUF row is loaded with
``ts.models.load(path, quantized=True)``, which keeps the blocks on any device, and handed
to ``ts.LLM``; its ``startup_s`` counts the load. ``fp8`` is
``ts.LLM(dense_dir, quantization="fp8")``. ``--default-model`` adds the embedded default
model (Q4_1 with a Q8_0 embedding) in its blocks and dequantized.

Each row runs in a fresh process, so ``startup_s`` is a new process's ``LLM()`` (kernels
compiled or read from Triton's on-disk cache: run twice for the warm-cache figure) and no
row inherits another's memory. Decode: a ``decode_prompt``-token prompt per sequence, then
the time per token of ``new_tokens`` more (greedy, to the length asked). ``x_dense``: the
row's time over the dense row's.
"""

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs
import torch

import tokenspeed as ts
from benchmarks import common
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.gguf_writer import write_llama

GGUF_FORMATS = ("Q8_0", "Q4_K", "Q6_K", "Q4_0")
FORMATS = ("dense",) + GGUF_FORMATS + ("fp8",)
TINY_SHAPE = {  # the 1B shape's features at a size the CPU runs in seconds (rows of 256 for the K-quants)
    **common.SHAPES["llama-3.2-1b"], "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "eos_token_id": 2,
}
CHILD = "import sys; from benchmarks import quantized; quantized.child(sys.argv[1:])"


@attrs.frozen
class Workload:
    """What every row measures, and where."""
    shape: str                  # a ``common.SHAPES`` name, or "tiny"
    device: str
    dtype: str
    batches: tuple[int, ...]
    decode_prompt: int          # tokens of each sequence's prompt before the decode timed
    new_tokens: int
    prefill_tokens: int
    repeats: int                # the median of this many timings
    max_model_len: int
    num_kv_pages: int

    def hf_config(self) -> dict:
        return TINY_SHAPE if self.shape == "tiny" else common.SHAPES[self.shape]

    def engine_options(self) -> dict:
        return dict(device=self.device, max_num_seqs=max(self.batches), max_model_len=self.max_model_len,
                    max_num_batched_tokens=self.prefill_tokens, num_kv_pages=self.num_kv_pages,
                    enable_prefix_caching=False)  # each timing computes its prompts


WORKLOADS = {"full": Workload("llama-3.2-1b", "cuda", "bfloat16", (1, 32), 512, 64, 2048, 3, 4096, 8192),
             "tiny": Workload("tiny", "cpu", "float32", (1, 2), 16, 2, 32, 1, 128, 16)}


@attrs.frozen
class Row:
    """A row: its name, the file or directory it loads, and how ("dense": as stored;
    "blocks": GGUF blocks kept; "dequantized": GGUF dequantized; "fp8": quantized at load)."""
    name: str
    source: str
    load: str
    tokenizer: str | None = None


# ---------------------------------------------------------------- in the row's process


def child(argv: list[str]) -> None:
    """The row ``argv[0]`` (JSON) of workload ``argv[1]`` at bandwidth ``argv[2]``, printed
    as JSON on stdout's last line."""
    row, work, bandwidth = Row(**json.loads(argv[0])), WORKLOADS[argv[1]], json.loads(argv[2])
    print(json.dumps(measure(row, work, bandwidth)), flush=True)


def measure(row: Row, work: Workload, bandwidth: float | None) -> dict:
    start = time.perf_counter()
    llm = built(row, work)
    result = {"format": row.name, "kept": kept_formats(llm.model), "weight_mb": resident_bytes(llm.model) / 1e6,
              "startup_s": time.perf_counter() - start}
    with torch.inference_mode():
        result["prefill_ms"] = prefill_seconds(llm, work) * 1e3
        for batch in work.batches:
            result[f"decode_b{batch}_ms"] = decode_seconds(llm, batch, work) * 1e3
            floor = read_bytes(llm.model, batch, work) / bandwidth if bandwidth else None
            result[f"floor_b{batch}_ms"] = floor * 1e3 if floor else None
    return result


def built(row: Row, work: Workload):
    """The row's ``ts.LLM``; a GGUF file's model loaded here to say whether it keeps blocks."""
    options = work.engine_options()
    if row.load in ("dense", "fp8"):
        quantization = {"quantization": "fp8"} if row.load == "fp8" else {}
        return ts.LLM(row.source, dtype=work.dtype, **options, **quantization)
    model = ts.models.load(row.source, dtype=getattr(torch, work.dtype), device=work.device,
                           quantized=row.load == "blocks")
    if row.load == "blocks" and not kept_formats(model):
        raise RuntimeError(f"{row.source}: no weight stayed in its blocks")
    return ts.LLM(model, tokenizer=row.tokenizer, **options)


def kept_formats(model) -> str:
    """The block formats of the layers that kept them ("-": none)."""
    formats = sorted({m.weight_format for m in model.modules() if hasattr(m, "weight_format")})
    return ",".join(formats) or "-"


def resident_bytes(model) -> int:
    """Bytes of every parameter and buffer, each storage once (a tied head is the embedding)."""
    tensors = {t.data_ptr(): t for t in itertools.chain(model.parameters(), model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def read_bytes(model, batch: int, work: Workload) -> int:
    """What one decode step reads at least: the weights, and the KV of ``batch`` sequences
    halfway through the tokens timed."""
    element = getattr(torch, work.dtype).itemsize
    context = work.decode_prompt + work.new_tokens // 2
    return common.weight_bytes(model) + common.kv_bytes(model.config, batch, context, element)


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    return [[1 + (7 * i + j) % (vocab - 1) for j in range(length)] for i in range(batch)]


def prefill_seconds(llm, work: Workload) -> float:
    """One prompt of ``prefill_tokens`` to its first token."""
    prompt = prompts(1, work.prefill_tokens, llm.model.config.vocab_size)
    params = ts.SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(prompt, params, use_tqdm=False)
    return common.median_time(lambda: llm.generate(prompt, params, use_tqdm=False), work.repeats)


def decode_seconds(llm, batch: int, work: Workload) -> float:
    """Per token: (``new_tokens`` + 1 tokens - 1 token) / ``new_tokens``, prompts included in both."""
    batch_prompts = prompts(batch, work.decode_prompt, llm.model.config.vocab_size)
    run = lambda n: llm.generate(batch_prompts, ts.SamplingParams(  # noqa: E731
        temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    run(work.new_tokens)
    return (common.median_time(lambda: run(work.new_tokens + 1), work.repeats) -
            common.median_time(lambda: run(1), work.repeats)) / work.new_tokens


# ---------------------------------------------------------------- the driver


def written_sources(formats, work: Workload, tmp: Path) -> dict[str, str]:
    """Each format's checkpoint, written from one random model: the dense directory (also
    FP8's source) and the GGUF files."""
    if not formats:
        return {}
    hf, config = random_hf_model(work), ModelConfig.from_hf(work.hf_config())
    sources = {}
    if {"dense", "fp8"} & set(formats):
        hf.save_pretrained(tmp / "dense")
        sources["dense"] = sources["fp8"] = str(tmp / "dense")
    for name in (f for f in formats if f in GGUF_FORMATS):
        sources[name] = write_llama(tmp / f"{name}.gguf", config, hf.state_dict(), name)
    del hf
    common.release_memory()
    return sources


def random_hf_model(work: Workload):
    """A random-weight Hugging Face Llama of the workload's shape, as ``common.hf_model``."""
    import transformers
    config = {k: v for k, v in work.hf_config().items() if k != "architectures"}
    torch.manual_seed(0)
    with torch.device(work.device):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig(**config), dtype=getattr(torch, work.dtype))
    return model.eval()



def planned_rows(formats, default_model: bool, sources: dict[str, str]) -> list[Row]:
    load = {"dense": "dense", "fp8": "fp8", **{f: "blocks" for f in GGUF_FORMATS}}
    rows = [Row(name, sources[name], load[name]) for name in formats]
    if default_model:
        path = str(ts.models.default_model_path())
        rows += [Row("default-blocks", path, "blocks", path), Row("default-dequantized", path, "dequantized", path)]
    return rows


def run_row(row: Row, workload: str, bandwidth: float | None) -> dict:
    """``measure`` in a fresh process (its log on our stderr)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(attrs.asdict(row)), workload,
                           json.dumps(bandwidth)], env=env, cwd=root, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        raise RuntimeError(f"the {row.name} row failed (exit {done.returncode}); its error is above")
    return json.loads(done.stdout.strip().splitlines()[-1])


def with_ratios(rows: list[dict], batches) -> list[dict]:
    """Each row with its times over the dense row's (``x_dense``), where there is one."""
    dense = next((r for r in rows if r["format"] == "dense"), None)
    keys = ["prefill_ms"] + [f"decode_b{b}_ms" for b in batches]
    ratio = lambda row, key: row[key] / dense[key] if dense and dense[key] else None  # noqa: E731
    return [{**row, **{key.replace("_ms", "_x_dense"): ratio(row, key) for key in keys}} for row in rows]


def columns(batches) -> list[str]:
    per_batch = [[f"decode_b{b}_ms", f"floor_b{b}_ms", f"decode_b{b}_x_dense"] for b in batches]
    return ["format", "kept", "weight_mb", "startup_s", "prefill_ms", "prefill_x_dense", *sum(per_batch, [])]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--formats", nargs="*", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--default-model", action="store_true", help="also the default model, blocks and dequantized")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU (checks that it runs)")
    parser.add_argument("--json", default="results/quantized.json")
    args = parser.parse_args()
    name = "tiny" if args.tiny else "full"
    work = WORKLOADS[name]
    bandwidth = common.copy_bandwidth() if work.device == "cuda" else None
    common.release_memory()
    header = {"commit": common.git_commit(), "device": common.device_name() if work.device == "cuda" else "cpu",
              "bandwidth": bandwidth, "workload": attrs.asdict(work)}
    rows = []
    with tempfile.TemporaryDirectory(prefix="ts_quantized_") as tmp:
        for row in planned_rows(args.formats, args.default_model, written_sources(args.formats, work, Path(tmp))):
            rows = with_ratios(rows + [run_row(row, name, bandwidth)], work.batches)
            print(common.table(rows[-1:], columns(work.batches)), flush=True)
            common.write_json(args.json, {**header, "rows": rows})
    print(title(header, work))
    print(common.table(rows, columns(work.batches)))


def title(header: dict, work: Workload) -> str:
    bandwidth = header["bandwidth"]
    band = f"copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else "no floor on the CPU"
    return (f"\n# quantized weights, {work.shape} shape, {work.dtype}, {header['device']}, commit "
            f"{header['commit']}, {band}; prefill: one {work.prefill_tokens}-token prompt; decode: ms per "
            f"token after {work.decode_prompt}-token prompts")


if __name__ == "__main__":
    main()
