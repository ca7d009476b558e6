"""The OpenAI-compatible server, on a free loopback port, driven by the official ``openai``
client and plain HTTP: answers equal offline ``generate``, streams join to the answer,
16 clients at once each get their own, a client that leaves frees its pages, bad input
is a 400 naming the field (and the server serves on), auth, size limits, internal errors."""

import functools
import gc
import importlib.metadata
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from hypothesis import given, settings, strategies as st

import tokenspeed as ts
from tokenspeed.api.engine_core import EngineCore
from tokenspeed.server.engine_loop import EngineLoop, Submit
from tokenspeed.server.engine_process import EngineSpec
from tokenspeed.server.openai.server import create_app
from tokenspeed.api.output_processor import PromptOutput
from tokenspeed.api.prompts import parse_prompts

from hf_models import checkpoint
from serving import free_port, running
from text_models import llm_failing_on, text_model_dir

KEY = "sesame"
MODEL = "tiny-text"
GREEDY = ts.SamplingParams(temperature=0, max_tokens=10)
OPTIONS = dict(page_size=4, max_num_seqs=8, max_model_len=256)
POISON = 4321           # a prompt holding this token makes the engine's step fail


@pytest.fixture(scope="module")
def llm():
    return ts.LLM(text_model_dir(), **OPTIONS)


@pytest.fixture(scope="module")
def base_url():
    """The server, its engine (the same model as ``llm``) in its own process."""
    path = str(text_model_dir())
    spec = EngineSpec(functools.partial(llm_failing_on, path, POISON, **OPTIONS), path)
    with running(create_app(spec, MODEL, api_key=KEY, max_body_bytes=64 << 10)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)


def post(base_url, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{base_url}{path}", content=content, headers={**headers, "content-type": "application/json"},
                      timeout=30, **kw)


def metric(base_url, name) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_the_metrics_give_the_pools_size_beside_the_pages_in_use(base_url, llm):
    assert metric(base_url, "tokenspeed_kv_pages_total") == llm.engine.limits.usable_pages > 0


def test_completion_equals_offline_generate(client, llm):
    got = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=10, temperature=0)
    want = llm.generate("The sea is", GREEDY, use_tqdm=False)[0]
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids) and got.usage.completion_tokens == 10


def test_chat_equals_offline_chat(client, llm):
    messages = [{"role": "user", "content": "Hello!"}]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    want = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"


def test_several_prompts_and_samples(client, llm):
    got = client.completions.create(model=MODEL, prompt=["One", "Two"], max_tokens=5, n=2, seed=3,
                                    temperature=1.0)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    offline = llm.generate(["One", "Two"], ts.SamplingParams(max_tokens=5, n=2, seed=3), use_tqdm=False)
    assert [c.text for c in got.choices] == [c.text for o in offline for c in o.outputs]


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_deltas_join_to_the_answer(client, chat):
    kw = dict(model=MODEL, max_tokens=12, temperature=0)
    if chat:
        kw["messages"] = [{"role": "user", "content": "Tell me a story"}]
        whole = client.chat.completions.create(**kw).choices[0].message.content
        chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    else:
        kw["prompt"] = "Tell me a story"
        whole = client.completions.create(**kw).choices[0].text
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        pieces = [c.choices[0].text for c in chunks if c.choices]
    assert len(pieces) > 2 and "".join(pieces) == whole
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_a_stream_ends_with_done(base_url):
    with httpx.stream("POST", f"{base_url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "Hi", "max_tokens": 3, "stream": True}, timeout=30) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_sixteen_concurrent_clients_each_get_their_own(client, llm):
    check_sixteen_clients(client, MODEL, llm)


def check_sixteen_clients(client, model: str, llm) -> None:
    """16 clients at once, each answered what offline ``generate`` says of its prompt."""
    prompts = [f"Client {i} says" for i in range(16)]
    want = [o.text for o in llm.generate(prompts, ts.SamplingParams(temperature=0, max_tokens=8),
                                         use_tqdm=False)]
    got = [None] * 16

    def ask(i):
        got[i] = client.completions.create(model=model, prompt=prompts[i], max_tokens=8,
                                           temperature=0).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


def test_bench_serve_drives_the_server_when_released(base_url, tmp_path):
    """``tokenspeed bench serve`` as a launcher runs it: set up, says so, waits for the
    release, then streams every prompt and reports vLLM's figures; the pages come back."""
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "tokenspeed", "bench", "serve", "--base-url", base_url, "--api-key", KEY,
               "--num-prompts", "6", "--input-len", "8", "--output-len", "5", "--max-concurrency", "3",
               "--output-json", str(out), "--start-on-stdin"]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout.readline().strip() == b"ready"
    report, errors = process.communicate(b"go\n", timeout=120)
    assert process.returncode == 0, errors.decode()
    summary = json.loads(out.read_text())
    assert (summary["completed"], summary["failed"], summary["total_output_tokens"]) == (6, 0, 30)
    # a stream's tokens may all arrive in one read on a busy host: its time per token is then 0
    assert summary["ttft_ms"]["p50"] > 0 and summary["tpot_ms"]["p99"] >= summary["tpot_ms"]["p50"] >= 0
    assert "Output token throughput (tok/s):" in report.decode()
    for _ in range(200):      # the gauge follows the engine's next report
        if metric(base_url, "tokenspeed_kv_pages_in_use") == 0:
            break
        time.sleep(0.05)
    assert metric(base_url, "tokenspeed_kv_pages_in_use") == 0


