"""The sampler: greedy is argmax, top-k / top-p / min-p restrict the support, penalties
and min_tokens act as OpenAI and Hugging Face define them, keyed noise reproduces."""

import math

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

import tokenspeed as ts
from tokenspeed.errors import RefusedRequest
from tokenspeed.execution.sample_streams import stream_key
from tokenspeed.execution.sampler import RowSampling, SamplingTensors, sample
from tokenspeed.execution.sampling_params import MAX_N

FAST = settings(max_examples=40, deadline=None, derandomize=True)


def sampled(logits, params, rows=None, seed=0, positions=None, **row_fields):
    """Sample every row of ``logits``; row i draws with seed ``seed * 1000003 + i``."""
    params = list(params) if rows is None else [params] * rows
    sampling = [RowSampling(p, seed * 1000003 + i, **row_fields) for i, p in enumerate(params)]
    positions = torch.zeros(len(params), dtype=torch.int64) if positions is None else positions
    return sample(logits, sampling, positions).tokens


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# Logits with many exact ties: values drawn from a small set of levels.
_levels = st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.0, 2.0, 7.25, -float("inf")])


@st.composite
def logits_batches(draw, tie_heavy=False):
    rows = draw(st.integers(1, 6))
    vocab = draw(st.integers(1, 70))
    if tie_heavy:
        vals = draw(st.lists(_levels, min_size=rows * vocab, max_size=rows * vocab))
    else:
        vals = draw(st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32),
                             min_size=rows * vocab, max_size=rows * vocab))
    x = torch.tensor(vals, dtype=torch.float32).view(rows, vocab)
    # every row needs one finite logit
    x[:, draw(st.integers(0, vocab - 1))] = draw(st.floats(-100, 100, width=32))
    return x


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum of each row, computed without torch.argmax."""
    best = x.max(dim=-1, keepdim=True).values
    idx = torch.arange(x.shape[-1]).expand_as(x)
    return torch.where(x == best, idx, x.shape[-1]).min(dim=-1).values


# ---------------------------------------------------------------- greedy


@FAST
@given(logits=logits_batches(), seed=st.integers(0, 2**31 - 1))
def test_greedy_top_k_1_is_argmax(logits, seed):
    for params in (ts.SamplingParams(temperature=0), ts.SamplingParams(top_k=1),
                   ts.SamplingParams(top_k=1, temperature=0.7, top_p=0.3)):
        got = sampled(logits, params, logits.shape[0], seed=seed)
        assert torch.equal(got, first_argmax(logits)), params


@FAST
@given(logits=logits_batches(tie_heavy=True), seed=st.integers(0, 2**31 - 1))
def test_greedy_ties_pick_the_first_index(logits, seed):
    got = sampled(logits, ts.SamplingParams(temperature=0), logits.shape[0], seed=seed)
    assert torch.equal(got, first_argmax(logits))


def test_greedy_explicit_ties():
    logits = torch.tensor([[1.0, 5.0, 5.0, 2.0], [9.0, 9.0, 9.0, 9.0], [0.0, -1.0, 3.0, 3.0]])
    for seed in range(5):
        got = sampled(logits, ts.SamplingParams(temperature=0), 3, seed=seed)
        assert got.tolist() == [1, 0, 2]


def test_temperature_zero_normalises_to_top_k_1():
    p = ts.SamplingParams(temperature=0, top_k=50, top_p=0.5)
    assert p.top_k == 1 and p.greedy
    assert ts.SamplingParams(temperature=0).top_k == 1
    assert not ts.SamplingParams(temperature=0.5).greedy
    assert ts.SamplingParams(temperature=0.5).top_k == 0
    assert ts.SamplingParams(temperature=1.0, top_k=1).greedy


@pytest.mark.parametrize("temperature", [0.0, 1e-6, 9.9e-6])
def test_a_temperature_below_vllms_epsilon_is_greedy(temperature):
    """vLLM decodes a temperature below 1e-5 greedily: argmax, first index on ties, whatever
    the seed (clients send such values to ask for greedy decoding)."""
    logits = torch.tensor([[3.0, 3.0, 1.0], [2.0, 2.0 + 1e-6, 0.0]])
    params = ts.SamplingParams(temperature=temperature)
    assert params.greedy
    assert all(sampled(logits, params, 2, seed=seed).tolist() == [0, 1] for seed in range(32))
    assert not ts.SamplingParams(temperature=1e-5).greedy


def test_mixed_rows_greedy_rows_stay_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    params = [ts.SamplingParams(temperature=0) if i % 2 else ts.SamplingParams(temperature=1.5)
              for i in range(8)]
    for seed in range(10):
        got = sampled(logits, params, seed=seed)
        assert torch.equal(got[1::2], logits[1::2].argmax(-1))


# ---------------------------------------------------------------- top-k / top-p


@FAST
@given(data=st.data())
def test_top_k_samples_only_among_the_k_largest(data):
    vocab = data.draw(st.integers(2, 64))
    rows = data.draw(st.integers(1, 4))
    k = data.draw(st.integers(1, vocab))
    seed = data.draw(st.integers(0, 2**31 - 1))
    # distinct values so "the k largest" is unambiguous
    perm = torch.randperm(vocab, generator=gen(seed))
    logits = torch.stack([perm.roll(r).float() * 0.05 for r in range(rows)])  # near-flat
    temperature = data.draw(st.sampled_from([0.5, 1.0, 3.0]))
    params = ts.SamplingParams(temperature=temperature, top_k=k)
    allowed = logits.topk(k, dim=-1).indices
    reps = 40
    draws = sampled(logits.repeat(reps, 1), params, rows * reps, seed=seed).view(reps, rows)
    for r in range(rows):
        assert set(draws[:, r].tolist()) <= set(allowed[r].tolist())
    if k > 1:  # with flat logits more than one of the k shows up
        assert any(len(set(draws[:, r].tolist())) > 1 for r in range(rows))


def test_top_k_larger_than_vocab_is_no_restriction():
    logits = torch.zeros(1, 5)
    draws = {int(sampled(logits, ts.SamplingParams(top_k=100), 1, seed=s)) for s in range(200)}
    assert draws == set(range(5))


def nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """The smallest set of most-likely tokens whose mass reaches top_p, and every token as
    likely as its last (which of tied tokens sorts first is the sort's choice)."""
    order = probs.argsort(descending=True).tolist()
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += float(probs[i])
        if mass >= top_p:
            break
    last = min(float(probs[i]) for i in kept)
    return kept | {i for i in order if abs(float(probs[i]) - last) <= 1e-6 * last}


@FAST
@given(data=st.data())
def test_top_p_restricts_to_the_nucleus(data):
    vocab = data.draw(st.integers(2, 40))
    vals = data.draw(st.lists(st.floats(-4, 4, width=32), min_size=vocab, max_size=vocab,
                              unique=True))
    logits = torch.tensor([vals])
    temperature = data.draw(st.sampled_from([0.7, 1.0, 2.0]))
    top_p = data.draw(st.floats(0.05, 0.99))
    probs = (logits[0] / temperature).softmax(-1).double()
    # keep clear of the boundary, where rounding decides membership
    cum = probs.sort(descending=True).values.cumsum(0)
    assume(float((cum - top_p).abs().min()) > 1e-4)
    allowed = nucleus(probs, top_p)
    params = ts.SamplingParams(temperature=temperature, top_p=top_p)
    seed = data.draw(st.integers(0, 2**31 - 1))
    draws = set(sampled(logits.expand(60, -1).contiguous(), params, 60, seed=seed).tolist())
    assert draws <= allowed, (draws - allowed, sorted(allowed))
    # the most likely token is always in the nucleus
    assert int(probs.argmax()) in allowed


def test_top_p_explicit_nucleus():
    probs = torch.tensor([0.05, 0.5, 0.3, 0.15])
    logits = probs.log()[None].expand(4000, -1).contiguous()
    draws = sampled(logits, ts.SamplingParams(top_p=0.7), 4000, seed=3)
    assert set(draws.tolist()) == {1, 2}          # 0.5 + 0.3 >= 0.7
    draws = sampled(logits, ts.SamplingParams(top_p=0.85), 4000, seed=3)
    assert set(draws.tolist()) == {1, 2, 3}
    draws = sampled(logits, ts.SamplingParams(top_p=0.4), 4000, seed=3)
    assert set(draws.tolist()) == {1}


def test_top_p_exact_boundary_keeps_the_smallest_nucleus():
    # two equally likely tokens, p = 0.5 each: the first alone already has mass 0.5
    logits = torch.zeros(2000, 2)
    draws = sampled(logits, ts.SamplingParams(top_p=0.5), 2000, seed=0)
    assert len(set(draws.tolist())) == 1


def test_top_k_and_top_p_combine():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log()[None].expand(3000, -1).contiguous()
    # top_k=3 renormalises to 4/9, 3/9, 2/9; top_p=0.7 then keeps {0, 1}
    draws = sampled(logits, ts.SamplingParams(top_k=3, top_p=0.7), 3000, seed=1)
    assert set(draws.tolist()) == {0, 1}


def test_sampling_follows_softmax_with_temperature():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0])
    n = 40000
    for temperature in (0.5, 1.0, 2.0):
        draws = sampled(logits[None].expand(n, -1).contiguous(),
                        ts.SamplingParams(temperature=temperature), n, seed=7)
        freq = torch.bincount(draws, minlength=4).double() / n
        expected = (logits.double() / temperature).softmax(-1)
        # 5 standard deviations of a binomial proportion
        tol = 5 * torch.sqrt(expected * (1 - expected) / n)
        assert torch.all((freq - expected).abs() <= tol), (temperature, freq, expected)


