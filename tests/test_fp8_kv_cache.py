"""The FP8 KV cache (``kv_cache_dtype="fp8_e4m3"``) end to end: the option refused when
bad, the pool's dtype and sizing, the scales' path from the model into the IR, and the
engine's tokens against a float32 pool on prompts whose greedy choices stand clear of
what FP8 can move (its kernels: ``test_fp8_kv_kernels.py``)."""

import re

import pytest
import torch

import tokenspeed as ts
from margins import decisive_model
from tokenspeed.execution import decode_runner, prefill_runner
from tokenspeed.execution.compile_config import CompileConfig
from tokenspeed.ir.ops import ATTENTION, WRITE_KV
from tokenspeed.models.kv_scales import kv_scales, set_kv_scales
from tokenspeed.models.random import TINY_LLAMA, random_model

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.5, 2.0      # powers of two: x * scale and x / scale are exact
# FP8 keys and values move these tiny models' logits by up to ~0.1 (seen: 0.093); token
# comparisons hold where every greedy margin exceeds twice the largest logit change.
FP8_LOGIT_TOLERANCE = 0.15
# Prompts whose greedy choices over 4 tokens all lead by more than 2 * FP8_LOGIT_TOLERANCE
# on decisive_model(3) with a float32 pool (checked by the test).
CLEAR_PROMPTS = (
    [91, 474, 305, 385, 66, 31, 126, 10, 480, 374, 361, 263, 63, 468, 448, 35, 399, 136, 273, 49, 161,
     297, 332, 12, 9, 17, 23, 128, 103],
    [4, 459, 355, 211, 22, 43, 145, 425, 147, 466, 88, 95, 143, 245, 466],
    [249, 292, 408, 84, 81, 230, 181, 405, 387, 73, 14, 485, 496, 106, 132, 290, 427, 198, 189, 174, 16,
     34, 178, 64, 489, 145, 298, 491, 70],
)
GREEDY = ts.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
gpu = pytest.mark.gpu


@pytest.mark.parametrize("value", ["int8", "FP8", "float8_e5m2", ""])
def test_a_bad_kv_cache_dtype_is_refused(value):
    message = f"kv_cache_dtype={value!r}: expected one of auto, fp8, fp8_e4m3"
    with pytest.raises(ValueError, match=message):
        CompileConfig(kv_cache_dtype=value)
    with pytest.raises(ValueError, match=message):
        ts.LLM(random_model(TINY_LLAMA), kv_cache_dtype=value)


@pytest.mark.parametrize("command", [["generate", "x"], ["serve"], ["bench", "latency"]])
def test_the_command_line_s_kv_cache_dtype_reaches_the_llm(command):
    from tokenspeed.cli.main import llm_options, parser
    assert llm_options(parser().parse_args([*command, "--device", "cpu"]))["kv_cache_dtype"] == "auto"
    args = parser().parse_args([*command, "--device", "cpu", "--kv-cache-dtype", "fp8"])
    assert llm_options(args)["kv_cache_dtype"] == "fp8"


def test_a_bad_kv_cache_dtype_on_the_command_line_is_one_line():
    from tokenspeed.cli.main import main
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hi", "--kv-cache-dtype", "int8"])
    assert str(exit_.value).endswith("kv_cache_dtype='int8': expected one of auto, fp8, fp8_e4m3")


def test_fp8_on_a_gpu_without_float8_conversions_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    config = CompileConfig(device="cuda:0", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8': float8 needs a GPU of compute capability 8.9 "
                                         "or later; cuda:0 has 8.0"):
        config.kv_dtype(torch.bfloat16)
    assert CompileConfig(device="cuda:0").kv_dtype(torch.bfloat16) == torch.bfloat16


