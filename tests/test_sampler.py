"""The sampler: greedy is argmax, top-k / top-p restrict the support, seeds reproduce."""

import math

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

import tokenspeed as ts
from tokenspeed.runtime.sampler import SamplingTensors, sample

FAST = settings(max_examples=40, deadline=None, derandomize=True)


def tensors(params, rows=None):
    params = list(params) if rows is None else [params] * rows
    return SamplingTensors.build(params, "cpu")


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
        got = sample(logits, tensors(params, logits.shape[0]), gen(seed))
        assert torch.equal(got, first_argmax(logits)), params


@FAST
@given(logits=logits_batches(tie_heavy=True), seed=st.integers(0, 2**31 - 1))
def test_greedy_ties_pick_the_first_index(logits, seed):
    got = sample(logits, tensors(ts.SamplingParams(temperature=0), logits.shape[0]), gen(seed))
    assert torch.equal(got, first_argmax(logits))


def test_greedy_explicit_ties():
    logits = torch.tensor([[1.0, 5.0, 5.0, 2.0], [9.0, 9.0, 9.0, 9.0], [0.0, -1.0, 3.0, 3.0]])
    for seed in range(5):
        got = sample(logits, tensors(ts.SamplingParams(temperature=0), 3), gen(seed))
        assert got.tolist() == [1, 0, 2]


def test_temperature_zero_normalises_to_top_k_1():
    p = ts.SamplingParams(temperature=0, top_k=50, top_p=0.5)
    assert p.top_k == 1 and p.greedy
    assert ts.SamplingParams(temperature=0).top_k == 1
    assert not ts.SamplingParams(temperature=0.5).greedy
    assert ts.SamplingParams(temperature=0.5).top_k == 0
    assert ts.SamplingParams(temperature=1.0, top_k=1).greedy


def test_mixed_rows_greedy_rows_stay_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    params = [ts.SamplingParams(temperature=0) if i % 2 else ts.SamplingParams(temperature=1.5)
              for i in range(8)]
    for seed in range(10):
        got = sample(logits, tensors(params), gen(seed))
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
    draws = sample(logits.repeat(reps, 1), tensors(params, rows * reps), gen(seed)).view(reps, rows)
    for r in range(rows):
        assert set(draws[:, r].tolist()) <= set(allowed[r].tolist())
    if k > 1:  # with flat logits more than one of the k shows up
        assert any(len(set(draws[:, r].tolist())) > 1 for r in range(rows))


def test_top_k_larger_than_vocab_is_no_restriction():
    logits = torch.zeros(1, 5)
    draws = {int(sample(logits, tensors(ts.SamplingParams(top_k=100), 1), gen(s))) for s in range(200)}
    assert draws == set(range(5))


def nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """The smallest set of most-likely tokens whose mass reaches top_p."""
    order = probs.argsort(descending=True).tolist()
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += float(probs[i])
        if mass >= top_p:
            break
    return kept


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
    draws = set(sample(logits.expand(60, -1).contiguous(), tensors(params, 60), gen(seed)).tolist())
    assert draws <= allowed, (draws - allowed, sorted(allowed))
    # the most likely token is always in the nucleus
    assert int(probs.argmax()) in allowed


def test_top_p_explicit_nucleus():
    probs = torch.tensor([0.05, 0.5, 0.3, 0.15])
    logits = probs.log()[None].expand(4000, -1).contiguous()
    draws = sample(logits, tensors(ts.SamplingParams(top_p=0.7), 4000), gen(3))
    assert set(draws.tolist()) == {1, 2}          # 0.5 + 0.3 >= 0.7
    draws = sample(logits, tensors(ts.SamplingParams(top_p=0.85), 4000), gen(3))
    assert set(draws.tolist()) == {1, 2, 3}
    draws = sample(logits, tensors(ts.SamplingParams(top_p=0.4), 4000), gen(3))
    assert set(draws.tolist()) == {1}


def test_top_p_exact_boundary_keeps_the_smallest_nucleus():
    # two equally likely tokens, p = 0.5 each: the first alone already has mass 0.5
    logits = torch.zeros(2000, 2)
    draws = sample(logits, tensors(ts.SamplingParams(top_p=0.5), 2000), gen(0))
    assert len(set(draws.tolist())) == 1


def test_top_k_and_top_p_combine():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log()[None].expand(3000, -1).contiguous()
    # top_k=3 renormalises to 4/9, 3/9, 2/9; top_p=0.7 then keeps {0, 1}
    draws = sample(logits, tensors(ts.SamplingParams(top_k=3, top_p=0.7), 3000), gen(1))
    assert set(draws.tolist()) == {0, 1}


def test_sampling_follows_softmax_with_temperature():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0])
    n = 40000
    for temperature in (0.5, 1.0, 2.0):
        draws = sample(logits[None].expand(n, -1).contiguous(),
                       tensors(ts.SamplingParams(temperature=temperature), n), gen(7))
        freq = torch.bincount(draws, minlength=4).double() / n
        expected = (logits.double() / temperature).softmax(-1)
        # 5 standard deviations of a binomial proportion
        tol = 5 * torch.sqrt(expected * (1 - expected) / n)
        assert torch.all((freq - expected).abs() <= tol), (temperature, freq, expected)


# ---------------------------------------------------------------- reproducibility


def test_seeded_generator_is_reproducible():
    torch.manual_seed(0)
    logits = torch.randn(16, 100)
    params = tensors([ts.SamplingParams(temperature=1.0, top_p=0.9, top_k=20)] * 16)
    a = sample(logits, params, gen(123))
    b = sample(logits, params, gen(123))
    assert torch.equal(a, b)
    others = [sample(logits, params, gen(s)) for s in (1, 2, 3)]
    assert any(not torch.equal(a, o) for o in others)


def test_sample_returns_one_index_per_row_in_range():
    torch.manual_seed(1)
    logits = torch.randn(5, 33)
    out = sample(logits, tensors(ts.SamplingParams(), 5), gen(0))
    assert out.shape == (5,) and out.dtype == torch.int64
    assert int(out.min()) >= 0 and int(out.max()) < 33


def test_sampling_tensors_build():
    params = [ts.SamplingParams(temperature=0.5, top_k=3, top_p=0.9), ts.SamplingParams(temperature=0)]
    s = SamplingTensors.build(params, "cpu")
    assert s.temperature.tolist() == [0.5, 0.0]
    assert s.top_k.tolist() == [3, 1]
    assert [round(x, 6) for x in s.top_p.tolist()] == [0.9, 1.0]
    assert math.isclose(s.top_p[0].item(), 0.9, rel_tol=1e-6)


# ---------------------------------------------------------------- through the LLM


@pytest.fixture(scope="module")
def llama_path():
    from hf_models import checkpoint
    return checkpoint("llama")


def _sampled(llm, prompts, **params):
    sp = ts.SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, **params)
    return [o.token_ids for o in llm.generate(prompts, sp)]


def test_llm_seed_makes_sampling_reproducible(llama_path):
    prompts = [[5, 6, 7], [9] * 12, [100, 200]]
    a = _sampled(ts.LLM(llama_path, page_size=4, seed=4), prompts)
    b = _sampled(ts.LLM(llama_path, page_size=4, seed=4), prompts)
    c = _sampled(ts.LLM(llama_path, page_size=4, seed=5), prompts)
    assert a == b
    assert a != c
    assert all(len(t) == 10 for t in a)


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