# ---------------------------------------------------------------- reproducibility


def test_noise_is_keyed_by_seed_and_position():
    """A row's draw depends on its seed and position only: not on its batch or its row."""
    torch.manual_seed(0)
    logits = torch.randn(16, 100)
    params = ts.SamplingParams(temperature=1.0, top_p=0.9, top_k=20)
    rows = [RowSampling(params, seed) for seed in range(16)]
    positions = torch.arange(16) * 7
    a = sample(logits, rows, positions).tokens
    assert torch.equal(a, sample(logits, rows, positions).tokens)
    flipped = sample(logits.flip(0), rows[::-1], positions.flip(0)).tokens
    assert torch.equal(flipped.flip(0), a)                       # any batch order
    alone = [int(sample(logits[i:i + 1], rows[i:i + 1], positions[i:i + 1]).tokens) for i in range(3)]
    assert alone == a[:3].tolist()                                # any batch size
    moved = sample(logits, rows, positions + 1).tokens
    reseeded = sample(logits, [RowSampling(params, seed + 100) for seed in range(16)], positions).tokens
    assert not torch.equal(a, moved) and not torch.equal(a, reseeded)


def test_a_sampled_row_draws_alike_beside_greedy_rows_and_greedy_rows_draw_no_noise(monkeypatch):
    """The reference draws noise only for the rows that sample (a greedy row's is unused): a
    sampled row's token is the one it draws alone, and a batch of greedy rows draws none."""
    from tokenspeed.execution import sampler
    torch.manual_seed(2)
    logits, positions = torch.randn(6, 40), torch.arange(6) * 3
    rows = [RowSampling(ts.SamplingParams(temperature=0 if i % 3 else 1.3), 50 + i) for i in range(6)]
    draws = []
    uniform = sampler._uniform
    monkeypatch.setattr(sampler, "_uniform", lambda key, size: draws.append(key) or uniform(key, size))
    tokens = sample(logits, rows, positions).tokens
    assert len(draws) == 2
    alone = [int(sample(logits[i:i + 1], rows[i:i + 1], positions[i:i + 1]).tokens) for i in (0, 3)]
    assert tokens[[0, 3]].tolist() == alone
    assert torch.equal(tokens[[1, 2, 4, 5]], logits[[1, 2, 4, 5]].argmax(-1))
    draws.clear()
    greedy = [RowSampling(ts.SamplingParams(temperature=0), i) for i in range(6)]
    assert torch.equal(sample(logits, greedy, positions).tokens, logits.argmax(-1)) and draws == []


