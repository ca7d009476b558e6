"""The engine loop over runners that only count rows: every workload the checks admit runs
to the end under any pool size, with samples sharing prompt pages and preemption, and
every page comes back."""

import types

import pytest
from hypothesis import given, settings, strategies as st

from tokenspeed.backends.metadata import DecodeColumns, DecodeRow, decode_columns
from tokenspeed.engine.core import Engine
from tokenspeed.scheduling.block_allocator import BlockAllocator
from tokenspeed.scheduling.prompt_limits import check_request, most_pages_held
from tokenspeed.execution.sampling_params import MAX_N, SamplingParams
from tokenspeed.scheduling.scheduler import Scheduler
from tokenspeed.testing.invariants import check_chained_rows_match_pages, check_status_matches_state
from runner_stages import LaunchedInStages

VOCAB = 100
MAX_MODEL_LEN = 1000
MAX_PAGES = MAX_MODEL_LEN      # pages of one token at the most


class Future:
    def __init__(self, tokens: list[int]):
        self._tokens = tokens

    def tokens(self) -> list[int]:
        return list(self._tokens)

    def logprobs(self) -> list:
        return [None] * len(self._tokens)

    def on_device(self, rows=None):
        return None      # these runners read no input tokens


class CountingRunner(LaunchedInStages):
    """Samples token 5 for every row."""

    def __init__(self, num_groups: int = 1):
        self.num_groups = num_groups

    def columns(self, rows):
        return decode_columns(rows, MAX_PAGES, self.num_groups)

    def launch(self, batch, sampling, inputs=None) -> Future:
        return Future([5] * len(sampling))


class KeyedRunner(CountingRunner):
    """Samples a token keyed by the row's seed and input position, the end of sequence (0)
    about one row in six: requests stop part-way through a chain, whatever the batches."""

    def launch(self, batch, sampling, inputs=None) -> Future:
        if isinstance(batch, DecodeColumns):
            positions = batch.positions.tolist()
        elif batch and isinstance(batch[0], DecodeRow):
            positions = [row.position for row in batch]
        else:      # extend chunks: the last row of each completing one is sampled
            positions = [c.start + c.num_rows - 1 for c in batch if c.completes]
        return Future([keyed_token(s.seed, p) for s, p in zip(sampling, positions)])


def keyed_token(seed: int, position: int) -> int:
    h = (seed * 2654435761 + (position + 1) * 40503) % 2**32
    return 0 if h % 6 == 0 else 1 + h % (VOCAB - 1)


def sampled_outputs(request) -> list[int]:
    """The tokens ``KeyedRunner`` samples for ``request``'s output as far as it goes."""
    return [keyed_token(request.sampling.seed, len(request.prompt) + i - 1) for i in range(len(request.output))]


def engine(num_pages: int, page_size: int, max_num_seqs: int, budget: int, overlap: bool,
           prefix_caching: bool = False, retentions: tuple[int, ...] = (0,), runner=CountingRunner,
           admit_every: int = 4) -> Engine:
    scheduler = Scheduler(BlockAllocator(num_pages), page_size, max_num_seqs, budget, prefix_caching, retentions)
    runner = runner(len(retentions))
    config = types.SimpleNamespace(eos_token_ids=(0,), vocab_size=VOCAB)
    return Engine(scheduler, prefill=runner, decode=runner, model_config=config, max_model_len=MAX_MODEL_LEN,
                  overlap=overlap, admit_every=admit_every)


def test_a_waiting_sample_does_not_keep_pages_it_could_not_use():
    """4 usable pages: a sample that attaches its prompt's pages but then cannot grow must
    let them go, or the request ahead of it never fits (it used to end in RuntimeError)."""
    eng = engine(5, 4, 8, 64, overlap=False)
    first = eng.add(tuple(range(1, 5)), SamplingParams(max_tokens=12, ignore_eos=True, seed=1))
    pair = eng.add(tuple(range(1, 10)), SamplingParams(n=2, max_tokens=3, ignore_eos=True, seed=2))
    while eng.has_work:
        eng.step()
    assert [len(r.output) for r in first + pair] == [12, 3, 3]
    assert eng.scheduler.allocator.num_free == 4


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data(), page_size=st.sampled_from([1, 2, 4]), overlap=st.booleans(),
       max_num_seqs=st.integers(1, 6), budget=st.integers(1, 32), prefix_caching=st.booleans(),
       window=st.sampled_from([None, 3, 6]))
