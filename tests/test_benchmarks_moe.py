"""The mixture-of-experts benchmark (issue 34's speed figures, taken on an H200): its shapes
are the published models', its floor counts the experts a batch touches, its cache figures
are exact, and ``--tiny`` runs on the CPU and reports every field. Nothing here is a timing
check."""

import json
import sys

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from benchmarks import common, moe_bytes, moe_decode
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.loader import build

# Moonlight's report counts 15.29B, its embedding and head left out (2 x 163,840 x 2,048)
PUBLISHED_PARAMETERS = {"qwen3-30b-a3b": 30_532_122_624, "deepseek-v2-lite": 15_706_484_224,
                        "moonlight-16b-a3b": 15_960_108_544}


@pytest.mark.parametrize("shape", moe_decode.SHAPES)
def test_each_shape_builds_the_published_model_in_both_libraries(shape):
    hf = common.hf_model_of(common.SHAPES[shape], torch.bfloat16, "meta")
    ours = build(ModelConfig.from_hf(common.SHAPES[shape]), torch.bfloat16, "meta")
    assert sum(p.numel() for p in hf.parameters()) == PUBLISHED_PARAMETERS[shape]
    weights = [p for name, p in ours.named_parameters() if not name.endswith("e_score_correction_bias")]
    assert sum(p.numel() for p in weights) == PUBLISHED_PARAMETERS[shape]   # transformers' bias: a buffer


def test_the_cache_figures_of_the_full_shapes():
    work = moe_decode.WORKLOADS["full"]
    latent = moe_decode.cache_figures(common.SHAPES["deepseek-v2-lite"], work, 100 * 2**30)
    assert latent["kv_bytes_per_token"] == 27 * (512 + 64) * 2
    assert latent["mha_kv_bytes_per_token"] == 16 * (192 + 128) * 27 * 2
    assert latent["seqs_fit"] == 100 * 2**30 // (27 * 576 * 2 * 32768)
    grouped = moe_decode.cache_figures(common.SHAPES["qwen3-30b-a3b"], work, 100 * 2**30)
    assert grouped["kv_bytes_per_token"] == 2 * 4 * 128 * 48 * 2
    assert grouped["mha_kv_bytes_per_token"] == 32 * 2 * 128 * 48 * 2


def test_the_pool_holds_the_largest_batch_and_the_long_prompt_and_no_more():
    work = attrs.evolve(moe_decode.WORKLOADS["full"], batches=(1, 32))
    row = work.decode_prompt + work.new_tokens + 1
    assert work.kv_pages() * moe_decode.PAGE_SIZE >= 32 * row
    assert work.kv_pages() * moe_decode.PAGE_SIZE < 32 * (row + 3 * moe_decode.PAGE_SIZE)
    # 1,217 pages of Qwen3-30B-A3B's 1.5 MiB: 1.8 GiB beside its 57 GiB of weights
    long_prompt = attrs.evolve(work, batches=(1,), hf_batches=(1,), prefill_tokens=8192)
    assert long_prompt.kv_pages() * moe_decode.PAGE_SIZE >= 8192


def test_the_floor_reads_the_dense_weights_the_touched_experts_and_the_cache():
    config = ModelConfig.from_hf(moe_decode.shape_config("qwen3-30b-a3b", tiny=True))
    model = build(config, torch.float32, "cpu")
    routed = 2 * 8 * 3 * 32 * 64 * 4   # layers x experts x (gate, up, down) x width x hidden x bytes
    assert moe_bytes.routed_bytes(model) == routed
    cache = 2 * 2 * 16 * 2 * 4 * 10    # (key, value) x kv heads x head_dim x layers x bytes x tokens
    assert moe_bytes.step_bytes(model, 1, 10) == pytest.approx(
        common.weight_bytes(model) - routed + routed * 2 / 8 + cache)
    assert moe_bytes.step_bytes(model, 10_000, 0) == pytest.approx(common.weight_bytes(model))
    work = moe_decode.WORKLOADS["tiny"]   # the cache halfway through the tokens timed
    context = work.decode_prompt + work.new_tokens // 2
    assert moe_decode.floor_seconds(model, 1, work, 1e9) == moe_bytes.step_bytes(model, 1, context) / 1e9
    assert moe_decode.floor_seconds(model, 1, work, None) is None


