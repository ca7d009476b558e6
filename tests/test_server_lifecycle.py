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
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import uvloop
from hypothesis import given, settings, strategies as st

import tokenspeed as ts
from tokenspeed.server.channel import FrameProtocol, FrameSocket, connect, frame, socket_pair
from tokenspeed.server.engine_process import EngineSpec
from tokenspeed.server.openai.server import create_app

from serving import free_port, running
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
    engine = threading.Thread(target=echo, args=(FrameSocket(theirs, msgspec.msgpack.Decoder()),), daemon=True)
    engine.start()
    big = bytes(range(256)) * (40 << 12)   # 40 MiB
    records = ["before", big, list(range(100_000)), "after"]

    async def scenario():
        arrived, closed = [], asyncio.Event()
        protocol = await connect(ours, arrived.append, closed.set, msgspec.msgpack.Decoder())
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
    protocol = FrameProtocol(arrived.append, lambda: None, msgspec.msgpack.Decoder())
    start, i = 0, 0
    while start < len(data):
        protocol.data_received(data[start:start + cuts[i % len(cuts)]])
        start, i = start + cuts[i % len(cuts)], i + 1
    assert arrived == records


def test_a_record_that_does_not_encode_writes_nothing():
    ours, theirs = socket_pair()
    with pytest.raises(TypeError):
        FrameSocket(theirs, msgspec.msgpack.Decoder()).send(threading.Lock())
    FrameSocket(theirs, msgspec.msgpack.Decoder()).send("next")
    assert FrameSocket(ours, msgspec.msgpack.Decoder()).recv() == "next"


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
        with contextlib.suppress(ProcessLookupError):   # killed meanwhile
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
    from tokenspeed.server.openai.server import serve
    with pytest.raises(ValueError, match="shutdown_timeout must be a number of seconds above 0, got -1"):
        serve(spec, "m", shutdown_timeout=-1)


GRACE_S = 3.0


def slow_llm(path: str, delay: float, **options):
    """An ``LLM`` whose every step takes ``delay`` seconds more: a stream that outlasts a
    drain (module-level, so an engine spec of it pickles into the engine process)."""
    llm = ts.LLM(path, **options)
    step = llm.engine.step

    def slow_step():
        time.sleep(delay)
        return step()
    llm.engine.step = slow_step
    return llm


def serve_slowly(path: str, port: int) -> None:
    """``tokenspeed serve`` of a slow engine, drained for ``GRACE_S`` on SIGTERM."""
    from tokenspeed.server.openai.server import serve
    serve(EngineSpec(functools.partial(slow_llm, path, 0.1, **OPTIONS), path), "m", port=port,
          shutdown_timeout=GRACE_S)


def loading_llm(path: str, **options):
    """An ``LLM`` that takes a minute to load (module-level: it pickles into the engine)."""
    time.sleep(60)
    return ts.LLM(path, **options)


def serve_loading(path: str, port: int) -> None:
    from tokenspeed.server.openai.server import serve
    serve(EngineSpec(functools.partial(loading_llm, path, **OPTIONS), path), "m", port=port)


def serve_slowly_twice(path: str, port: int) -> None:
    """``serve_slowly`` with two API servers (``--api-servers 2``)."""
    from tokenspeed.server.openai.api_servers import serve_many
    serve_many(EngineSpec(functools.partial(slow_llm, path, 0.1, **OPTIONS), path), "m", "127.0.0.1", port, None,
               2, shutdown_timeout=GRACE_S)


def serve_command(path: str, port: int) -> list[str]:
    return [sys.executable, "-m", "tokenspeed", "serve", "--model", path, "--port", str(port),
            "--max-num-seqs", "8", "--max-model-len", "256", "--device", "cpu"]


@contextlib.contextmanager
def served(command: list[str], url: str, own_group: bool = False):
    """``command`` (a server) running until ``url``'s health check answers 200 (``own_group``:
    as the leader of a process group of its own)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=own_group)
    try:
        while reachable_health(url) != 200:
            assert process.poll() is None, f"the server exited: {process.stdout.read()}"
            time.sleep(0.2)
        yield process
    finally:
        process.kill()
        process.wait()


def reachable_health(url: str) -> int | None:
    """The health check's status; None where nothing answers."""
    with contextlib.suppress(httpx.HTTPError):
        return health(url)
    return None


def engine_pid(server_pid: int) -> int:
    """The pid of the server's engine process (its spawned child that is not the
    resource tracker)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    [engine] = [int(c) for c in children if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]
    return engine


def admitted_tokens(url: str) -> float:
    """Prompt tokens submitted to the engine, by the server's metrics."""
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return float(next(line.split()[-1] for line in lines if line.startswith("tokenspeed_prompt_tokens_total")))