def test_every_admitted_workload_finishes_and_returns_every_page(data, page_size, overlap,
                                                                 max_num_seqs, budget, prefix_caching, window):
    """Prompts start alike (one of two prefixes) so that caching finds pages to share;
    ``window``: a second cache group, windowed. After every step, a chained decode step's
    rows match its requests' pages, and no output holds a stand-in (callers read outputs
    between steps)."""
    num_pages = data.draw(st.integers(2, 24))
    retentions = (0,) if window is None else (0, window)
    eng = engine(num_pages, page_size, max_num_seqs, budget, overlap, prefix_caching, retentions)
    requests = []
    for i in range(data.draw(st.integers(1, 6))):
        start = data.draw(st.sampled_from([1, 50]))
        prompt = tuple(range(start, start + data.draw(st.integers(1, 12))))
        params = SamplingParams(n=data.draw(st.integers(1, 3)), max_tokens=data.draw(st.integers(1, 8)),
                                ignore_eos=True, seed=i)
        try:
            check_request(eng.limits, i, prompt, params, has_tokenizer=False)
        except ValueError:
            continue
        requests += eng.add(prompt, params)
    for _ in range(10_000):
        if not eng.has_work:
            break
        eng.step()
        check_chained_rows_match_pages(eng)
        check_status_matches_state(eng.scheduler, requests)
        assert all(set(r.output) <= {5} for r in eng.scheduler.running), "an output holds a token no step sampled"
        running = eng.scheduler.running
        held = [p for r in running for p in r.pages]
        assert 0 not in held
        for page in set(held):   # every holder is counted, and only held pages are
            assert eng.scheduler.allocator.holders(page) == held.count(page)
        for r in running:        # a page written by two requests holds one content only
            writable = r.pages[r.num_cached // page_size:]
            assert all(eng.scheduler.allocator.holders(p) == 1 for p in writable)
        assert all(not r.pages for r in eng.scheduler.waiting)  # waiting holds no pages
    assert not eng.has_work
    assert all(r.finish_reason == "length" and len(r.output) == r.params.max_tokens for r in requests)
    assert eng.scheduler.allocator.num_free == num_pages - 1


@settings(max_examples=40, deadline=None, derandomize=True)
@given(data=st.data(), page_size=st.sampled_from([1, 2, 4]), window=st.sampled_from([None, 3]),
       prefix_caching=st.booleans(), admit_every=st.sampled_from([1, 4]))
def test_requests_stopping_or_aborted_mid_chain_keep_the_synchronous_tokens(data, page_size, window,
                                                                            prefix_caching, admit_every):
    """Requests that stop on a token part-way through a chain (found a step late), arrive
    while it runs, or are aborted between steps while a step is unread: the overlapped
    loop's tokens are the synchronous loop's, the chained rows match the requests' pages
    after every step, no stand-in is visible between steps, and every page returns."""
    retentions = (0,) if window is None else (0, window)
    plan = [(data.draw(st.integers(0, 6)), tuple(range(start, start + data.draw(st.integers(1, 9)))),
             SamplingParams(n=data.draw(st.integers(1, 2)), max_tokens=data.draw(st.integers(1, 20)), seed=i))
            for i, start in enumerate(data.draw(st.lists(st.sampled_from([1, 30]), min_size=1, max_size=6)))]
    aborts = data.draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 11)), max_size=3))

    def run(overlap: bool, aborts) -> list:
        eng = engine(80, page_size, 4, 16, overlap, prefix_caching, retentions, KeyedRunner, admit_every)
        requests = []
        for step in range(2_000):
            requests += [r for at, prompt, params in plan if at == step for r in eng.add(prompt, params)]
            for at, index in aborts:
                if at == step and index < len(requests):
                    eng.finish(requests[index], "abort")
            if not eng.has_work and step > 6:
                break
            if eng.has_work:
                eng.step()
            check_chained_rows_match_pages(eng)
            check_status_matches_state(eng.scheduler, requests)
            assert all(r.output == sampled_outputs(r) for r in requests), "an output holds a token no step sampled"
        assert not eng.has_work and eng.scheduler.allocator.num_free == 79, "pages leaked"
        return [(r.output, r.finish_reason) for r in requests]

    assert run(True, ()) == run(False, ())
    run(True, aborts)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 40), min_size=2, max_size=8), budget=st.integers(2, 16))