def test_transformers_runs_eager_where_it_does_not_compile_and_says_why(monkeypatch):
    def no_graph(*args):
        raise RuntimeError("data-dependent expert loop")
    monkeypatch.setattr(moe_decode, "hf_compiled_tpot", no_graph)
    work = attrs.evolve(moe_decode.WORKLOADS["tiny"], hf_compile=True)
    hf = common.hf_model_of(moe_decode.shape_config("qwen3-30b-a3b", tiny=True), torch.float32, "cpu")
    with torch.inference_mode():
        seconds, mode, error = moe_decode.hf_tpot(hf, 1, work)
    assert isinstance(seconds, float)
    assert (mode, error) == ("eager", "RuntimeError: data-dependent expert loop")


def test_a_dense_model_has_no_routing():
    with pytest.raises(ValueError, match="LlamaForCausalLM has no routed experts"):
        moe_bytes.routing_of(ModelConfig.from_hf(common.SHAPES["smollm2-135m"]))


@given(st.integers(1, 64), st.integers(1, 64), st.integers(1, 512))
def test_the_touched_share_grows_from_one_token_s_to_all(experts, top_k, tokens):
    routing = moe_bytes.Routing(experts, min(top_k, experts))
    assert routing.touched_fraction(1) == pytest.approx(routing.top_k / experts)
    assert routing.touched_fraction(tokens) <= routing.touched_fraction(tokens + 1) <= 1.0


def test_the_touched_share_is_uniform_routing_s_mean():
    gen, routing, tokens = torch.Generator().manual_seed(0), moe_bytes.Routing(16, 2), 8
    draws = [torch.rand(tokens, 16, generator=gen).topk(2).indices.unique().numel() for _ in range(4000)]
    assert sum(draws) / len(draws) == pytest.approx(16 * routing.touched_fraction(tokens), rel=0.02)


def test_transformers_batches_must_be_among_ours():
    expected = r"transformers' batches \[1, 32\] must be among the batches measured \[1, 8\]"
    with pytest.raises(ValueError, match=expected):
        attrs.evolve(moe_decode.WORKLOADS["full"], batches=(1, 8))


@pytest.mark.slow
def test_the_tiny_run_reports_every_field(tmp_path, monkeypatch, capsys):
    out = tmp_path / "moe_decode.json"
    monkeypatch.setattr(sys, "argv", ["moe_decode", "--tiny", "--json", str(out)])
    moe_decode.main()
    payload = json.loads(out.read_text())
    work = moe_decode.WORKLOADS["tiny"]
    assert payload["device"] == "cpu" and payload["bandwidth"] is None
    assert payload["floor_routing"] == "uniform expectation" and payload["kv_memory_gib"] == 100.0
    rows = payload["rows"]
    assert [(r["shape"], r["batch"]) for r in rows] == [(s, b) for s in moe_decode.SHAPES for b in work.batches]
    for row in rows:
        assert isinstance(row["ours_ms"], float) and row["floor_ms"] is None
        assert (row["hf_mode"], row["hf_compile_error"]) == ("eager", None) and isinstance(row["hf_ms"], float)
    firsts = {r["shape"]: r for r in rows if r["batch"] == work.batches[0]}
    assert all(isinstance(r["prefill_ms"], float) for r in firsts.values())
    assert (firsts["qwen3-30b-a3b"]["kv_bytes_per_token"], firsts["qwen3-30b-a3b"]["mha_kv_bytes_per_token"]) == (
        2 * 2 * 16 * 2 * 4, 4 * 32 * 2 * 4)
    assert (firsts["deepseek-v2-lite"]["kv_bytes_per_token"], firsts["deepseek-v2-lite"]["seqs_fit"]) == (
        (32 + 16) * 2 * 4, 100 * 2**30 // (48 * 2 * 4 * 32768))
    assert "# MoE decode, float32, cpu" in capsys.readouterr().out


def test_a_mixtures_throughput_floor_counts_the_experts_a_token_takes(monkeypatch):
    """With every expert taken by every token the mixture's floor is the dense one; with
    two of eight it is lower (fewer FLOPs a prompt token, fewer experts read a step)."""
    from benchmarks import throughput
    from tokenspeed.models.random import random_model
    config = moe_decode.shape_config("qwen3-30b-a3b", tiny=True)
    requests, peaks = [([1] * 16, 4)] * 3, throughput.Peaks(1e12, 1e11)
    sparse = throughput.work_floor(random_model(config), requests, 4, peaks)
    every = random_model({**config, "num_experts_per_tok": config["num_experts"]})
    dense = throughput.work_floor(every, requests, 4, peaks)
    monkeypatch.setattr(moe_bytes, "is_mixture", lambda _: False)
    assert throughput.work_floor(every, requests, 4, peaks) == pytest.approx(dense)
    assert sparse < 0.9 * dense
