"""The command line, run in-process on the tiny text model: streamed text, chat, inspect
(with a DOT file), bench in vLLM's format, and one-line errors."""

import io

import pytest

import tokenspeed as ts
from tokenspeed.entrypoints.cli import main

from text_models import text_model_dir


def run(capsys, *argv):
    main([*argv])
    return capsys.readouterr()


def test_generate_streams_the_completion(capsys):
    model = str(text_model_dir())
    out = run(capsys, "generate", "--model", model, "--max-tokens", "6", "The sea is")
    want = ts.LLM(model).generate("The sea is", ts.SamplingParams(temperature=0, max_tokens=6),
                                  use_tqdm=False)[0].text
    assert out.out == want + "\n"


def test_chat_keeps_the_history(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nAnd then?\n\n"))
    out = run(capsys, "chat", "--model", str(text_model_dir()), "--max-tokens", "5")
    replies = out.out.split("\n")
    assert out.out.count("> ") == 3 and len([r for r in replies if r.strip("> ")]) >= 2


def test_inspect_prints_stages_and_writes_dot(capsys, tmp_path):
    dot = tmp_path / "segments.dot"
    out = run(capsys, "inspect", "--model", str(text_model_dir()), "--dot", str(dot))
    assert "stage narrowing" in out.out and "pass history: trace -> narrow_rows" in out.out
    text = dot.read_text()
    assert text.startswith("strict digraph") and '"00.encoder.graph"' in text and "->" in text
    decode = run(capsys, "inspect", "--model", str(text_model_dir()), "--mode", "decode", "--full")
    assert "decode: 1 segments (1 graph, 0 break)" in decode.out and "rope_decode_attention" in decode.out


def test_bench_prints_vllm_figures(capsys):
    model = str(text_model_dir())
    latency = run(capsys, "bench", "latency", "--model", model, "--input-len", "8", "--output-len", "4",
                  "--batch-size", "2", "--num-iters", "2", "--num-iters-warmup", "1")
    assert "Avg latency:" in latency.out and "99% percentile latency:" in latency.out
    throughput = run(capsys, "bench", "throughput", "--model", model, "--num-prompts", "6",
                     "--input-len", "8", "--output-len", "4", "--max-num-seqs", "4")
    assert "requests/s" in throughput.out and "Total num output tokens:  24" in throughput.out


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--temperature", "-1"], "temperature=-1.0: must be a finite number >= 0"),
    (["generate", "hi", "--model", "/no/such/dir"], "/no/such/dir/config.json not found"),
    (["generate", "hi", "--dtype", "fp9"], "dtype='fp9'"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens=0: must be an integer >= 1"),
])
def test_errors_are_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert message in str(exit_.value) and "\n" not in str(exit_.value)
    assert "Traceback" not in capsys.readouterr().err