def test_sample_returns_one_index_per_row_in_range():
    torch.manual_seed(1)
    logits = torch.randn(5, 33)
    out = sampled(logits, ts.SamplingParams(), 5, seed=0)
    assert out.shape == (5,) and out.dtype == torch.int64
    assert int(out.min()) >= 0 and int(out.max()) < 33


def test_sampling_tensors_build():
    params = [ts.SamplingParams(temperature=0.5, top_k=3, top_p=0.9), ts.SamplingParams(temperature=0)]
    s = SamplingTensors.build([RowSampling(p, seed) for p, seed in zip(params, (11, 12))], "cpu")
    assert s.temperature.tolist() == [0.5, 0.0]
    assert s.top_k.tolist() == [3, 1]
    assert s.seed.tolist() == [11, 12]


# ---------------------------------------------------------------- min-p, penalties, min_tokens, logprobs


def test_min_p_drops_tokens_below_its_share_of_the_best():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])
    logits = probs.log()[None].expand(3000, -1).contiguous()
    draws = sampled(logits, ts.SamplingParams(min_p=0.2), 3000, seed=2)   # keeps p >= 0.1
    assert set(draws.tolist()) == {0, 1, 2}


def test_repetition_penalty_is_hugging_faces():
    """HF: a seen token's logit is divided by the penalty if positive, else multiplied."""
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.1]])
    params = ts.SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sampled(logits, params, 1, prompt=(0,)).tolist() == [1]    # 2.0 -> 1.0 < 1.9
    assert sampled(logits, ts.SamplingParams(temperature=0), 1, prompt=(0,)).tolist() == [0]
    flat = torch.tensor([[-1.0, -1.1, -5.0]])
    assert sampled(flat, params, 1, output=[0]).tolist() == [1]        # -1.0 -> -2.0 < -1.1


