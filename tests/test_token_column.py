"""The token column under the overlap: over random workloads (prompts arriving mid-chain,
stops found a step late, aborts, preemption, prefix caching, a windowed cache group,
speculative windows), every row a launch feeds on the device reads exactly the token the
host later reads at that position, each request's output holds only tokens the host has
read (checked after every step), and the tokens are those of the loop without overlap.

The runners model the device: each sampled row writes its token into its request's seat of
a column, and a fed row reads its seat; a row's token depends on its input token, so a
row fed the wrong token changes what follows."""

import types

from hypothesis import given, settings, strategies as st

from tokenspeed.backends.metadata import DecodeColumns, decode_columns
from tokenspeed.scheduling.block_allocator import BlockAllocator
from tokenspeed.engine.core import Engine
from tokenspeed.scheduling.prompt_limits import check_request
from tokenspeed.execution.sampling_params import SamplingParams
from tokenspeed.scheduling.scheduler import Scheduler
from tokenspeed.engine.speculative import PerRequestDrafts
from tokenspeed.execution.token_column import NULL_SEAT
from tokenspeed.testing.invariants import check_chained_rows_match_pages, check_status_matches_state

from test_scheduler import Future
from runner_stages import LaunchedInStages

VOCAB, MAX_NUM_SEQS, MAX_MODEL_LEN = 50, 4, 200


def next_token(seed: int, position: int, token: int) -> int:
    """The model: a row's token from its stream, position and input token; the end of
    sequence (0) about one row in eight."""
    h = (seed * 2654435761 + position * 40503 + (token + 7) * 9973) % 2**32
    return 0 if h % 8 == 0 else 1 + h % (VOCAB - 1)


class ColumnRunner(LaunchedInStages):
    """Every runner of one engine over one column; records each fed row as (stream,
    position, token read) and each sampled row's token by (stream, position)."""

    def __init__(self, num_groups: int):
        self.num_groups, self.column = num_groups, [0] * (MAX_NUM_SEQS + 1)
        self.fed: list[tuple[int, int, int]] = []
        self.sampled: dict[tuple[int, int], int] = {}

    def columns(self, rows):
        return decode_columns(rows, MAX_MODEL_LEN, self.num_groups)

    def launch(self, rows, sampling, fed=None, masks=None) -> Future:
        """A decode or verify step's rows, or an extend batch's chunks."""
        if rows and not isinstance(rows, DecodeColumns) and hasattr(rows[0], "completes"):
            return self._extend(rows, sampling, fed)
        positions = rows.positions.tolist() if isinstance(rows, DecodeColumns) else [r.position for r in rows]
        if fed is None:
            inputs = rows.tokens.tolist() if isinstance(rows, DecodeColumns) else [r.token for r in rows]
        else:
            assert list(fed.rows) == list(range(len(rows))) and list(fed.seats) == [s.seat for s in sampling]
            inputs = [self._read(s.seed, p, s.seat) for s, p in zip(sampling, positions)]
        return Future([self._sample(s, p, t) for s, p, t in zip(sampling, positions, inputs)])

    def _extend(self, chunks, sampling, fed) -> Future:
        fed_rows = dict(zip(fed.rows, fed.seats)) if fed is not None else {}
        tokens, row, rows = [], 0, iter(sampling)
        for chunk in chunks:
            assert chunk.fed == (row + chunk.num_rows - 1 in fed_rows)
            last = row + chunk.num_rows - 1
            if chunk.completes:
                s = next(rows)
                position = chunk.start + chunk.num_rows - 1
                token = self._read(s.seed, position, fed_rows[last]) if chunk.fed else chunk.tokens[-1]
                tokens.append(self._sample(s, position, token))
            row = last + 1
        return Future(tokens)

    def _read(self, stream: int, position: int, seat: int) -> int:
        assert seat != NULL_SEAT, "a fed row reads the null seat"
        self.fed.append((stream, position, self.column[seat]))
        return self.column[seat]

    def _sample(self, s, position: int, token: int) -> int:
        new = next_token(s.seed, position, token)
        self.column[s.seat] = new
        self.sampled[s.seed, position] = new
        return new


class VerifyRunner(ColumnRunner):
    """Windows are read at once: a verify step writes no column."""

    def __init__(self, runner: ColumnRunner):
        super().__init__(runner.num_groups)
        self.sampled = runner.sampled

    def _sample(self, s, position: int, token: int) -> int:
        self.sampled[s.seed, position] = new = next_token(s.seed, position, token)
        return new