def test_an_fp8_pool_holds_twice_the_pages_of_a_bfloat16_one():
    model = random_model(TINY_LLAMA, dtype=torch.bfloat16)
    kw = dict(kv_cache_memory_bytes=1 << 20, max_num_seqs=64, graphs=False)
    pools = {d: ts.LLM(model, kv_cache_dtype=d, **kw).compiled for d in ("auto", "fp8", "fp8_e4m3")}
    assert pools["auto"].kv_cache.dtype == torch.bfloat16
    assert pools["fp8"].kv_cache.dtype == pools["fp8_e4m3"].kv_cache.dtype == FP8
    assert pools["fp8"].num_pages == pools["fp8_e4m3"].num_pages == 2 * pools["auto"].num_pages == 512
    assert "512 KV pages of 16 tokens in float8_e4m3fn" in pools["fp8"].as_text()


def test_set_kv_scales_reaches_every_cache_op_of_the_ir():
    model = random_model(TINY_LLAMA)
    set_kv_scales(model, [[0.25, 4.0], [0.5, 2.0]])
    assert torch.equal(kv_scales(model), torch.tensor([[0.25, 4.0], [0.5, 2.0]]))
    traced = ts.trace(model)
    for text in (traced.as_text(), traced.lower("decode").as_text(), traced.lower("prefill").as_text()):
        cache_ops = [line for line in text.splitlines() if "%kv_cache," in line]
        assert {line.split("%kv_cache, ")[1][0] for line in cache_ops} == {"0", "1"}
        for line in cache_ops:
            layer = line.split("%kv_cache, ")[1][0]
            assert line.endswith("k_scale=0.25, v_scale=4.0)" if layer == "0" else "k_scale=0.5, v_scale=2.0)")


GROUPED = {**TINY_LLAMA, "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True, "sliding_window": 8,
           "layer_types": ["sliding_attention", "full_attention"]}   # two cache groups, both layers in row 0
KV_SHARED = {**TINY_LLAMA, "num_hidden_layers": 4, "num_kv_shared_layers": 2}   # layers 2, 3 read layer 1's


@pytest.mark.parametrize("config, source", [(GROUPED, [0, 1]), (KV_SHARED, [0, 1, 1, 1])],
                         ids=["cache_groups", "kv_shared"])
def test_a_layer_s_cache_ops_carry_the_scales_of_the_layer_whose_cache_it_reads(config, source):
    """By layer, not by cache row (grouped layers share rows)."""
    model = random_model(config)
    scales = torch.tensor([[0.25 * (i + 1), 4.0 / (i + 1)] for i in range(len(source))])
    set_kv_scales(model, scales)
    ops = [n for n in ts.trace(model).graph_module.graph.nodes if n.target in (WRITE_KV, ATTENTION)]
    assert len(ops) == len(source) + len(set(source))   # an attention per layer, a write per cache
    for node in ops:
        layer = int(re.match(r"layer(\d+)_", node.args[0].name).group(1))
        k_scale, v_scale = scales[source[layer]].tolist()
        assert node.kwargs == {"k_scale": k_scale, "v_scale": v_scale}


@pytest.mark.parametrize("scales, message", [
    ([[1.0, 1.0]], r"kv_scales of shape \(1, 2\): expected \[num_layers=2, 2\]"),
    ([[1.0, 0.0], [1.0, 1.0]], r"kv_scales\[0, 1\] = 0.0: a value scale must be finite and > 0"),
    ([[1.0, 1.0], [float("nan"), 1.0]], r"kv_scales\[1, 0\] = nan: a key scale must be finite and > 0")])
def test_bad_kv_scales_are_refused(scales, message):
    model = random_model(TINY_LLAMA)
    with pytest.raises(ValueError, match=message):
        set_kv_scales(model, scales)
    assert torch.equal(kv_scales(model), torch.ones(2, 2))