def test_presence_and_frequency_penalties_are_openais():
    """OpenAI: logit -= frequency * count + presence * (count > 0), over generated tokens."""
    logits = torch.tensor([[3.0, 2.5, 1.0]])
    output = [0, 0, 1]
    greedy = dict(temperature=0)
    assert sampled(logits, ts.SamplingParams(**greedy, frequency_penalty=0.6), 1,
                   output=output).tolist() == [1]                     # 1.8, 1.9, 1.0
    assert sampled(logits, ts.SamplingParams(**greedy, presence_penalty=0.9), 1,
                   output=output).tolist() == [0]                     # 2.1, 1.6, 1.0
    assert sampled(logits, ts.SamplingParams(**greedy, presence_penalty=1.5, frequency_penalty=0.3),
                   1, output=output).tolist() == [2]                  # 0.9, 0.7, 1.0
    assert sampled(torch.tensor([[3.0, 2.9]]), ts.SamplingParams(**greedy, presence_penalty=2.0), 1,
                   prompt=(0,)).tolist() == [0]                       # the prompt is not counted


def test_min_tokens_masks_the_stop_ids_until_reached():
    logits = torch.tensor([[5.0, 1.0, 0.5]])
    params = ts.SamplingParams(temperature=0, min_tokens=2)
    assert sampled(logits, params, 1, output=[2], stop_ids=(0,)).tolist() == [1]
    assert sampled(logits, params, 1, output=[2, 1], stop_ids=(0,)).tolist() == [0]


def test_logprobs_are_the_models_and_name_the_sampled_token():
    torch.manual_seed(3)
    logits = torch.randn(3, 20)
    rows = [RowSampling(ts.SamplingParams(temperature=0.8, logprobs=k), i) for i, k in enumerate((0, 2, 5))]
    result = sample(logits, rows, torch.zeros(3, dtype=torch.int64))
    host = result.logprobs.to_host(rows, result.tokens.tolist())
    expected = logits.log_softmax(-1)
    for row, (lp, token) in enumerate(zip(host, result.tokens.tolist())):
        assert lp.token_id == token and math.isclose(lp.logprob, float(expected[row, token]), rel_tol=1e-5)
        k = rows[row].params.logprobs
        assert list(lp.top)[:k] == expected[row].topk(k).indices.tolist()
        assert lp.top[token] == lp.logprob and len(lp.top) == k + (token not in list(lp.top)[:k])
    assert len(host[0].top) == 1   # logprobs=0: the sampled token's entry alone


@FAST
@given(k=st.integers(0, 20), seed=st.integers(0, 2**31 - 1))
def test_the_sampled_token_is_always_among_the_top_logprobs(k, seed):
    """At a high temperature the sampled token is often not among the k most likely: its
    entry follows theirs (k + 1 entries), so the top entries stay best first, and its rank
    is still its rank in the vocabulary (as vLLM's ``Logprob.rank``: 1 + the tokens more
    likely)."""
    logits = torch.randn(30, 40, generator=gen(seed))
    rows = [RowSampling(ts.SamplingParams(temperature=1.8, logprobs=k), seed + i) for i in range(30)]
    result = sample(logits, rows, torch.arange(30))
    expected = logits.log_softmax(-1)
    for row, (lp, token) in enumerate(zip(result.logprobs.to_host(rows, result.tokens.tolist()),
                                          result.tokens.tolist())):
        assert token in lp.top and math.isclose(lp.top[token], float(expected[row, token]), rel_tol=1e-5)
        assert list(lp.top)[:k] == expected[row].topk(k).indices.tolist()
        assert len(lp.top) in (k, k + 1) and list(lp.top.values()) == sorted(lp.top.values(), reverse=True)
        assert lp[token].rank == int((expected[row] > expected[row, token]).sum()) + 1