def test_bench_serve_fails_when_every_request_failed(base_url, capsys):
    from tokenspeed.cli.main import main
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serve", "--base-url", base_url, "--api-key", KEY, "--num-prompts", "2",
              "--input-len", "300", "--output-len", "2"])   # past the server's max_model_len
    assert "every one of the 2 requests failed" in str(exit_.value) and "max_model_len" in str(exit_.value)
    assert "Failed requests:                        2" in capsys.readouterr().out   # the figures still print


def test_bench_serve_refuses_a_model_the_server_does_not_serve_before_sending(base_url, capsys):
    from tokenspeed.cli.main import main
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serve", "--base-url", base_url, "--api-key", KEY, "--model", "not-served"])
    assert f"--model 'not-served': {base_url} serves [{MODEL!r}]" in str(exit_.value)
    assert "Failed requests" not in capsys.readouterr().out


def test_a_client_that_leaves_frees_its_pages(base_url):
    body = {"prompt": "A long story begins", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert next(lines) == "" and next(lines).startswith("data: ")      # generating
        assert metric(base_url, "tokenspeed_kv_pages_in_use") > 0
    for _ in range(100):
        if metric(base_url, "tokenspeed_kv_pages_in_use") == 0 and \
                metric(base_url, "tokenspeed_requests_running") == 0:
            break
        time.sleep(0.1)
    assert metric(base_url, "tokenspeed_kv_pages_in_use") == 0
    assert metric(base_url, "tokenspeed_requests_running") == 0



class _RefusingEngine:
    """An engine link whose second submission fails to go (a record that does not encode)."""
    alive = True

    def __init__(self):
        self.sent, self.aborted = [], []

    def submit(self, key, prompt, params, at_end=False):
        if self.sent:
            raise TypeError("this record does not encode")
        self.sent.append(key)

    def abort(self, key):
        self.aborted.append(key)


def test_a_submission_that_fails_to_go_leaves_nothing_in_flight():
    """A request whose second prompt cannot be sent fails whole: none of its prompts stays
    in the server's map (for ever: the engine never ends a prompt it never got), and the one
    already sent is aborted rather than left to run with no reader."""
    from tokenspeed.api.prompts import Prompt
    from tokenspeed.server.openai.server import Server
    server, engine = Server(lambda: None, None, "m"), _RefusingEngine()
    server.engine = engine
    params = ts.SamplingParams(max_tokens=4)
    with pytest.raises(TypeError):
        server.submit([Prompt((1, 2)), Prompt((3, 4))], [params, params])
    assert server._in_flight == {}
    assert engine.sent and set(engine.sent) <= set(engine.aborted)

@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x " * 200, "max_tokens": 100}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": [1.5, 2]}, "prompt"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logit_bias": {"1000000000": 1.0}}, "logit_bias"),
    ({"prompt": "x", "frobnicate": True}, "frobnicate"),
    ({"max_tokens": 4}, "prompt"),
])
def test_bad_requests_are_400_naming_the_field(base_url, client, body, param):
    response = post(base_url, "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == 400 and error["message"] and error["type"]
    assert client.completions.create(model=MODEL, prompt="still", max_tokens=2).choices[0].text is not None


def test_malformed_json_and_bad_chat(base_url):
    response = post(base_url, "/v1/completions", "{not json")
    assert response.status_code == 400 and "invalid JSON" in response.json()["error"]["message"]
    for lone in ('"a\\ud800b"', '"a\\udc00b"'):   # valid syntax, no character: the message says why
        message = post(base_url, "/v1/completions", f'{{"prompt": {lone}}}').json()["error"]["message"]
        assert "invalid JSON" in message and "half of a UTF-16 pair" in message, message
    for body in ([1, 2], 5):   # JSON, not an object
        response = post(base_url, "/v1/completions", body)
        assert response.status_code == 400 and response.json()["error"]["message"].startswith("body: Input should be an object")
    response = post(base_url, "/v1/chat/completions", {"messages": []})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    response = post(base_url, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_an_api_key_is_required_on_v1(base_url):
    assert post(base_url, "/v1/completions", {"prompt": "x"}, key=None).status_code == 401
    wrong = post(base_url, "/v1/completions", {"prompt": "x"}, key="nope")
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(f"{base_url}/health").status_code == 200           # outside /v1


def test_the_version_is_served_as_vllm_serves_it(base_url):
    response = httpx.get(f"{base_url}/version", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200 and response.json() == {"version": importlib.metadata.version("tokenspeed")}


def test_a_body_over_the_limit_is_413(base_url):
    response = post(base_url, "/v1/completions", {"prompt": "x" * (70 << 10)})
    assert response.status_code == 413 and response.json()["error"]["code"] == 413


def test_models_tokenize_detokenize(base_url, llm):
    models = httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    tokens = post(base_url, "/tokenize", {"prompt": "Hello world"}).json()
    assert tokens["tokens"] == llm.tokenizer.encode("Hello world") and tokens["count"] == len(tokens["tokens"])
    assert post(base_url, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"] == "Hello world"
    assert post(base_url, "/detokenize", {"tokens": [10**9]}).status_code == 400


def test_an_internal_error_fails_its_request_and_the_server_serves_on(base_url, client):
    response = post(base_url, "/v1/completions", {"prompt": [5, POISON, 6], "max_tokens": 3})
    assert response.status_code == 500 and "a kernel fell over" in response.json()["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="again", max_tokens=2).choices[0].text is not None
    assert metric(base_url, "tokenspeed_kv_pages_in_use") == 0
    assert httpx.get(f"{base_url}/health").status_code == 200


def test_logprobs_in_both_apis(client):
    got = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, logprobs=2, temperature=0)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == 3 and all(len(top) == 2 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, logprobs=True, top_logprobs=2, temperature=0)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 3 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)


def test_each_finished_request_is_counted_once(base_url, client):
    def finished():
        text = httpx.get(f"{base_url}/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("tokenspeed_requests_finished_total"))

    before = finished()
    for stream in (False, True, False):
        response = client.completions.create(model=MODEL, prompt="count me", max_tokens=3, stream=stream)
        if stream:
            list(response)
    time.sleep(0.3)
    assert finished() - before == 3


def test_a_serving_process_keeps_its_startup_heap_out_of_collections(base_url):
    """This process serves ``base_url`` (uvicorn in a thread): its startup heap is frozen."""
    assert gc.get_freeze_count() > 0


def test_an_engine_process_that_dies_fails_its_requests_and_the_health_check():
    path = str(text_model_dir())
    app = create_app(EngineSpec(functools.partial(ts.LLM, path, **OPTIONS), path), MODEL)
    with running(app) as url:
        body = {"prompt": "A long story begins", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            app.state.server.engine.process.process.kill()
            rest = [line for line in lines if line]
        assert "the engine process exited" in rest[-2] and rest[-1] == "data: [DONE]"
        assert httpx.get(f"{url}/health").status_code == 503
        after = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert after.status_code == 503 and "not running" in after.json()["error"]["message"]


def test_clients_that_leave_take_nothing_from_the_others(base_url, client, llm):
    """Aborted prompts' last updates share reports with other prompts' tokens: a client
    that stays gets every token while others come and go."""
    want = llm.generate("Stay with me", ts.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0].text
    got = []
    stayer = threading.Thread(target=lambda: got.append(client.completions.create(
        model=MODEL, prompt="Stay with me", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})))
    stayer.start()
    for i in range(6):
        body = {"prompt": f"Leaver {i}", "max_tokens": 100, "stream": True}
        with httpx.stream("POST", f"{base_url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json=body, timeout=30) as response:
            assert next(response.iter_lines()).startswith("data: ")
    stayer.join(timeout=60)
    assert got and got[0].choices[0].text == want


def test_a_weights_only_directory_serves_token_ids(tmp_path):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((text_model_dir() / name).read_bytes())
    assert EngineSpec.of(tmp_path).tokenizer is None
    assert EngineSpec.of(text_model_dir()).tokenizer == str(text_model_dir())


def test_an_engine_loop_that_fails_outside_a_step_says_so(llm):
    reports, crashes = [], []
    loop = EngineLoop(EngineCore(llm.engine), lambda client, r: reports.append(r), crashes.append).start()
    loop.inbox.put(Submit(0, "not a prompt record", GREEDY, 0, False))
    loop.thread.join(timeout=30)
    assert not loop.thread.is_alive() and "the engine loop failed" in crashes[0]


def test_a_speculative_server_streams_what_plain_decoding_says(llm):
    path = str(text_model_dir())
    spec = EngineSpec(functools.partial(ts.LLM, path, speculative=ts.SpeculativeConfig(num_tokens=3, verify_cost=1.0),
                                        **OPTIONS), path)
    prompt = "one two three one two three one two"
    want = llm.generate(prompt, ts.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].text
    with running(create_app(spec, MODEL)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == want
        # a stop string inside a window: the tokens after it are neither sent nor counted
        for stop in {want[i:i + 2] for i in range(2, len(want) - 4, max(3, (len(want) - 6) // 4))}:
            before = metric(url, "tokenspeed_generation_tokens_total")
            got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                            stop=[stop], extra_body={"ignore_eos": True})
            time.sleep(0.3)
            counted = metric(url, "tokenspeed_generation_tokens_total") - before
            assert counted == got.usage.completion_tokens, (stop, got.choices[0].text)


def answers(tokenizer, params, prompt, updates) -> list:
    """An engine loop's token updates of ``prompt`` made into its answers, as the API
    server's process makes them."""
    output = PromptOutput(tokenizer, params, len(prompt.token_ids))
    return [answer for answer in (output.update(u)[0] for u in updates) if answer is not None]


def generate_and_loop(llm, params, prompt_text="The sea is", **core_options):
    """``generate``'s output for the prompt, and the updates an ``EngineLoop`` reports for
    it (as answers), until the last finishes."""
    want = llm.generate(prompt_text, params, use_tqdm=False)[0]
    reports = []
    loop = EngineLoop(EngineCore(llm.engine, **core_options), lambda client, r: reports.append(r), print).start()
    [prompt] = parse_prompts(prompt_text, llm.tokenizer)
    loop.inbox.put(Submit(7, prompt, params, 0, False))
    for _ in range(600):
        updates = [u for r in reports for key, u in r.updates]
        if updates and updates[-1].finished:
            break
        time.sleep(0.05)
    loop.stop()
    return want, answers(llm.tokenizer, params, prompt, updates)


def test_an_engine_loops_reports_join_to_the_completions(llm):
    """The loop's reports' deltas join to what ``generate`` says, and the last update
    finishes with the counts of the whole completion."""
    params = ts.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2, seed=5)
    want, updates = generate_and_loop(llm, params)
    for completion in want.outputs:
        deltas = [d for u in updates for d in u.deltas if d.index == completion.index]
        assert "".join(d.text for d in deltas) == completion.text
        assert [t for d in deltas for t in d.token_ids] == list(completion.token_ids)
    last = updates[-1]
    assert last.finished and last.error is None and last.num_output_tokens == 24
    assert last.num_prompt_tokens == len(want.prompt_token_ids)


def test_a_stream_interval_sends_the_first_token_then_every_nth_then_the_end(llm):
    """With ``stream_interval=4`` a completion's first token goes out at once, then 4 at a
    time, then the rest at its end, and they join to what ``generate`` says. (With several
    completions an update goes out when any is due, carrying what each has.)"""
    params = ts.SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)
    want, updates = generate_and_loop(llm, params, stream_interval=4)
    deltas = [d for u in updates for d in u.deltas]
    assert [len(d.token_ids) for d in deltas] == [1, 4, 4, 4, 2]
    assert "".join(d.text for d in deltas) == want.outputs[0].text
    assert [t for d in deltas for t in d.token_ids] == list(want.outputs[0].token_ids)


def test_a_stream_interval_below_one_is_refused(capsys):
    from tokenspeed.cli import main as cli
    with pytest.raises(ValueError, match="stream_interval must be an integer of at least 1, got 0"):
        EngineSpec(print, stream_interval=0)
    with pytest.raises(SystemExit):
        cli.main(["serve", "--stream-interval", "0", "--device", "cpu"])
    assert "argument --stream-interval: must be >= 1, got 0" in capsys.readouterr().err


def test_a_stop_string_counts_only_the_tokens_kept(base_url, client, llm):
    """The generated-tokens counter agrees with ``usage``: tokens sampled past a stop string
    are dropped from both."""
    full = llm.generate("The sea is", ts.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].text
    stop = full[len(full) // 3:len(full) // 3 + 3]
    before = metric(base_url, "tokenspeed_generation_tokens_total")
    got = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=24, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "stop" and got.usage.completion_tokens < 24
    time.sleep(0.3)
    assert metric(base_url, "tokenspeed_generation_tokens_total") - before == got.usage.completion_tokens


@settings(max_examples=80, deadline=None)
@given(text=st.text(), index=st.integers(0, 1000), finish=st.sampled_from([None, "stop", "length", "abort"]),
       stop=st.one_of(st.none(), st.integers(0, 99999), st.text(max_size=8)))
def test_a_streamed_choice_is_the_json_of_its_dict(text, index, finish, stop):
    """Stream chunks format their choice directly (per token and client); the text must be
    what ``json.dumps`` makes of the choice's dict, escapes and all."""
    from tokenspeed.server.openai import responses
    from tokenspeed.api.text_updates import CompletionDelta
    delta = CompletionDelta(0, text, (1,), (), finish, stop)
    for fmt in (responses.CompletionFormat(MODEL, None, 1), responses.ChatFormat(MODEL, None, 1)):
        assert fmt.delta_json(index, delta) == json.dumps(fmt.delta_choice(index, delta))
        assert json.loads(fmt.delta_json(index, delta)) == fmt.delta_choice(index, delta)


def test_a_mailbox_hands_over_everything_that_arrived_and_loses_nothing_on_a_timeout():
    import asyncio
    from tokenspeed.server.openai.mailbox import Mailbox

    async def scenario():
        box = Mailbox()
        box.put(1)
        box.put(2)
        assert await box.take_all() == [1, 2]
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(box.take_all(), 0.01)
        asyncio.get_running_loop().call_later(0.01, box.put, 3)
        assert await box.take_all() == [3]
        box.put(4)
        assert await asyncio.wait_for(box.take_all(), 1) == [4]
    asyncio.run(scenario())


def test_a_report_sender_keeps_each_clients_order_and_survives_a_closed_pipe():
    """Reports leave the engine's thread through one queue: each client gets its
    messages in the order sent, a client whose pipe closed costs the others nothing, and
    ``close`` sends everything queued before it returns."""
    from tokenspeed.server.engine_process import EngineFailed
    from tokenspeed.server.report_sender import ReportSender

    pipes = [multiprocessing.Pipe() for _ in range(3)]
    pipes[1][0].close()
    sender = ReportSender([theirs for _, theirs in pipes], EngineFailed)
    for step in range(600):                      # more than the queue holds
        sender.send(step % 3, ("report", step))
    sender.fail("stopped")
    sender.close()
    for client in (0, 2):
        ours = pipes[client][0]
        received = [ours.recv() for _ in range(len(range(client, 600, 3)) + 1)]
        assert received == [("report", step) for step in range(client, 600, 3)] + [EngineFailed("stopped")]
        assert not ours.poll()


def test_a_report_that_cannot_be_sent_fails_every_client_once():
    """A report that does not pickle reaches nobody; every client hears the engine failed,
    and nothing is sent after that (as after a loop that failed)."""
    from tokenspeed.server.engine_process import EngineFailed
    from tokenspeed.server.report_sender import ReportSender

    pipes = [multiprocessing.Pipe() for _ in range(2)]
    sender = ReportSender([theirs for _, theirs in pipes], EngineFailed)
    sender.send(0, "first")
    sender.send(1, threading.Lock())
    sender.send(0, "after")
    sender.close()
    assert pipes[0][0].recv() == "first"
    for ours, _ in pipes:
        assert ours.poll(5)
        failure = ours.recv()
        assert isinstance(failure, EngineFailed) and "TypeError" in failure.message
        assert not ours.poll(0.1)


def test_a_loop_that_fails_in_the_engine_process_tells_its_clients():
    """Wired as the engine process wires it, a loop that fails outside a step reaches each
    client as the engine's exit, with the loop's message."""
    import asyncio
    from tokenspeed.server.channel import FrameSocket, socket_pair
    from tokenspeed.server.engine_client import EngineClient
    from tokenspeed.server.engine_process import start_loop
    from tokenspeed.api.messages import from_engine_decoder, to_engine_decoder

    class Broken:
        @property
        def has_work(self):
            raise RuntimeError("boom")

    class BrokenLLM:
        engine = Broken()

    ours, theirs = socket_pair()
    loop, sender = start_loop(BrokenLLM(), [FrameSocket(theirs, to_engine_decoder())])
    loop.thread.join()
    sender.close()
    exits = []

    async def listen():
        client = EngineClient(FrameSocket(ours, from_engine_decoder()), None, lambda report: None, exits.append)
        await client.listen()
        for _ in range(100):
            if exits:
                return
            await asyncio.sleep(0.01)
    asyncio.run(listen())
    assert len(exits) == 1 and "the engine loop failed: RuntimeError: boom" in exits[0]


def test_several_api_servers_share_one_engine():
    """``tokenspeed serve --api-servers 2``: 16 clients at once each get what offline
    ``generate`` says, whichever process took them; the pooled metrics count every request
    once; a client that leaves frees its pages; SIGTERM stops every process, and no
    process's exit lists leaked objects."""
    path, port = str(text_model_dir()), free_port()
    server, url = api_servers(path, port), f"http://127.0.0.1:{port}"
    try:
        pids = _wait_for_api_servers(server)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        check_sixteen_clients(client, path.rsplit("/", 1)[-1], ts.LLM(path, max_model_len=256))
        body = {"prompt": "A long story begins", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            assert next(response.iter_lines()).startswith("data: ")
        for _ in range(100):
            if metric(url, "tokenspeed_kv_pages_in_use") == 0 and metric(url, "tokenspeed_requests_running") == 0:
                break
            time.sleep(0.1)
        assert metric(url, "tokenspeed_kv_pages_in_use") == 0
        finished = sum(float(line.split()[-1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
                       if line.startswith("tokenspeed_requests_finished_total"))
        assert finished == 17
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    assert server.returncode == 0
    assert "leaked" not in server.stdout.read()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def api_servers(path: str, port: int):
    """``tokenspeed serve --api-servers 2`` of ``path`` on ``port``, its output piped."""
    command = [sys.executable, "-m", "tokenspeed", "serve", "--model", path, "--api-servers", "2",
               "--port", str(port), "--max-num-seqs", "8", "--max-model-len", "256", "--device", "cpu"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_api_servers(server) -> list[int]:
    """The API servers' pids, once the parent says they run (it has started the engine)."""
    for line in server.stdout:
        if "API servers on" in line:
            return [int(pid) for pid in line.rsplit("(pids ", 1)[1].rstrip(")\n").split(", ")]
    raise AssertionError(f"the server exited ({server.wait()}) before serving")


def test_api_servers_refuse_a_bad_count_and_a_port_in_use(capsys):
    from tokenspeed.cli import main as cli
    with pytest.raises(SystemExit):
        cli.main(["serve", "--api-servers", "0", "--device", "cpu"])
    assert "argument --api-servers: must be >= 1, got 0" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port}"):
            cli.main(["serve", "--api-servers", "2", "--port", str(port), "--device", "cpu"])


@pytest.mark.parametrize("api_servers", ["1", "2"])
def test_a_port_in_use_out_of_range_or_an_unknown_host_is_refused_before_the_engine_starts(api_servers,
                                                                                             tmp_path):
    """Refused at once, naming the address: the engine (here of an empty folder, which would
    fail its start otherwise) is never started."""
    from tokenspeed.cli import main as cli
    command = ["serve", str(tmp_path), "--api-servers", api_servers, "--device", "cpu"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            cli.main([*command, "--port", str(port)])
    with pytest.raises(SystemExit, match=r"port=70000: must be in \[0, 65535\]"):
        cli.main([*command, "--port", "70000"])
    with pytest.raises(SystemExit, match="cannot listen on no-such-host.invalid:8000"):
        cli.main([*command, "--host", "no-such-host.invalid"])


def test_an_api_server_that_dies_stops_the_server_and_says_so():
    server = api_servers(str(text_model_dir()), free_port())
    try:
        first, second = _wait_for_api_servers(server)
        os.kill(first, signal.SIGKILL)
        server.wait(timeout=60)
    finally:
        server.kill()
    assert server.returncode == 1 and "tokenspeed-api-0 exited (code -9)" in server.stdout.read()
    with pytest.raises(ProcessLookupError):
        os.kill(second, 0)


def test_a_server_whose_supervisor_is_killed_leaves_no_process():
    server = api_servers(str(text_model_dir()), free_port())
    try:
        pids = _wait_for_api_servers(server)
        server.kill()
        server.wait(timeout=30)
        for _ in range(200):
            if not any(_alive(pid) for pid in pids):
                break
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids)
    finally:
        server.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_submission_the_engine_refuses_fails_alone_and_the_loop_serves_on(llm):
    """A record that slipped past the door's checks is refused where the engine adds it:
    that submission ends with the refusal, the next one is served as ``generate`` serves it."""
    bad = ts.SamplingParams(temperature=1.0, max_tokens=4)
    object.__setattr__(bad, "top_k", 2**63)      # as a record built around its checks
    want = llm.generate("The sea is", GREEDY, use_tqdm=False)[0]
    reports = []
    loop = EngineLoop(EngineCore(llm.engine), lambda client, r: reports.append(r), print).start()
    [prompt] = parse_prompts("The sea is", llm.tokenizer)
    loop.inbox.put(Submit(1, prompt, bad, 0, False))
    loop.inbox.put(Submit(2, prompt, GREEDY, 0, False))
    try:
        for _ in range(600):
            updates = {key: u for r in list(reports) for key, u in r.updates if u.finished}
            if 2 in updates:
                break
            time.sleep(0.05)
    finally:
        loop.stop()
    served = answers(llm.tokenizer, GREEDY, prompt, [u for r in reports for key, u in r.updates if key == 2])
    assert updates[1].error and "top_k=9223372036854775808" in updates[1].error
    assert "".join(d.text for u in served for d in u.deltas) == want.text


def test_llm_add_queues_all_prompts_or_none(llm):
    """A prompt refused while adding takes those queued before it out again: the pool and
    the queue are as they were."""
    bad = ts.SamplingParams(temperature=1.0, max_tokens=4)
    object.__setattr__(bad, "top_k", 2**63)
    prompts = parse_prompts(["The sea is", "A cat"], llm.tokenizer)
    free = llm.engine.scheduler.allocator.num_free
    with pytest.raises(ValueError, match="top_k"):
        llm.add(prompts, [GREEDY, bad])
    assert not llm.engine.scheduler.waiting and not llm.engine.scheduler.running
    assert llm.engine.scheduler.allocator.num_free == free


def test_a_step_that_fails_in_the_loop_is_logged_with_its_traceback(caplog):
    """The step's requests get its message; the engine process's log gets the fault whole
    (an internal fault is fixed in the code: its traceback says where)."""
    from tokenspeed.api.messages import EngineLoad
    from tokenspeed.errors import InternalError

    class FailingCore:
        keys, failed = (), threading.Event()

        @property
        def has_work(self):
            return not self.failed.is_set()

        def step(self):
            self.failed.set()
            raise InternalError("a broken invariant")

        def load(self):
            return EngineLoad(0, 0, 0)

    core = FailingCore()
    loop = EngineLoop(core, lambda client, report: None, print).start()
    core.failed.wait(30)
    loop.stop()
    [record] = [r for r in caplog.records if r.exc_info]
    assert isinstance(record.exc_info[1], InternalError) and "engine step failed" in record.getMessage()


def test_a_model_without_a_tokenizer_serves_token_ids_and_names_what_needs_one():
    """Weights alone (no tokenizer.json): token-id completions are served; chat, text and
    detokenizing are 400s naming the field that would need the tokenizer."""
    app = create_app(EngineSpec.of(str(checkpoint("llama")), **OPTIONS), MODEL)
    with running(app) as url:
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
        for route, body, field in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                                    "messages"), ("/detokenize", {"tokens": [5]}, "tokens"),
                                   ("/tokenize", {"prompt": "hi"}, "prompt")):
            refused = httpx.post(f"{url}{route}", json=body, timeout=60)
            error = refused.json()["error"]
            assert refused.status_code == 400 and error["param"] == field, (route, error)
            assert "this model has no tokenizer" in error["message"]


AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("stream", [False, True])
def test_constraints_that_leave_no_token_are_a_400_for_that_request_alone(base_url, stream):
    """Found mid-run (a grammar and allowed_token_ids that share no token): the request's
    own settings, so a 400 naming why, streamed or not; the server serves on."""
    ids = httpx.post(f"{base_url}/tokenize", json={"prompt": "zzz"}, headers=AUTH).json()["tokens"]
    body = {"prompt": "Answer:", "max_tokens": 10, "allowed_token_ids": ids, "stream": stream,
            "structured_outputs": {"choice": ["yes"]}}
    answer = httpx.post(f"{base_url}/v1/completions", json=body, headers=AUTH, timeout=60)
    if stream:
        [error] = [json.loads(line.removeprefix("data: "))["error"] for line in answer.text.splitlines()
                   if line.startswith("data: {\"error\"")]
    else:
        error = answer.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"
    assert "the request's constraints left no token to sample" in error["message"]
    ok = httpx.post(f"{base_url}/v1/completions", json={"prompt": "still", "max_tokens": 2}, headers=AUTH)
    assert ok.status_code == 200
