"""The hybrid benchmark (issue 36's figures, taken on an H200): its hybrid shape has 18
gated-DeltaNet layers to 6 attention layers and the dense shape as many weights in its
layers, its floor and memory figures count the states and the attention layers' cache
exactly, and ``--tiny`` runs on the CPU and reports every field. Nothing here is a timing
check."""

import json
import sys

import pytest
import torch

from benchmarks import common, hybrid
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.loader import build


def test_the_hybrid_shape_has_three_linear_layers_to_one_attention_layer():
    config = ModelConfig.from_hf(hybrid.SHAPES["qwen3-next-24l"])
    assert config.attention_layers == (3, 7, 11, 15, 19, 23) and len(config.hybrid.linear.layers) == 18


def test_the_floor_and_memory_figures_count_states_and_the_attention_layers_cache():
    config = hybrid.shape_config("qwen3-next-24l", tiny=True)
    model = build(ModelConfig.from_hf(config), torch.float32, "cpu")
    model.model.state_pools.allocate(3)
    work = hybrid.WORKLOADS["tiny"]
    state = 3 * (2 * 2 * 16 + 4 * 16) * 4 * 4 + 3 * 4 * 16 * 16 * 4   # conv (dim x kernel) + recurrent, 3 layers
    assert hybrid.state_bytes(model) == state
    per_token = 2 * 2 * 16 * 4 * 1          # (key, value) x kv heads x head_dim x bytes x one attention layer
    figures = hybrid.memory_figures(model, work, 2**30)
    assert figures["kv_bytes_per_token"] == per_token
    assert figures["seqs_fit"] == 2**30 // (state + per_token * work.kv_tokens)
    context = work.decode_prompt + work.new_tokens // 2
    assert hybrid.floor_seconds(model, 2, work, 1.0) == pytest.approx(
        common.weight_bytes(model) + 2 * per_token * context + 2 * 2 * state)


def test_tiny_runs_on_the_cpu_and_reports_every_field(tmp_path, monkeypatch, capsys):
    out = tmp_path / "hybrid.json"
    monkeypatch.setattr(sys, "argv", ["hybrid", "--tiny", "--json", str(out)])
    hybrid.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["batch"]) for r in rows] == [(s, b) for s in hybrid.SHAPES for b in (1, 2)]
    first = rows[0]
    assert first["ours_ms"] > 0 and first["hf_eager_ms"] > 0 and first["prefill_64_ms"] > 0
    assert first["state_mb_per_seq"] > 0 and rows[2]["state_mb_per_seq"] == 0
    assert "Hybrid decode" in capsys.readouterr().out