def test_a_row_that_needs_no_processing_draws_alike_on_both_routes():
    """Greedy and plain-temperature rows get the same token whether or not another row in
    the batch sends it through the processed route (top-p here)."""
    torch.manual_seed(4)
    logits = torch.randn(4, 50)
    plain = [RowSampling(ts.SamplingParams(temperature=t), i) for i, t in enumerate((0.0, 0.7, 1.3, 1.0))]
    mixed = plain[:3] + [RowSampling(ts.SamplingParams(top_p=0.5), 3)]
    positions = torch.arange(4)
    assert sample(logits, plain, positions).tokens[:3].tolist() == \
        sample(logits, mixed, positions).tokens[:3].tolist()


# ---------------------------------------------------------------- through the LLM


@pytest.fixture(scope="module")
def llama_path():
    from hf_models import checkpoint
    return checkpoint("llama")


def _params(**params) -> ts.SamplingParams:
    return ts.SamplingParams(**{"temperature": 1.0, "max_tokens": 10, "ignore_eos": True, **params})


def _sampled(llm, prompts, **params):
    return [o.token_ids for o in llm.generate(prompts, _params(**params))]


def test_llm_seed_makes_sampling_reproducible(llama_path):
    prompts = [[5, 6, 7], [9] * 12, [100, 200]]
    a = _sampled(ts.LLM(llama_path, page_size=4, seed=4), prompts)
    b = _sampled(ts.LLM(llama_path, page_size=4, seed=4), prompts)
    c = _sampled(ts.LLM(llama_path, page_size=4, seed=5), prompts)
    assert a == b
    assert a != c
    assert all(len(t) == 10 for t in a)


def test_sibling_samples_share_no_tokens_with_a_neighbouring_seed(llama_path):
    """``seed=77, n=2``'s second sample is not ``seed=78``'s first (they were one stream);
    seeds 2**62 apart are not one either; each sample reproduces whatever shares its batch."""
    llm = ts.LLM(llama_path, page_size=4)
    prompt = [5, 6, 7]
    pair = [o.token_ids for o in llm.generate([prompt], _params(n=2, seed=77))[0].outputs]
    [next_seed] = _sampled(llm, [prompt], seed=78)
    [far_seed] = _sampled(llm, [prompt], seed=77 + 2**62)
    assert pair[1] != next_seed and pair[0] != far_seed and pair[0] != pair[1]
    batch = llm.generate([[9] * 12, prompt, [100, 200]], [_params(), _params(n=2, seed=77), _params(seed=3)])
    assert [o.token_ids for o in batch[1].outputs] == pair


def test_a_top_p_below_float32s_range_gives_the_greedy_tokens(llama_path):
    llm = ts.LLM(llama_path, page_size=4)
    prompts = [[5, 6, 7], [9] * 12]
    assert _sampled(llm, prompts, top_p=1e-50, seed=1) == \
        [o.token_ids for o in llm.generate(prompts, _params(temperature=0.0))]


def test_llm_top_k_restricts_every_sampled_token(llama_path):
    """top_k=2 through the engine: each token is one of the 2 most likely next tokens,
    checked against the HF model's logits for the sequence so far."""
    from hf_models import hf_model, reference
    hf, _ = hf_model("llama")
    prompt = [5, 6, 7, 8]
    out = _sampled(ts.LLM(llama_path, page_size=4, seed=1), [prompt], top_k=2)[0]
    seq = list(prompt)
    with torch.no_grad():
        for token in out:
            logits = hf(torch.tensor([seq])).logits[0, -1]
            assert token in logits.topk(2).indices.tolist()
            seq.append(token)
    assert out != reference("llama", [prompt], len(out), eos=None)[0]  # it sampled, not argmax




@pytest.mark.parametrize("top_p", [1e-46, 7e-46, 1e-300, 2**-149])
def test_a_top_p_below_float32s_range_keeps_the_most_likely_token(top_p):
    """A top_p float32 rounds to 0 (or to a subnormal) keeps the most likely token alone,
    as the value asked does: the greedy token, not token 0 from a row with every token masked."""
    logits = torch.randn(8, 50, generator=gen(2))
    logits[:, 0] = -5.0
    assert sampled(logits, ts.SamplingParams(top_p=top_p, temperature=1.5), 8).tolist() == \
        first_argmax(logits).tolist()


# ---------------------------------------------------------------- sample streams


