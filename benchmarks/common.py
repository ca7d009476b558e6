"""Shared benchmark pieces: model shapes, peers, the memory floor, timing, output."""

import contextlib
import gc
import importlib
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

SHAPES = {
    "smollm2-135m": {  # the embedded default model's shape (weights random here: speed only)
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "max_position_embeddings": 8192, "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "eos_token_id": 2,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "eos_token_id": 151643,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "eos_token_id": 128001,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    },
    "qwen3-30b-a3b": {   # 128 experts of width 768, 8 a token; every layer sparse; qk-norm
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "eos_token_id": 151645,
    },
    "deepseek-v2-lite": {   # latent attention (512 + 64 cached per token and layer), 64 experts + 2 shared
        "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "topk_method": "greedy",
        "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "eos_token_id": 100001,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707,
                            "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                            "original_max_position_embeddings": 4096},
    },
}
SHAPES["moonlight-16b-a3b"] = {   # DeepSeek-V3's architecture at DeepSeek-V2-Lite's size: noaux_tc routing
    **SHAPES["deepseek-v2-lite"], "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 163840,
    "intermediate_size": 11264, "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 2.446,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "eos_token_id": 163585,
    "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
}
DENSE_SHAPES = ("smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b")   # the dense benchmarks' default shapes


def hf_model(shape: str, dtype=torch.bfloat16, device="cuda"):
    """A random-weight Hugging Face model of ``shape`` (weights initialised on the GPU)."""
    return hf_model_of(SHAPES[shape], dtype, device)


def hf_model_of(hf_config: dict, dtype=torch.bfloat16, device="cuda"):
    """A random-weight Hugging Face model of a config.json's fields (a shape of our own, or a
    benchmark's tiny variant of one)."""
    import transformers
    cfg = dict(hf_config)
    arch = cfg.pop("architectures")[0]
    config_cls = {"LlamaForCausalLM": transformers.LlamaConfig,
                  "Qwen2ForCausalLM": transformers.Qwen2Config,
                  "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
                  "DeepseekV2ForCausalLM": transformers.DeepseekV2Config,
                  "DeepseekV3ForCausalLM": transformers.DeepseekV3Config,
                  "Qwen3NextForCausalLM": transformers.Qwen3NextConfig}[arch]
    config = config_cls(**cfg)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # every tensor made in ``dtype``: a float32 first draft would not fit
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def our_model(shape: str, hf, dtype=torch.bfloat16, device="cuda"):
    """Our model over the same weights as ``hf``."""
    return our_model_of(SHAPES[shape], hf, dtype, device)


def our_model_of(hf_config: dict, hf, dtype=torch.bfloat16, device="cuda"):
    """Our model of a config.json's fields over the same weights as ``hf``."""
    from tokenspeed.models.config import ModelConfig
    from tokenspeed.models.loader import build, load_state_dict
    model = build(ModelConfig.from_hf(hf_config), dtype, device)
    load_state_dict(model, hf.state_dict())
    return model.eval()


def hf_static_loop_tpot(model, ids: torch.Tensor, new_tokens: int, repeats: int = 3) -> float:
    """transformers' best decode, as its best user would time it: a greedy loop over a
    ``StaticCache``, the prompt ``ids`` eager, each one-token step a compiled (CUDA-graph)
    call; none of ``generate``'s per-step bookkeeping. Seconds per token."""
    from transformers import StaticCache
    prompt = ids.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=prompt + new_tokens + 1)
    forward = torch.compile(lambda token, position: model(
        token, cache_position=position, past_key_values=cache, use_cache=True).logits,
        mode="reduce-overhead", fullgraph=True)

    def run(steps: int) -> None:
        cache.reset()
        logits = model(ids, cache_position=torch.arange(prompt, device=ids.device), past_key_values=cache,
                       use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        for step in range(steps):
            token = forward(token, torch.tensor([prompt + step], device=ids.device))[:, -1:].argmax(-1).clone()
    run(new_tokens)  # warm-up: compiles and records the graphs
    return (median_time(lambda: run(new_tokens + 1), repeats) - median_time(lambda: run(1), repeats)) / new_tokens


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    seconds = gpu_time(lambda: dst.copy_(src), iters=20)
    return 2 * nbytes / seconds


def weight_bytes(model) -> int:
    """Bytes a decode step reads of the weights: every matrix once (the embedding table is
    gathered, not read whole, unless the head reads it as tied weights; a head quantized
    apart from a tied table, as ``quantization="int4"`` makes it, does not)."""
    seen, total = set(), 0
    head = (model.lm_head if hasattr(model, "lm_head") else model.get_output_embeddings()).weight
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if "embed_tokens" in name and p.data_ptr() != head.data_ptr():
            continue
        total += p.numel() * p.element_size()
    return total


def kv_bytes(config, batch: int, context: int, element_size: int = 2) -> int:
    """Cache bytes ``batch`` sequences of ``context`` tokens hold in the layers that attend (a
    hybrid model's recurrent layers hold none): keys and values per KV head, or one latent
    row per token and layer (``ModelConfig.cache_row``)."""
    parts, heads, values = config.cache_row
    return parts * len(config.attention_layers) * batch * context * heads * values * element_size


def gpu_time(fn, iters: int = 10, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def graph_time_per_call(weights, call, iters: int = 10) -> float:
    """Seconds per ``call(w)``, timed as one CUDA graph of it over every weight in ``weights``
    (enough of them that none stays in L2 between its calls)."""
    call(weights[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            call(w)
    return gpu_time(graph.replay, iters=iters) / len(weights)


COPY_BYTES = 150 << 20  # a chain of weight copies reads more than the H200's 50 MB of L2


def weight_copies(make, nbytes: int, tiny: bool) -> list:
    """Distinct copies enough that a chain streams from memory, not from L2 (one when
    ``tiny``: a CPU check that the benchmark runs)."""
    count = 1 if tiny else min(64, max(8, -(-COPY_BYTES // nbytes)))
    return [make() for _ in range(count)]


def time_chain(weights, call, tiny: bool) -> float:
    """Seconds per call of ``call(w)`` over ``weights`` (a CUDA graph of all of them)."""
    if tiny:
        return median_time(lambda: call(weights[0]), 1)
    return graph_time_per_call(weights, call, iters=20)


def median_time(fn, repeats: int = 5) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def release_memory() -> None:
    """Collect dropped engines (their graphs form reference cycles) and return the allocator's
    free blocks, so the next model is built, and its pool sized, on what is really free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def git_commit() -> str:
    """The commit measured; ``TOKENSPEED_COMMIT`` names it where the tree has no git history."""
    if os.environ.get("TOKENSPEED_COMMIT"):
        return os.environ["TOKENSPEED_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def host_name() -> str:
    """The host's CPU model and the cores this process may use: figures bound by the host
    (a constrained step's mask fills) move with it between machines of one GPU kind."""
    from tokenspeed.cores import allowed_cpus
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "an unnamed CPU"
    return f"{model}, {allowed_cpus()} cores"


def write_json(path, payload) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2))


def table(rows: list[dict], columns: list[str]) -> str:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths])] +
                     [line([_fmt(r.get(c)) for c in columns]) for r in rows])


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


class _NoLaunch:
    """A Triton kernel that launches nothing, whatever its grid and arguments."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def kernels_skipped(names):
    """The package's Triton kernels named ``module.kernel`` (under
    ``tokenspeed.backends.kernels``, e.g. ``triton_decode._combine_kernel``) launch nothing
    meanwhile: steps captured then run without them, their readers reading whatever their
    outputs held. The tokens are wrong; the time bounds what fusing those kernels away
    could gain, measured before anyone writes the fusion. Skip only kernels whose outputs
    are values: a reader that takes garbage for indices (expert ids, slots) can fault."""
    kept = []
    try:
        for name in names:
            module_name, _, kernel = name.rpartition(".")
            try:
                module = importlib.import_module(f"tokenspeed.backends.kernels.{module_name}")
                kept.append((module, kernel, getattr(module, kernel)))
            except (ImportError, AttributeError, ValueError) as exc:
                raise ValueError(f"--skip-kernels {name}: no such kernel under tokenspeed.backends.kernels "
                                 f"({type(exc).__name__}: {exc})") from None
            setattr(module, kernel, _NoLaunch())
        yield
    finally:
        for module, kernel, original in reversed(kept):
            setattr(module, kernel, original)