def test_a_long_prompt_never_stalls_the_requests_already_generating(lengths, budget):
    """Every step with prompt work carries every request ready to decode (while they need
    at most half the token budget, and the pool is ample)."""
    eng = engine(400, 4, 8, budget, overlap=False)
    for i, n in enumerate(lengths):
        eng.add(tuple(range(1, n + 1)), SamplingParams(max_tokens=6, ignore_eos=True, seed=i))
    schedule, extends_with_decodes = eng.scheduler.schedule, []

    def checked():
        ready = {id(r) for r in eng.scheduler.running if r.num_uncached == 1}
        batch = schedule()
        if batch.kind == "extend" and ready and len(ready) <= budget // 2:
            assert ready <= {id(r) for r in batch.requests}
            extends_with_decodes.append(batch)
        return batch
    eng.scheduler.schedule = checked
    while eng.has_work:
        eng.step()
    assert all(sum(b.chunk_lens) <= budget for b in extends_with_decodes)


def test_a_readmitted_sample_shares_only_its_prompts_pages():
    """Without prefix caching a preempted sample takes its sibling's pages again: those of
    the prompt only, since past it the two samples' tokens (and so their keys) differ."""
    eng = engine(40, 4, 8, 64, overlap=False)
    first, second = eng.add(tuple(range(1, 9)), SamplingParams(n=2, max_tokens=20, ignore_eos=True, seed=1))
    while len(second.output) < 12:
        eng.step()
    eng.scheduler._preempt(second)
    eng.scheduler._attach_shared_pages(second)
    assert 0 < len(second.pages) <= len(second.prompt) // 4 and second.num_cached == 8
    assert second.pages == first.pages[:len(second.pages)]


@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
       output=st.lists(st.integers(0, VOCAB - 1), max_size=12), data=st.data())
def test_a_requests_token_slices_equal_slices_of_its_tokens(prompt, output, data):
    """``tokens_between`` (the engine's chunks, built without joining prompt and output)."""
    from tokenspeed.scheduling.request import Request
    request = Request(0, tuple(prompt), SamplingParams(), 0, output=list(output))
    end = data.draw(st.integers(0, request.num_tokens))
    start = data.draw(st.integers(0, end))
    assert request.tokens_between(start, end) == request.tokens[start:end]


@pytest.mark.parametrize("prefix_caching, window, overlap", [(False, None, True), (True, None, False),
                                                             (False, 3, True), (True, 6, True)])
def test_the_largest_request_takes_turns_in_a_pool_of_one_samples_pages(prefix_caching, window, overlap):
    """``n`` at its cap, each sample needing every page the check allows: the samples take
    turns in the pool (a later one shares the first's prompt pages while it runs; the newest
    gives way when pages run out), each drawing the tokens it draws in a pool that holds all
    of them, and every page comes back. One page fewer and the check refuses the request."""
    retentions = (0,) if window is None else (0, window)
    prompt, params = tuple(range(1, 11)), SamplingParams(n=MAX_N, max_tokens=14, ignore_eos=True, seed=9)

    def run(num_pages: int) -> list:
        eng = engine(num_pages, 4, 8, 8, overlap, prefix_caching, retentions, KeyedRunner)
        check_request(eng.limits, 0, prompt, params, has_tokenizer=False)
        requests = eng.add(prompt, params)
        while eng.has_work:
            eng.step()
        assert eng.scheduler.allocator.num_free == num_pages - 1
        return [r.output for r in requests]

    fitting = engine(10_000, 4, 8, 8, overlap, prefix_caching, retentions).limits
    pages = sum(most_pages_held(len(prompt) + params.max_tokens, 4, r, fitting.max_chunk) for r in retentions)
    outputs = run(pages + 1)                # the null page, and one sample's pages
    assert outputs == run(MAX_N * pages + 1) and all(len(o) == params.max_tokens for o in outputs)
    with pytest.raises(ValueError, match=f"needs {pages} KV pages at once, the pool has {pages - 1}"):
        check_request(engine(pages, 4, 8, 8, overlap, prefix_caching, retentions).limits, 0, prompt, params,
                      has_tokenizer=False)
