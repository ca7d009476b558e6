"""The command line, run in-process on the tiny text model: streamed text, chat, inspect
(with a DOT file), bench in vLLM's format, one-line errors, every default in ``--help``,
a ``--help`` that imports no torch, and ``serve MODEL`` as vLLM takes it."""

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tokenspeed as ts
from tokenspeed.cli.main import main, parser
from tokenspeed.cli.help_format import DefaultsHelpFormatter

from text_models import text_model_dir


def run(capsys, *argv):
    main([*argv])
    return capsys.readouterr()


def test_generate_streams_the_completion(capsys):
    model = str(text_model_dir())
    out = run(capsys, "generate", "--model", model, "--max-tokens", "6", "--temperature", "0", "The sea is")
    want = ts.LLM(model).generate("The sea is", ts.SamplingParams(temperature=0, max_tokens=6),
                                  use_tqdm=False)[0].text
    assert out.out == want + "\n"


def test_the_commands_own_max_tokens_ends_with_a_short_context(capsys):
    """``generate``'s 128 tokens past a 32-token context: cut to the room left (greedy,
    so the text is the one asked for with that room), not refused; asked for, refused."""
    model = str(text_model_dir())
    out = run(capsys, "generate", "--model", model, "--max-model-len", "32", "--temperature", "0", "The sea is")
    llm = ts.LLM(model, max_model_len=32)
    room = 32 - len(llm.tokenizer.encode("The sea is"))
    want = llm.generate("The sea is", ts.SamplingParams(temperature=0, max_tokens=room), use_tqdm=False)[0].text
    assert out.out == want + "\n"
    with pytest.raises(SystemExit, match="exceeds max_model_len=32"):
        main(["generate", "--model", model, "--max-model-len", "32", "--max-tokens", "128", "The sea is"])