class TrueDrafts(PerRequestDrafts):
    """Drafts at half the token counts: the model's own tokens, except at every third."""

    def propose_many(self, requests, limits):
        return [self._draft(r, n) if n > 0 else () for r, n in zip(requests, limits)]

    def would_propose(self, request, limit):
        return min(2, limit) if request.num_known_tokens % 4 < 2 else 0

    def _draft(self, request, limit: int) -> tuple[int, ...]:
        tokens, draft = request.tokens, []
        for _ in range(self.would_propose(request, limit)):
            token = next_token(request.sampling.seed, len(tokens) - 1 + len(draft), (tokens + tuple(draft))[-1])
            draft.append(token if len(tokens) % 3 else (token + 1) % VOCAB)
        return tuple(draft)


def build(overlap: bool, page_size: int, window: int | None, prefix_caching: bool, admit_every: int,
          num_pages: int, speculative: bool):
    retentions = (0,) if window is None else (0, window)
    runner = ColumnRunner(len(retentions))
    scheduler = Scheduler(BlockAllocator(num_pages), page_size, MAX_NUM_SEQS, 12, prefix_caching, retentions)
    config = types.SimpleNamespace(eos_token_ids=(0,), vocab_size=VOCAB)
    engine = Engine(scheduler, prefill=runner, decode=runner, model_config=config, max_model_len=MAX_MODEL_LEN,
                    overlap=overlap, admit_every=admit_every, verify=VerifyRunner(runner) if speculative else None,
                    drafter=TrueDrafts() if speculative else None)
    return engine, runner


@settings(max_examples=40, deadline=None, derandomize=True)
@given(data=st.data(), page_size=st.sampled_from([1, 2, 4]), window=st.sampled_from([None, 3]),
       prefix_caching=st.booleans(), admit_every=st.sampled_from([1, 4]), num_pages=st.sampled_from([30, 200]),
       speculative=st.booleans())
def test_fed_rows_read_the_tokens_the_host_reads(data, page_size, window, prefix_caching, admit_every,
                                                 num_pages, speculative):
    plan = [(data.draw(st.integers(0, 8)), tuple(range(start, start + data.draw(st.integers(1, 9)))),
             SamplingParams(max_tokens=data.draw(st.integers(1, 16)), seed=i))
            for i, start in enumerate(data.draw(st.lists(st.sampled_from([1, 20]), min_size=1, max_size=7)))]
    aborts = data.draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 6)), max_size=2))

    def run(overlap: bool, aborts) -> tuple[list, ColumnRunner]:
        engine, runner = build(overlap, page_size, window, prefix_caching, admit_every, num_pages, speculative)
        requests, aborted = [], set()
        for step in range(2_000):
            requests += [r for at, prompt, params in plan if at == step and fits(engine, prompt, params)
                         for r in engine.add(prompt, params)]
            for at, index in aborts:
                if at == step and index < len(requests) and not requests[index].finished:
                    engine.finish(requests[index], "abort")
                    aborted.add(requests[index].sampling.seed)
            if not engine.has_work and step > 8:
                break
            if engine.has_work:
                engine.step()
            check_outputs_hold_read_tokens(requests, runner)
            check_chained_rows_match_pages(engine)
            check_status_matches_state(engine.scheduler, requests)
        assert not engine.has_work and engine.scheduler.allocator.num_free == num_pages - 1, "pages leaked"
        assert engine.scheduler.seats.num_free == MAX_NUM_SEQS, "seats leaked"
        check_fed_rows_read_the_hosts_tokens(requests, runner, aborted)
        return [(r.output, r.finish_reason) for r in requests], runner

    on, runner = run(True, ())
    off, _ = run(False, ())
    assert on == off
    run(True, aborts)


def fits(engine, prompt, params) -> bool:
    try:
        check_request(engine.limits, 0, prompt, params, has_tokenizer=False)
    except ValueError:
        return False
    return True


def check_outputs_hold_read_tokens(requests, runner: ColumnRunner) -> None:
    """Each output token is the one sampled at its position, and the tokens sampled past
    the output are counted as unread (a finished request's dropped rows aside)."""
    for request in requests:
        stream, start = request.sampling.seed, len(request.prompt) - 1
        sampled = [runner.sampled.get((stream, start + i)) for i in range(len(request.output))]
        assert request.output == sampled, (request.id, request.output, sampled)
        if not request.finished:
            ahead = sum((stream, start + len(request.output) + i) in runner.sampled for i in range(3))
            assert request.num_unread <= ahead, (request.id, request.num_unread, ahead)


def check_fed_rows_read_the_hosts_tokens(requests, runner: ColumnRunner, aborted: set) -> None:
    """Every fed row (stream, position, token read) read the token the host holds at that
    position (an aborted request's rows past its output aside)."""
    by_stream = {r.sampling.seed: r for r in requests}
    for stream, position, token in runner.fed:
        tokens = by_stream[stream].prompt + tuple(by_stream[stream].output)
        assert tokens[position] == token if position < len(tokens) else stream in aborted, \
            (by_stream[stream].id, position, token, tokens)
