"""The server's channel to its engine and its life around the engine: records of any size
cross the channel (the HTTP side under uvloop), a dead engine stops the server at once, a
stalled engine turns the health check 503 until it resumes, a request's deadline, and a
bounded drain on SIGTERM."""

import asyncio
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvloop
from hypothesis import given, settings, strategies as st

import tokenspeed as ts
from tokenspeed.entrypoints.channel import FrameProtocol, FrameSocket, connect, frame, socket_pair
from tokenspeed.entrypoints.engine_process import EngineSpec
from tokenspeed.entrypoints.openai.server import create_app

from test_server import free_port, running
from text_models import text_model_dir

OPTIONS = dict(page_size=4, max_num_seqs=8, max_model_len=256)
LONG = {"prompt": "A long story begins", "max_tokens": 200, "ignore_eos": True}


def echo(channel: FrameSocket) -> None:
    """The engine's side of a test: every record back as it came, until the other end closes."""
    with contextlib.suppress(EOFError):
        while True:
            channel.send(channel.recv())


def test_records_of_tens_of_megabytes_cross_both_ways_under_uvloop():
    """A record far larger than the socket's buffer, written from the event loop's side
    between small ones, arrives whole and in order, and so does its echo."""
    ours, theirs = socket_pair()
    engine = threading.Thread(target=echo, args=(FrameSocket(theirs),), daemon=True)
    engine.start()
    big = bytes(range(256)) * (40 << 12)   # 40 MiB
    records = ["before", big, list(range(100_000)), "after"]

    async def scenario():
        arrived, closed = [], asyncio.Event()
        protocol = await connect(ours, arrived.append, closed.set)
        for record in records:
            protocol.send(record)
        while len(arrived) < len(records):
            await asyncio.sleep(0.01)
        protocol.transport.close()
        await asyncio.wait_for(closed.wait(), 5)
        return arrived
    assert uvloop.run(asyncio.wait_for(scenario(), 60)) == records
    engine.join(5)
    assert not engine.is_alive()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=8), st.lists(st.integers(1, 64), min_size=1))
def test_frames_are_parsed_from_any_pieces(records, cuts):
    """However the socket splits the stream, every record is handed over once, in order."""
    data = b"".join(frame(record) for record in records)
    arrived = []
    protocol = FrameProtocol(arrived.append, lambda: None)
    start, i = 0, 0
    while start < len(data):
        protocol.data_received(data[start:start + cuts[i % len(cuts)]])
        start, i = start + cuts[i % len(cuts)], i + 1
    assert arrived == records


def test_a_record_that_does_not_pickle_writes_nothing():
    ours, theirs = socket_pair()
    with pytest.raises(TypeError):
        FrameSocket(theirs).send(threading.Lock())
    FrameSocket(theirs).send("next")
    assert FrameSocket(ours).recv() == "next"


def large_report_llm(path: str, **options):
    """An ``LLM`` (module-level, so an engine spec of it pickles into the engine process)."""
    return ts.LLM(path, **options)


@pytest.fixture(scope="module")
def large_url():
    """A server whose reports carry a request's whole output at its end (a stream
    interval past every output), with a body limit of 8 MiB."""
    path = str(text_model_dir())
    options = dict(page_size=16, max_num_seqs=64, max_model_len=256)
    spec = EngineSpec(functools.partial(large_report_llm, path, **options), path, stream_interval=10_000)
    with running(create_app(spec, "m", max_body_bytes=8 << 20)) as url:
        yield url


@pytest.mark.slow
def test_a_very_large_report_and_a_very_large_body_are_answered_and_the_server_serves_on(large_url):
    """A step report of 64 completions' 120 tokens with 20 log-probabilities each (some
    megabytes, in one report), and a request of 300 prompts (some hundreds of kilobytes
    of records down the channel at once): both answer, and so does the next request."""
    body = {"prompt": "Once upon", "max_tokens": 120, "n": 64, "logprobs": 20, "ignore_eos": True,
            "temperature": 1.0, "seed": 3}
    report = httpx.post(f"{large_url}/v1/completions", json=body, timeout=120)
    assert report.status_code == 200, report.text
    choices = report.json()["choices"]
    assert len(choices) == 64 and all(len(c["logprobs"]["tokens"]) == 120 for c in choices)
    prompts = [[(7 * i + j) % 40_000 + 100 for j in range(200)] for i in range(300)]
    many = httpx.post(f"{large_url}/v1/completions", json={"prompt": prompts, "max_tokens": 1}, timeout=300)
    assert many.status_code == 200, many.text
    assert sorted(c["index"] for c in many.json()["choices"]) == list(range(300))
    after = httpx.post(f"{large_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert after.status_code == 200 and httpx.get(f"{large_url}/health").status_code == 200


@pytest.fixture(scope="module")
def deadline_app():
    """A server whose requests have a deadline of 1 s."""
    path = str(text_model_dir())
    app = create_app(EngineSpec(functools.partial(ts.LLM, path, **OPTIONS), path), "m", request_timeout=1.0)
    with running(app) as url:
        yield app, url


@contextlib.contextmanager
def stopped(pid: int):
    """The process ``pid`` stopped (SIGSTOP) while inside."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def wait_for(condition, seconds: float) -> float:
    """Seconds until ``condition()`` held; fails after ``seconds``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < seconds, f"not within {seconds} s"
        time.sleep(0.05)
    return time.monotonic() - start


def health(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=5).status_code


def test_a_stalled_engine_turns_the_health_check_503_until_it_resumes(deadline_app):
    app, url = deadline_app
    assert health(url) == 200
    with stopped(app.state.server.engine.process.process.pid):
        wait_for(lambda: health(url) == 503, 3)
    wait_for(lambda: health(url) == 200, 3)


def test_a_request_past_its_deadline_is_answered_504_and_aborted_in_the_engine(deadline_app):
    """Non-streamed: a 504 error body; streamed: an error event, then ``[DONE]``. Once the
    engine resumes it has dropped both (no pages held), and serves on."""
    app, url = deadline_app
    with stopped(app.state.server.engine.process.process.pid):
        plain = httpx.post(f"{url}/v1/completions", json=LONG, timeout=30)
        with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=30) as stream:
            lines = [line for line in stream.iter_lines() if line]
    assert plain.status_code == 504 and plain.json()["error"]["code"] == 504
    assert "longer than the server's limit of 1 s" in plain.json()["error"]["message"]
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == 504 and lines[-1] == "data: [DONE]"
    wait_for(lambda: "tokenspeed_kv_pages_in_use 0.0" in httpx.get(f"{url}/metrics").text, 10)
    short = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert short.status_code == 200


def test_timeouts_below_or_at_zero_are_refused():
    spec = EngineSpec(functools.partial(ts.LLM, "unused"), None)
    with pytest.raises(ValueError, match="request_timeout must be a number of seconds above 0, got 0"):
        create_app(spec, "m", request_timeout=0)
    from tokenspeed.entrypoints.openai.server import serve
    with pytest.raises(ValueError, match="shutdown_timeout must be a number of seconds above 0, got -1"):
        serve(spec, "m", shutdown_timeout=-1)