def test_chat_keeps_the_history(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nAnd then?\n\n"))
    out = run(capsys, "chat", "--model", str(text_model_dir()), "--max-tokens", "5")
    replies = out.out.split("\n")
    assert out.out.count("> ") == 3 and len([r for r in replies if r.strip("> ")]) >= 2


def test_a_message_past_the_context_is_dropped_and_the_chat_goes_on(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n" + "the sea " * 80 + "\nAnd then?\n\n"))
    out = run(capsys, "chat", "--model", str(text_model_dir()), "--max-tokens", "5", "--max-model-len", "64")
    assert out.out.count("> ") == 4 and out.err.count("the message was dropped") == 1
    assert len([r for r in out.out.split("\n") if r.strip("> ")]) >= 2   # the replies before and after


def test_ctrl_c_stops_a_chat_reply_and_the_chat_goes_on(capsys, monkeypatch):
    """The first reply is interrupted after its first piece (as SIGINT would raise it
    there): that reply ends, its request is aborted, and the next message is answered."""
    pieces, calls = ts.LLM._pieces, []

    def interrupted_once(self, prompt, params):
        calls.append(prompt)
        stream = pieces(self, prompt, params)
        yield next(stream)
        if len(calls) == 1:
            raise KeyboardInterrupt
        yield from stream

    monkeypatch.setattr(ts.LLM, "_pieces", interrupted_once)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nAnd then?\n\n"))
    out = run(capsys, "chat", "--model", str(text_model_dir()), "--max-tokens", "5")
    assert out.out.count("> ") == 3 and out.out.count("[stopped]") == 1 and len(calls) == 2


def test_chat_with_a_model_that_has_no_chat_template_is_refused_before_the_first_message(capsys, monkeypatch,
                                                                                          tmp_path):
    model = shutil.copytree(text_model_dir(), tmp_path / "plain")
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    with pytest.raises(SystemExit, match="this model has no chat template, so it cannot chat"):
        main(["chat", "--model", str(model), "--max-tokens", "5"])
    assert "> " not in capsys.readouterr().out


def test_chat_with_a_chat_template_that_does_not_parse_is_refused_naming_its_file(capsys, monkeypatch, tmp_path):
    model = shutil.copytree(text_model_dir(), tmp_path / "broken")
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{% if %}"}))
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    with pytest.warns(UserWarning), pytest.raises(SystemExit, match=f"(?s)cannot be used.*{model}/tokenizer_config.json"
                                                                    ".*not a Jinja template.*cannot chat"):
        main(["chat", "--model", str(model), "--max-tokens", "5"])
    assert "> " not in capsys.readouterr().out


@pytest.mark.parametrize("end", ["/exit", "/quit"])
def test_chat_ends_at_exit_or_quit(capsys, monkeypatch, end):
    monkeypatch.setattr("sys.stdin", io.StringIO(f"Hi\n{end}\nnever sent\n"))
    out = run(capsys, "chat", "--model", str(text_model_dir()), "--max-tokens", "5")
    assert out.out.count("> ") == 2 and end in out.err   # the reply to "Hi", then the prompt it ended


def test_inspect_prints_stages_and_writes_dot(capsys, tmp_path):
    dot = tmp_path / "segments.dot"
    out = run(capsys, "inspect", "--model", str(text_model_dir()), "--dot", str(dot))
    assert "stage narrowing" in out.out and "pass history: trace -> narrow_rows" in out.out
    text = dot.read_text()
    assert text.startswith("strict digraph") and '"00.encoder.graph"' in text and "->" in text
    decode = run(capsys, "inspect", "--model", str(text_model_dir()), "--mode", "decode", "--full")
    assert "decode: 1 segments (1 graph, 0 break)" in decode.out and "rope_decode_attention" in decode.out


def test_inspect_compiled_prints_what_the_engine_runs(capsys):
    out = run(capsys, "inspect", "--model", str(text_model_dir()), "--mode", "decode", "--compiled", "--device", "cpu")
    assert "# compiled for cpu:" in out.out and "## decode" in out.out and "00.decode.graph" in out.out


@pytest.mark.parametrize("bench", ["latency", "throughput"])
def test_bench_lengths_past_the_context_are_refused_in_its_flags_words(capsys, bench):
    with pytest.raises(SystemExit, match=rf"^tokenspeed bench {bench}: error: --input-len 60 \+ --output-len 8 = 68 "
                                         r"exceeds max_model_len=64"):
        main(["bench", bench, "--model", str(text_model_dir()), "--max-model-len", "64", "--input-len", "60",
              "--output-len", "8"])


def test_bench_prints_vllm_figures(capsys):
    model = str(text_model_dir())
    latency = run(capsys, "bench", "latency", "--model", model, "--input-len", "8", "--output-len", "4",
                  "--batch-size", "2", "--num-iters", "2", "--num-iters-warmup", "1")
    assert "Avg latency:" in latency.out and "99% percentile latency:" in latency.out
    throughput = run(capsys, "bench", "throughput", "--model", model, "--num-prompts", "6",
                     "--input-len", "8", "--output-len", "4", "--max-num-seqs", "4")
    assert "requests/s" in throughput.out and "Total num output tokens:  24" in throughput.out


def test_bench_latency_shows_its_runs_progress(capsys, monkeypatch):
    """Twelve runs of the default batch take a minute on the CPU: each phase has a bar."""
    import tqdm
    bars, real = [], tqdm.tqdm

    def recorded(iterable=None, **kw):
        bars.append((kw.get("desc"), len(iterable) if iterable is not None else kw.get("total")))
        return real(iterable, **kw)
    monkeypatch.setattr(tqdm, "tqdm", recorded)
    run(capsys, "bench", "latency", "--model", str(text_model_dir()), "--input-len", "4", "--output-len", "2",
        "--batch-size", "1", "--num-iters", "3", "--num-iters-warmup", "1")
    assert [bar for bar in bars if bar[0] in ("warm-up runs", "timed runs")] == [("warm-up runs", 1),
                                                                                ("timed runs", 3)]


@pytest.mark.parametrize("argv", [["serve", "--max-num-seqs", "100000"],
                                  ["bench", "throughput", "--max-num-seqs", "70000"]])
def test_max_num_seqs_past_its_limit_is_refused_as_the_flags_are_read(capsys, argv):
    with pytest.raises(SystemExit):
        main(argv)
    assert "argument --max-num-seqs: must be in [1, 65536]" in capsys.readouterr().err


def test_a_latency_batch_past_the_running_limit_is_refused_as_the_flags_are_read(capsys):
    """The batch runs at once (``max_num_seqs=batch_size``): it was refused only after the
    model loaded, as ``max_num_seqs=100000``, a flag the command does not have."""
    with pytest.raises(SystemExit):
        main(["bench", "latency", "--batch-size", "100000"])
    assert "argument --batch-size: must be in [1, 65536], got 100000" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--temperature", "-1"], "temperature=-1.0: must be a finite number >= 0"),
    (["generate", "hi", "--model", "/no/such/dir"], "/no/such/dir: no such file or directory"),
    (["serve", "/no/such/dir"], "/no/such/dir: no such file or directory"),
    (["generate", "hi", "--dtype", "fp9"], "dtype='fp9'"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens=0: must be an integer >= 1"),
    (["inspect", "--model", __file__], "test_cli.py: neither a model directory (with config.json) nor a GGUF"),
    (["inspect", "--device", "cuda"], "--device cuda names where --compiled compiles the model"),
    (["inspect", "--compiled", "--device", "tpu"], "device='tpu' is not a device"),
    (["inspect", "--attention-breaks", "--mode", "decode"], "--attention-breaks lowers the prefill program"),
    (["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"], "cannot reach http://127.0.0.1:9"),
    (["serve", "--metrics-need-key"], "--metrics-need-key guards /metrics with the API key: give --api-key too"),
])
def test_errors_are_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert message in str(exit_.value) and "\n" not in str(exit_.value)
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err and printed.out == ""   # refused before anything prints


def test_a_reader_that_closes_the_pipe_ends_generate_quietly():
    """``tokenspeed generate ... | head -c 1``: no error line, no traceback."""
    script = ("from tokenspeed.cli.main import main\n"
              f"main(['generate', '--model', {str(text_model_dir())!r}, '--max-tokens', '200', '--temperature', '1', '--seed', '1', 'hi'])")
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    child.stdout.read(1)
    child.stdout.close()
    err = child.stderr.read().decode()
    assert child.wait(timeout=120) == 1 and "Broken pipe" not in err and "Traceback" not in err, err


def test_a_folder_that_is_no_model_is_named_with_what_it_lacks(tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hi", "--model", str(tmp_path)])
    assert f"{tmp_path}/config.json not found: expected a Hugging Face model directory" in str(exit_.value)


@pytest.mark.parametrize("command", [[], ["generate"], ["chat"], ["serve"], ["inspect"], ["bench", "latency"],
                                     ["bench", "serve"]])
def test_help_imports_no_torch(command):
    """``--help`` answers without importing torch (it took 5 s when a default needed it)."""
    script = ("import sys\nfrom tokenspeed.cli.main import main\n"
              f"try:\n    main({[*command, '--help']!r})\nexcept SystemExit:\n    pass\n"
              "print('torch imported:', 'torch' in sys.modules)")
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage: tokenspeed" in done.stdout and done.stdout.endswith("torch imported: False\n")


def _commands(top: argparse.ArgumentParser):
    stack = [top]
    while stack:
        command = stack.pop()
        yield command
        stack.extend(c for a in command._actions if isinstance(a, argparse._SubParsersAction)
                     for c in a.choices.values())


def test_every_commands_help_says_what_it_does_in_plain_text():
    """``tokenspeed --help`` began with reST's ````tokenspeed````; ``bench latency --help``
    and ``bench throughput --help`` said nothing of what they do."""
    for command in _commands(parser()):
        assert command.description and "``" not in command.description, command.prog


def test_help_shows_every_default():
    commands = list(_commands(parser()))
    assert len(commands) >= 8
    for command in commands:
        assert command.formatter_class is DefaultsHelpFormatter
        formatter = command._get_formatter()
        for action in command._actions:
            if action.option_strings and action.nargs != 0 and action.default is not argparse.SUPPRESS:
                assert "default" in formatter._get_help_string(action), (command.prog, action.dest)
            if action.option_strings:   # each option says what it is, besides its default
                assert action.help and not action.help.startswith("(default"), (command.prog, action.dest)
    for text in (parser().format_help(), next(c for c in commands if c.prog.endswith(" bench")).format_help()):
        assert "(default: none)" not in text   # a subcommand has no default
    generate = next(c for c in commands if c.prog.endswith(" generate")).format_help()
    assert "generation_config.json, else 1.0" in " ".join(generate.split())


def test_serve_takes_the_model_as_vllm_serve_does(capsys):
    assert parser().parse_args(["serve", "some.gguf", "--port", "9"]).model_tag == "some.gguf"
    assert parser().parse_args(["serve", "--model", "some.gguf"]).model == "some.gguf"
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "a.gguf", "--model", "b.gguf"])
    assert "the model is given twice, as 'a.gguf' and --model 'b.gguf'" in str(exit_.value)