def recorded_logits(monkeypatch) -> list[torch.Tensor]:
    """Every sampled row's logits from here on (an engine without graphs samples live rows only)."""
    logits: list[torch.Tensor] = []

    def recorded(sampler):
        def run(rows, *args, **kwargs):
            logits.append(rows.float().clone())
            return sampler(rows, *args, **kwargs)
        return run

    monkeypatch.setattr(decode_runner, "gumbel_argmax", recorded(decode_runner.gumbel_argmax))
    monkeypatch.setattr(prefill_runner, "sample", recorded(prefill_runner.sample))
    return logits


def generate(model, device="cpu", **kw):
    llm = ts.LLM(model, device, enable_prefix_caching=False, overlap=False, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(list(CLEAR_PROMPTS), GREEDY, use_tqdm=False)]


def check_clear_and_close(plain: list[torch.Tensor], fp8: list[torch.Tensor]) -> None:
    """Every greedy choice of the plain pool leads by more than twice what FP8 moved."""
    assert plain and [t.shape for t in plain] == [t.shape for t in fp8]
    top2 = torch.cat(plain).topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 2 * FP8_LOGIT_TOLERANCE
    assert max((a - b).abs().max().item() for a, b in zip(plain, fp8)) < FP8_LOGIT_TOLERANCE


@pytest.mark.parametrize("scales", [None, [[K_SCALE, V_SCALE], [V_SCALE, K_SCALE]]])
def test_fp8_kv_tokens_equal_float32_kv_tokens(monkeypatch, scales):
    model = decisive_model(3)
    if scales is not None:
        set_kv_scales(model, scales)
    logits = recorded_logits(monkeypatch)
    plain = generate(model, graphs=False)
    plain_logits = logits[:]
    logits.clear()
    assert generate(model, graphs=False, kv_cache_dtype="fp8") == plain
    check_clear_and_close(plain_logits, logits)


def test_fp8_pool_graphs_equal_eager():
    """Invariant 5 over an FP8 pool, through the CPU stand-in's captures."""
    model, kw = decisive_model(3), dict(kv_cache_dtype="fp8_e4m3", max_num_seqs=4, page_size=4,
                                        max_num_batched_tokens=64, capture_sizes=(1, 2, 4))
    assert generate(model, graphs=True, **kw) == generate(model, graphs=False, **kw)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_over_fp8_pools_gives_plain_decodings_tokens(method):
    """Invariant 10 over FP8 pools: the verify windows read and write the target's, and a
    draft model, compiled with the same options, drafts from an FP8 pool of its own."""
    target = random_model(TINY_LLAMA)   # small weights: continuations repeat, n-grams find them
    kw = dict(max_num_seqs=4, page_size=4, graphs=False, kv_cache_dtype="fp8")
    config = ts.SpeculativeConfig(method=method, num_tokens=3, verify_cost=1.0,
                                  draft_model=target if method == "draft" else None)
    speculative = ts.LLM(target, speculative=config, **kw)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 7, 8, 9, 7, 8], list(range(30, 60))]
    params = ts.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = speculative.generate(prompts, params, use_tqdm=False)
    plain = ts.LLM(target, **kw).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert max(o.metrics.mean_accept_length or 0 for o in got) > 2
    assert speculative.compiled.kv_cache.dtype == FP8
    if method == "draft":
        assert speculative.engine.drafter.prefill.kv_cache.dtype == FP8


@gpu
def test_gpu_engine_with_fp8_kv_equals_float32_kv(monkeypatch):
    """The whole engine on CUDA, graphs and all, over an FP8 pool; margins from an eager
    float32 pool."""
    model = decisive_model(3)
    kw = dict(max_num_seqs=4, max_model_len=256, gpu_memory_utilization=0.3)
    logits = recorded_logits(monkeypatch)
    plain = generate(model, "cuda", enforce_eager=True, **kw)
    plain_logits = logits[:]
    logits.clear()
    assert generate(model, "cuda", enforce_eager=True, kv_cache_dtype="fp8", **kw) == plain
    check_clear_and_close(plain_logits, logits)
    monkeypatch.undo()
    assert generate(model, "cuda", kv_cache_dtype="fp8", **kw) == plain