@FAST
@given(seed=st.integers(-2**63, 2**63 - 1 - 64))
def test_sample_streams_of_nearby_seeds_never_meet(seed):
    """Every sample of 64 neighbouring seeds (each at n = 128) has a key of its own, and the
    keys fit the sampler's int64 tensors."""
    keys = [stream_key(s, i) for s in range(seed, seed + 64) for i in range(MAX_N)]
    assert len(set(keys)) == len(keys) and all(-2**63 <= k < 2**63 for k in keys)


@FAST
@given(a=st.integers(-2**63, 2**63 - 1), b=st.integers(-2**63, 2**63 - 1), index=st.integers(0, MAX_N - 1))
def test_distinct_seeds_have_distinct_streams(a, b, index):
    assume(a != b)
    assert stream_key(a, index) != stream_key(b, index)
    assert stream_key(a, index) == stream_key(a, index)


def test_the_64_bit_seed_range_has_no_aliases():
    """Seeds that were folded modulo 2**62 (and the range's ends) key streams of their own."""
    seeds = [5, 5 + 2**62, 5 - 2**62, 2**63 - 1, -2**63, -1, 0]
    assert len({stream_key(s, 0) for s in seeds}) == len(seeds)


def test_the_kernel_draws_from_keys_across_the_whole_int64_range():
    """Sample keys span every signed 64-bit value, and a key moved on by a far position
    wraps: the Triton kernel (the interpreter off a GPU) draws alike for a key and
    differently for others, as the reference does (test_kernels checks the distribution)."""
    from tokenspeed.backends.kernels import triton_sampling
    device = "cuda" if torch.cuda.is_available() else "cpu"
    keys = torch.tensor([stream_key(s, i) for s in (-2**63, -1, 2**63 - 1, 77) for i in range(8)])
    rows = len(keys)
    logits = torch.zeros(rows, 16)   # uniform: every token as likely
    positions = torch.full((rows,), 2**31 - 1, dtype=torch.int64)   # keys wrap past int64

    def kernel(keys):
        return triton_sampling.gumbel_argmax(logits.to(device), torch.ones(rows, device=device),
                                             torch.zeros(rows, dtype=torch.int64, device=device),
                                             keys.to(device), positions.to(device), block=16).cpu()

    def reference(keys):
        return sample(logits, [RowSampling(ts.SamplingParams(), int(k)) for k in keys], positions).tokens
    for draw in (kernel, reference):
        tokens = draw(keys)
        assert torch.equal(tokens, draw(keys)) and len(set(tokens.tolist())) > 4
        assert (tokens != draw(keys.roll(1))).sum() > rows // 2


@pytest.mark.parametrize("seed", [2**63, -2**63 - 1])
def test_a_row_refuses_a_seed_past_int64_naming_it(seed):
    """A value that slipped past the request check is refused where the row is made, as a
    request's refusal (its field and bound named), not a bare ValueError."""
    with pytest.raises(RefusedRequest, match=r"^seed=.*: must fit a signed 64-bit integer") as refused:
        RowSampling(ts.SamplingParams(), seed)
    assert (refused.value.field, refused.value.value) == ("seed", seed)


def test_clone_is_a_checked_copy_with_changes():
    """vLLM's code sets a field of the defaults; here, an immutable record's ``clone``."""
    import attrs
    p = ts.SamplingParams(temperature=0.5, max_tokens=16)
    assert p.clone() == p and p.clone(max_tokens=100) == ts.SamplingParams(temperature=0.5, max_tokens=100)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        p.max_tokens = 100
    with pytest.raises(RefusedRequest, match="max_tokens"):
        p.clone(max_tokens=0)


def test_a_clone_of_greedy_params_given_a_temperature_samples():
    """temperature 0's top_k 1 is not kept as if asked for: vLLM's greedy params, copied and
    given a temperature, sample with top-k off; a top_k given with it, or kept by a copy
    that stays greedy, stands."""
    greedy = ts.SamplingParams(temperature=0, top_k=5, max_tokens=16)
    assert greedy.clone(temperature=0.7) == ts.SamplingParams(temperature=0.7, max_tokens=16)
    assert not greedy.clone(temperature=0.7).greedy
    assert greedy.clone(temperature=0.7, top_k=3).top_k == 3
    assert greedy.clone(max_tokens=4).greedy and greedy.clone(temperature=0).greedy
    assert ts.SamplingParams(temperature=0.5, top_k=1).clone(temperature=0.9).top_k == 1
