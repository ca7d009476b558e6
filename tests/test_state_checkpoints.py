"""State checkpoints (scheduling/state_checkpoints.py) over the engine loop, with a runner
whose state slots hold the tokens each has read, as a recurrent layer's state sums them
up, and whose every sampled token is a function of that whole history: a state resumed
from the wrong checkpoint, or a slot shared by two requests, changes the tokens after it.
Conversations replay earlier turns, so follow-ups resume kept states; small pools preempt
and evict; requests are aborted between steps. The tokens must be those of an engine that
keeps no states and computes every prompt whole."""

import types

from hypothesis import event, given, settings, strategies as st

from tokenspeed.backends.metadata import DecodeColumns, DecodeRow, decode_columns
from tokenspeed.engine.core import Engine
from tokenspeed.execution.sampling_params import SamplingParams
from tokenspeed.scheduling.block_allocator import BlockAllocator
from tokenspeed.scheduling.scheduler import Scheduler
from tokenspeed.scheduling.state_checkpoints import StateCheckpoints
from tokenspeed.testing.invariants import check_chained_rows_match_pages, check_status_matches_state

from test_scheduler import Future
from runner_stages import LaunchedInStages

VOCAB, MAX_MODEL_LEN, MAX_NUM_SEQS = 50, 400, 3


class Pools:
    """State slots as the tokens each has read (``StatePools.copy_slots``' contract)."""

    def __init__(self):
        self.slots: dict[int, tuple[int, ...]] = {}

    def copy_slots(self, copies) -> None:
        for source, destination in copies:
            self.slots[destination] = self.slots[source]


class StateRunner(LaunchedInStages):
    """A row at position p continues its seat's state, which must hold exactly p tokens (a
    run from position 0 starts afresh); a sampled row's token is a hash of its seat's state
    and its seed, the end of sequence (0) about one time in eight."""

    def __init__(self, pools: Pools):
        self.pools, self.column = pools, {}

    def columns(self, rows):
        return decode_columns(rows, MAX_MODEL_LEN, 1)

    def launch(self, batch, sampling, inputs=None) -> Future:
        read = [(seat, self._read(seat, start, tokens), samples) for seat, start, tokens, samples in self._runs(batch)]
        sampled = [(seat, state) for seat, state, samples in read if samples]
        tokens = [_token(state, s.seed) for (_, state), s in zip(sampled, sampling)]
        self.column.update((seat, token) for (seat, _), token in zip(sampled, tokens))
        return Future(tokens)

    def _runs(self, batch):
        """(seat, start, tokens, sampled) per request's run of rows; fed tokens from the column."""
        if isinstance(batch, DecodeColumns):
            return [(int(seat), int(position), (self.column[int(seat)],), True)
                    for seat, position in zip(batch.seats, batch.positions)]
        if batch and isinstance(batch[0], DecodeRow):
            return [(row.seat, row.position, (self.column[row.seat] if row.token is None else row.token,), True)
                    for row in batch]
        return [(c.seat, c.start, c.tokens + ((self.column[c.seat],) if c.fed else ()), c.completes)
                for c in batch]

    def _read(self, seat: int, start: int, tokens: tuple[int, ...]) -> tuple[int, ...]:
        state = () if start == 0 else self.pools.slots[seat]
        assert len(state) == start, f"seat {seat}: a row at {start} continues a state of {len(state)} tokens"
        self.pools.slots[seat] = state + tuple(tokens)
        return self.pools.slots[seat]


def _token(state: tuple[int, ...], seed: int) -> int:
    h = hash((seed, state)) % 2**32
    return 0 if h % 8 == 0 else 1 + h % (VOCAB - 1)


def engine(caching: bool, num_pages: int, page_size: int, budget: int, kept: int, overlap: bool) -> Engine:
    checkpoints = StateCheckpoints(1 + MAX_NUM_SEQS, kept) if caching else None
    scheduler = Scheduler(BlockAllocator(num_pages), page_size, MAX_NUM_SEQS, budget, caching,
                          recurrent=True, checkpoints=checkpoints)
    pools = Pools()
    runner = StateRunner(pools)
    config = types.SimpleNamespace(eos_token_ids=(0,), vocab_size=VOCAB)
    return Engine(scheduler, prefill=runner, decode=runner, model_config=config, max_model_len=MAX_MODEL_LEN,
                  overlap=overlap, states=pools if caching else None)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data(), page_size=st.sampled_from([1, 2, 4]), budget=st.integers(2, 24),
       kept=st.integers(1, 4), overlap=st.booleans(), num_pages=st.integers(12, 60))