def requests_seen(url: str) -> float:
    """Requests running, waiting or finished, by the server's metrics."""
    names = ("tokenspeed_requests_running ", "tokenspeed_requests_waiting ", "tokenspeed_requests_finished_total")
    return sum(float(line.split()[-1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
               if line.startswith(names))


def in_flight(url: str, body: dict, outcomes: list) -> threading.Thread:
    """A thread posting ``body``: its status and body lines land in ``outcomes``."""
    def post():
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            outcomes.append((response.status_code, [line for line in response.iter_lines() if line]))
    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_an_engine_killed_under_load_ends_every_request_and_the_server_exits_non_zero():
    """``tokenspeed serve``: the engine is killed while streams and plain requests are in
    flight (stopped first, so that none can finish): /health turns non-200 within a
    second, every request ends at once with a 503 error body (a stream's as an event,
    then ``[DONE]``), and the server exits with an error naming the engine's exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with served(serve_command(str(text_model_dir()), port), url) as server:
        engine, outcomes = engine_pid(server.pid), []
        prompt_tokens = httpx.post(f"{url}/tokenize", json={"prompt": LONG["prompt"]}).json()["count"]
        with stopped(engine):
            threads = [in_flight(url, {**LONG, "stream": i % 2 == 0}, outcomes) for i in range(8)]
            wait_for(lambda: admitted_tokens(url) == 8 * prompt_tokens, 30)   # submitted, none answered
            os.kill(engine, signal.SIGKILL)
            killed = time.monotonic()
            wait_for(lambda: reachable_health(url) != 200, 1.0)
        for thread in threads:
            thread.join(5)
        assert time.monotonic() - killed < 5 and len(outcomes) == 8
        assert server.wait(timeout=20) != 0
        output = server.stdout.read()
    assert "the engine process exited (code -9); the server stopped" in output
    streams = [lines for status, lines in outcomes if status == 200]
    plain = [json.loads(lines[0]) for status, lines in outcomes if status != 200]
    assert len(streams) == len(plain) == 4
    for lines in streams:
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "the engine process exited" in error["message"]
        assert lines[-1] == "data: [DONE]"
    assert all(body["error"]["code"] == 503 and "the engine process exited" in body["error"]["message"]
               for body in plain)


@pytest.mark.slow
@pytest.mark.parametrize("to_group", [False, True], ids=["to the server", "to its process group"])
def test_sigterm_drains_for_the_grace_period_then_ends_what_is_left_and_exits(to_group):
    """A stream longer than the grace period and 16 short requests in flight at SIGTERM:
    the short ones finish, the stream ends with an error event and ``[DONE]`` once the
    grace period has passed, and the process exits a few seconds after it. So too when
    every process of the server's group gets the signal (systemd's default kill mode,
    ``timeout``): the engine leaves its ending to the server."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    launch = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_server_lifecycle as t; "
              f"t.serve_slowly({str(text_model_dir())!r}, {port})")
    with served([sys.executable, "-c", launch], url, own_group=to_group) as server:
        long_stream, short = [], []
        threads = [in_flight(url, {**LONG, "stream": True}, long_stream)]
        threads += [in_flight(url, {"prompt": f"q {i}", "max_tokens": 4}, short) for i in range(16)]
        wait_for(lambda: requests_seen(url) == 17, 30)
        if to_group:
            os.killpg(server.pid, signal.SIGTERM)
        else:
            server.send_signal(signal.SIGTERM)
        asked = time.monotonic()
        server.wait(timeout=GRACE_S + 15)
        exited = time.monotonic() - asked
        for thread in threads:
            thread.join(5)
    assert GRACE_S - 0.5 < exited < GRACE_S + 8
    assert [status for status, _ in short] == [200] * 16
    [(status, lines)] = long_stream
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert status == 200 and error["code"] == 503 and "shutting down" in error["message"]
    assert lines[-1] == "data: [DONE]"


@pytest.mark.parametrize("to_group, signum", [(True, signal.SIGINT), (False, signal.SIGTERM)],
                         ids=["ctrl-c", "sigterm"])
def test_a_server_stopped_while_its_engine_loads_exits_at_once_and_leaves_no_engine(to_group, signum):
    """Ctrl-C (to the process group) had hung until a second one: the exit waited on the
    engine, which ignores SIGINT and SIGTERM; SIGTERM had killed the server alone and left
    the engine loading. Meanwhile the port refuses connections: nothing is served yet."""
    port = free_port()
    launch = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_server_lifecycle as t; "
              f"t.serve_loading({str(text_model_dir())!r}, {port})")
    server = subprocess.Popen([sys.executable, "-c", launch], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)
    try:
        wait_for(lambda: Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split(), 30)
        time.sleep(3)   # the engine process is loading (for a minute)
        engine = engine_pid(server.pid)
        with pytest.raises(ConnectionRefusedError):   # not a connection left waiting for the engine
            socket.create_connection(("127.0.0.1", port), timeout=2)
        os.killpg(server.pid, signum) if to_group else server.send_signal(signum)
        server.wait(timeout=10)
        assert not Path(f"/proc/{engine}").exists() or Path(f"/proc/{engine}/stat").read_text().split()[2] == "Z"
    finally:
        server.kill()
        server.wait()


@pytest.mark.slow
def test_two_api_servers_refuse_a_new_connection_while_they_drain():
    """As one server does: before, the supervising process kept its copy of the listening
    socket open, so the kernel took a new connection that nobody answered until the drain
    ended (a fault probe found it)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    launch = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_server_lifecycle as t; "
              f"t.serve_slowly_twice({str(text_model_dir())!r}, {port})")
    with served([sys.executable, "-c", launch], url) as server:
        long_stream = []
        thread = in_flight(url, {**LONG, "stream": True}, long_stream)
        wait_for(lambda: requests_seen(url) == 1, 30)
        server.send_signal(signal.SIGTERM)
        time.sleep(1.0)   # the servers close their listeners as their drain starts
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=GRACE_S)
        server.wait(timeout=GRACE_S + 15)
        thread.join(5)
    [(status, lines)] = long_stream
    assert status == 200 and lines[-1] == "data: [DONE]"