def test_serve_flags_become_the_servers_options():
    """Timeouts and CORS from the command line reach the server as its options (parsed,
    no server started)."""
    from tokenspeed.cli import serve_cmd
    from tokenspeed.cli.main import parser
    args = parser().parse_args(["serve", "m", "--request-timeout", "30", "--shutdown-timeout", "2",
                                "--allowed-origins", "http://a.test", "--metrics-need-key"])
    assert (args.model_tag, args.request_timeout, args.shutdown_timeout) == ("m", 30.0, 2.0)
    access = serve_cmd.access(args)
    assert access.allowed_origins == ("http://a.test",) and access.metrics_need_key
    assert not access.request_chat_template
    assert serve_cmd.access(parser().parse_args(["serve", "--trust-request-chat-template"])).request_chat_template
    assert serve_cmd.access(parser().parse_args(["serve"])).allowed_origins == ()


def test_a_served_model_id_is_named_as_it_is():
    from tokenspeed.cli.serve_cmd import _model_name
    assert _model_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert _model_name("/models/tiny.gguf") == "tiny"


def test_a_served_path_is_named_by_its_folder_however_it_is_written(tmp_path, monkeypatch):
    """``serve .`` in the model's folder (or ``..`` below it) names the model by the folder,
    not "" or "..", which no client asks for; a link keeps its own name."""
    from tokenspeed.cli.serve_cmd import _model_name
    model = tmp_path / "tiny-llama"
    (model / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(model)
    monkeypatch.chdir(model)
    assert [_model_name(p) for p in (".", "./", "sub/..", f"{model}/", str(tmp_path / "link"))] == \
        ["tiny-llama"] * 4 + ["link"]


def test_engine_flags_reach_the_llms_options():
    from tokenspeed.cli.main import llm_options, parser
    args = parser().parse_args(["generate", "x", "--device", "cpu", "--max-chunk-tokens", "64",
                                "--max-model-len", "512", "--num-kv-pages", "40"])
    options = llm_options(args)
    assert options["max_chunk_tokens"] == 64 and options["max_model_len"] == 512 and options["num_kv_pages"] == 40
    assert "max_chunk_tokens" not in llm_options(parser().parse_args(["generate", "x", "--device", "cpu"]))


@pytest.mark.parametrize("argv, message", [
    (["bench", "latency", "--input-len", "-4"], "argument --input-len: must be >= 1, got -4"),
    (["bench", "latency", "--num-iters", "0"], "argument --num-iters: must be >= 1, got 0"),
    (["bench", "latency", "--num-iters-warmup", "-1"], "must be >= 0, got -1"),
    (["bench", "latency", "--batch-size", "x"], "argument --batch-size: not an integer: 'x'"),
    (["bench", "throughput", "--num-prompts", "-3"], "argument --num-prompts: must be >= 1, got -3"),
    (["bench", "serve", "--output-len", "0"], "argument --output-len: must be >= 1, got 0"),
    (["bench", "latency", "--output-json", "/no/such/folder/figures.json"],
     "the folder /no/such/folder does not exist"),
    (["inspect", "--dot", "/no/such/folder/g.dot"], "the folder /no/such/folder does not exist"),
    (["inspect", "--dot", "/tmp"], "argument --dot: /tmp is a folder: name a file in it"),
    (["bench", "serve", "--request-rate", "0"], "argument --request-rate: must be > 0, got 0.0"),
    (["serve", "--max-num-seqs", "0"], "argument --max-num-seqs: must be in [1, 65536], got 0"),
    (["generate", "hi", "--speculative-tokens", "-1"], "argument --speculative-tokens: must be in [0, 128], got -1"),
    (["generate", "hi", "--max-model-len", "0"], "argument --max-model-len: must be >= 1, got 0"),
    (["serve", "--num-kv-pages", "1"], "argument --num-kv-pages: must be >= 2, got 1"),
    (["serve", "--api-key", ""], "argument --api-key: must not be blank, got ''"),   # "$KEY" with KEY unset
    (["serve", "--served-model-name", " "], "argument --served-model-name: must not be blank, got ' '"),
])
def test_bad_numbers_and_paths_are_refused_before_a_model_loads(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_no_speculative_tokens_is_a_value_not_an_error():
    assert parser().parse_args(["generate", "hi", "--speculative-tokens", "0"]).speculative_tokens == 0
