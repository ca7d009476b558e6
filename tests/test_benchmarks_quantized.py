"""The quantized-weights benchmark (issue 33's speed and memory figures, taken on an H200)
run tiny on the CPU: each GGUF row is measured with its blocks kept and reports every
figure, and the files it wrote are gone afterwards. Nothing here is a timing check."""

import json
import sys
import tempfile

import pytest

from benchmarks import quantized

FORMATS = ["Q8_0", "Q4_K"]  # a simple format and a K-quant: each row is a process of its own (seconds)


def matrix_elements(c: dict) -> int:
    """Elements of the tiny model's matrices: each layer's projections, and the embedding
    (the head is tied to it)."""
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    h, f = c["hidden_size"], c["intermediate_size"]
    return c["num_hidden_layers"] * (h * (q + 2 * kv) + q * h + 3 * h * f) + c["vocab_size"] * h


@pytest.mark.slow
def test_the_tiny_run_reports_each_gguf_row_in_its_blocks(tmp_path, monkeypatch, capsys):
    out, scratch = tmp_path / "quantized.json", tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(sys, "argv", ["quantized", "--tiny", "--formats", *FORMATS, "--json", str(out)])
    quantized.main()
    payload = json.loads(out.read_text())
    rows = {row["format"]: row for row in payload["rows"]}
    assert list(rows) == FORMATS and payload["device"] == "cpu" and payload["bandwidth"] is None
    batches = payload["workload"]["batches"]
    for name, row in rows.items():
        assert set(row) == set(quantized.columns(batches)) and row["kept"] == name
        assert all(isinstance(row[key], float) for key in
                   ["startup_s", "prefill_ms", *(f"decode_b{b}_ms" for b in batches)])
    # the same model but for its matrices' blocks: Q8_0 8.5 bits a weight, Q4_K 4.5
    held = rows["Q8_0"]["weight_mb"] - rows["Q4_K"]["weight_mb"]
    assert held == pytest.approx(matrix_elements(quantized.TINY_SHAPE) * (8.5 - 4.5) / 8 / 1e6, rel=1e-9)
    assert [p.name for p in scratch.iterdir() if p.name.startswith("ts_quantized_")] == []
    assert "# quantized weights, tiny shape" in capsys.readouterr().out