def test_resumed_states_give_the_tokens_of_prompts_computed_whole(data, page_size, budget, kept, overlap,
                                                                  num_pages):
    """Each arrival is a new prompt, the same prompt as an earlier arrival, or the follow-up
    of an earlier turn (its prompt, its output and a few new tokens: it arrives once that
    turn has finished). A third run aborts requests between steps: the states stay whole
    and every checkpoint, page and seat returns."""
    arrivals = data.draw(st.lists(st.tuples(st.integers(0, 30), st.sampled_from(["new", "again", "follow-up"]),
                                            st.integers(1, 14), st.integers(1, 10), st.integers(1, 2)),
                                  min_size=1, max_size=8))
    aborts = data.draw(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 7)), min_size=1, max_size=2))
    whole = _conversations(engine(False, num_pages, page_size, budget, kept, overlap), arrivals, ())
    resumed = _conversations(engine(True, num_pages, page_size, budget, kept, overlap), arrivals, ())
    assert resumed == whole
    _conversations(engine(True, num_pages, page_size, budget, kept, overlap), arrivals, aborts)


def _conversations(eng: Engine, arrivals, aborts) -> dict:
    """Run ``arrivals`` (at, kind, length, max_tokens, n) to the end, ``aborts`` (step,
    arrival) between steps; each arrival's (prompt, output, finish reason) per sample."""
    by_arrival, num_pages = {}, eng.scheduler.allocator.num_pages
    for step in range(3_000):
        for i, (at, kind, length, max_tokens, n) in enumerate(arrivals):
            if i in by_arrival or at > step:
                continue
            prompt = tuple(range(1 + i, 1 + i + length))
            if kind == "again" and i:
                j = length % i
                prompt = tuple(range(1 + j, 1 + j + arrivals[j][2]))
            elif kind == "follow-up" and i:
                turn = by_arrival.get(length % i)
                if turn is None or not all(r.finished for r in turn):
                    continue   # arrives once its first turn has finished
                if turn:
                    prompt = turn[0].prompt + tuple(turn[0].output) + prompt
            too_long = -(-(len(prompt) + max_tokens) // eng.scheduler.page_size) >= num_pages
            by_arrival[i] = [] if too_long else eng.add(prompt, SamplingParams(n=n, max_tokens=max_tokens, seed=i))
        for at, index in aborts:
            for request in by_arrival.get(index, []) if at == step else []:
                eng.finish(request, "abort")
        if not eng.has_work and len(by_arrival) == len(arrivals):
            break
        if eng.has_work:
            eng.step()
        requests = [r for group in by_arrival.values() for r in group]
        check_chained_rows_match_pages(eng)
        check_status_matches_state(eng.scheduler, requests)
    assert not eng.has_work and eng.scheduler.allocator.num_free == num_pages - 1, "pages leaked"
    assert eng.scheduler.seats.num_free == MAX_NUM_SEQS
    checkpoints = eng.scheduler.checkpoints
    if checkpoints is not None:
        assert all(checkpoints.holders(c) == 0 for c in range(1, checkpoints.count + 1)), "a checkpoint is held"
    event(f"prompts resumed: {sum(r.num_cached_prompt_tokens > 0 for g in by_arrival.values() for r in g)}")
    return {i: [(r.prompt, r.output, r.finish_reason) for r in group] for i, group in by_arrival.items()}


def test_a_follow_up_resumes_at_the_last_page_its_first_turn_passed():
    """A 10-token prompt and 5 tokens out (14 computed) over pages of 4: the first turn's mark
    holds its state after 12 tokens; the follow-up computes from there, with the tokens of an
    engine that recomputes it whole."""
    outputs = {}
    for caching in (False, True):
        eng = engine(caching, 40, 4, 64, 2, overlap=True)
        first = eng.add(tuple(range(1, 11)), SamplingParams(max_tokens=5, ignore_eos=True, seed=1))[0]
        while eng.has_work:
            eng.step()
        follow = eng.add(first.prompt + tuple(first.output) + (7, 8), SamplingParams(max_tokens=5, seed=2))[0]
        while eng.has_work:
            eng.step()
        outputs[caching] = (first.output, follow.output)
        cached = follow.num_cached_prompt_tokens
    assert outputs[True] == outputs[False]
    assert cached == 12


def test_a_prompt_chunk_past_a_page_boundary_ends_at_the_last_it_passes():
    """With state checkpoints a 23-token prompt over pages of 4 and a budget of 16 runs as
    16 + 4 + 3 tokens: every boundary a chunk passes is one it ends at, or the prompt's end."""
    eng = engine(True, 40, 4, 16, 2, overlap=False)
    request = eng.add(tuple(range(1, 24)), SamplingParams(max_tokens=1, ignore_eos=True, seed=3))[0]
    chunks = []
    while eng.has_work:
        batch = eng.scheduler.schedule()
        chunks += [n for r, n in zip(batch.requests, batch.chunk_lens) if r is request]
        eng._postprocess(eng._launch(batch))
    assert chunks == [16, 4, 3]
