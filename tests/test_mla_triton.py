"""The Triton absorbed MLA kernels (decode's, and prefill's and extends' ``mla_attention``)
against the torch reference, under the interpreter on the CPU (TRITON_INTERPRET=1, set by
tests/conftest.py)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import given, settings, strategies as st  # noqa: E402

from tokenspeed.backends.kernels import cuda, mla_reference, reference, triton_mla  # noqa: E402
from tokenspeed.ir.rope import cos_sin_table  # noqa: E402

from test_mla_kernels import LATENT, ROPE, poisoned_cache, batch, queries  # noqa: E402


@settings(max_examples=10, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3), page_size=st.sampled_from([1, 4, 16]),
       pad_rows=st.integers(0, 1), splits=st.sampled_from([None, 1, 3, 8]), seed=st.integers(0, 2**16))
def test_the_triton_decode_equals_the_reference(lengths, page_size, pad_rows, splits, seed):
    cache, tables, requests, positions, gen = batch(lengths, page_size, seed)
    last = torch.tensor([sum(lengths[:r + 1]) - 1 for r in range(len(lengths))])
    requests = torch.cat([requests[last], torch.full((pad_rows,), len(lengths))])
    positions = torch.cat([positions[last], torch.zeros(pad_rows, dtype=torch.long)])
    q_nope, q_rope, w = queries(len(requests), gen)
    args = (q_nope, q_rope, cache, 1, tables, requests, positions, w, 0.3)
    torch.testing.assert_close(triton_mla.mla_decode_attention(*args, num_splits=splits),
                               mla_reference.mla_decode_attention(*args),
                               rtol=1e-4, atol=1e-5)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3), pad_rows=st.integers(0, 1),
       splits=st.sampled_from([1, 3]), interleaved=st.booleans(), seed=st.integers(0, 2**16))
def test_the_triton_decode_rotates_its_query_as_the_rope_op(lengths, pad_rows, splits, interleaved, seed):
    """An unrotated q_rope and the table: the kernel's rotation is ``rope``'s, then the same attention."""
    cache, tables, requests, positions, gen = batch(lengths, 4, seed)
    last = torch.tensor([sum(lengths[:r + 1]) - 1 for r in range(len(lengths))])
    requests = torch.cat([requests[last], torch.full((pad_rows,), len(lengths))])
    positions = torch.cat([positions[last], torch.zeros(pad_rows, dtype=torch.long)])
    q_nope, q_rope, w = queries(len(requests), gen)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, q_rope.shape[2], 2, dtype=torch.float32) / q_rope.shape[2])
    table = cos_sin_table(inv_freq, torch.arange(64))
    args = (cache, 1, tables, requests, positions, w, 0.3)
    rotated = reference.rope(q_rope, table, positions, interleaved)
    want = mla_reference.mla_decode_attention(q_nope, rotated, *args)
    got = triton_mla.mla_decode_attention(q_nope, q_rope, *args, num_splits=splits,
                                          rope=triton_mla.QueryRope(table, interleaved))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(reference.mla_decode_attention(q_nope, q_rope, *args, cos_sin=table,
                                                              rope_interleaved=interleaved), want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_the_absorbed_query_of_few_rows_equals_the_batched_product(rows, dtype):
    """One or two rows by ``_absorb_kernel`` (a query strided as the projection's output
    leaves it), more by the product: each as the product rounds it, in the weight's dtype."""
    gen = torch.Generator().manual_seed(rows)
    projected = torch.randn(rows, 3 * (8 + 4) + 5, generator=gen).to(dtype)
    q_nope = projected[:, :36].view(rows, 3, 12)[..., :8]
    w_k = (torch.randn(3 * (8 + 6), 10, generator=gen) / 10 ** 0.5).to(dtype).view(3, 14, 10)[:, :8]
    got = triton_mla.absorbed_query(q_nope, w_k)
    assert got.dtype == dtype and got.shape == (rows, 3, 10)
    want = torch.einsum("qhn,hnr->qhr", q_nope.float(), w_k.float()).to(dtype)
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("lengths, pad_rows", [([5], 0), ([9, 30], 0), ([3], 1), ([7, 12, 1], 0)])
def test_the_write_joined_to_the_attention_stores_and_reads_the_rows_latents(lengths, pad_rows, interleaved):
    """``mla_write_decode_attention``'s CUDA kernels (the absorption's launch writes one or two
    rows; more rows, their own launch): the reference's cache, and its output, whose own keys
    are the ones written (the rows' slots start as NaN)."""
    cache, tables, requests, positions, gen = batch(lengths, 4, seed=len(lengths) + pad_rows)
    last = torch.tensor([sum(lengths[:r + 1]) - 1 for r in range(len(lengths))])
    requests = torch.cat([requests[last], torch.full((pad_rows,), len(lengths))])   # padding: page 0
    positions = torch.cat([positions[last], torch.zeros(pad_rows, dtype=torch.long)])
    slots = tables[requests, positions // 4].long() * 4 + positions % 4
    cache[1, 0].flatten(0, 1)[slots, 0] = float("nan")
    rows = len(requests)
    q_nope, q_rope, w = queries(rows, gen)
    kv_a = torch.randn(rows, LATENT + ROPE, generator=gen)                  # latent | rope key, as split
    latent, k_rope, weight = kv_a[:, :LATENT], kv_a[:, LATENT:].view(rows, 1, ROPE), torch.rand(LATENT) + 0.5
    inv_freq = 1.0 / 10000 ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE)
    table = cos_sin_table(inv_freq, torch.arange(64))
    got_cache, want_cache = cache.clone(), cache.clone()
    args = (q_nope, q_rope, latent, weight, 1e-6, k_rope, table, positions, interleaved)
    rest = (1, slots, tables, requests, w, 0.3)
    got = cuda.mla_write_decode_attention(*args, got_cache, *rest)
    want = reference.mla_write_decode_attention(*args, want_cache, *rest)
    torch.testing.assert_close(got_cache, want_cache, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_one_head_writes_both_rows_and_absorbs_every_column_block():
    """A latent of several ``ABSORB_COLUMNS`` blocks (the last one partial) and one head: the
    writing program writes both rows, and every block of the query's absorption is stored."""
    gen, latent_dim, rope_dim, nope, v_dim, page = torch.Generator().manual_seed(5), 130, 8, 8, 6, 4
    cache = torch.randn(2, 1, 6, page, 1, latent_dim + rope_dim, generator=gen)
    tables = torch.tensor([[1, 2], [3, 4], [0, 0]], dtype=torch.int32)        # row 2: padding's
    requests, positions = torch.tensor([0, 1]), torch.tensor([6, 2])
    slots = tables[requests, positions // page].long() * page + positions % page
    cache[1, 0].flatten(0, 1)[slots, 0] = float("nan")
    q_nope, q_rope = torch.randn(2, 1, nope, generator=gen), torch.randn(2, 1, rope_dim, generator=gen)
    w = torch.randn(nope + v_dim, latent_dim, generator=gen) / latent_dim ** 0.5
    latent, k_rope = torch.randn(2, latent_dim, generator=gen), torch.randn(2, 1, rope_dim, generator=gen)
    table = cos_sin_table(1.0 / 10000 ** (torch.arange(0, rope_dim, 2) / rope_dim), torch.arange(16))
    args = (q_nope, q_rope, latent, torch.rand(latent_dim, generator=gen) + 0.5, 1e-6, k_rope, table, positions,
            False)
    got_cache, want_cache = cache.clone(), cache.clone()
    got = cuda.mla_write_decode_attention(*args, got_cache, 1, slots, tables, requests, w, 0.3)
    want = reference.mla_write_decode_attention(*args, want_cache, 1, slots, tables, requests, w, 0.3)
    assert -(-latent_dim // triton_mla.ABSORB_COLUMNS) > 2 and len(requests) <= triton_mla.ABSORB_MAX_ROWS
    torch.testing.assert_close(got_cache, want_cache, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 30), min_size=2, max_size=3), page_size=st.sampled_from([1, 4]),
       seed=st.integers(0, 2**16))
def test_the_triton_decode_reads_only_its_requests_pages(lengths, page_size, seed):
    """As the reference's property (test_mla_kernels): NaN everywhere a row may not read."""
    cache, tables, requests, positions, gen = batch(lengths, page_size, seed)
    last = torch.tensor([sum(lengths[:r + 1]) - 1 for r in range(len(lengths))])
    requests, positions = requests[last], positions[last]
    q_nope, q_rope, w = queries(len(requests), gen)
    clean = triton_mla.mla_decode_attention(q_nope, q_rope, cache, 1, tables, requests, positions, w, 0.3, 3)
    for r in range(len(lengths)):
        poisoned = poisoned_cache(cache, tables, r, int(positions[r]), page_size, gen)
        got = triton_mla.mla_decode_attention(q_nope, q_rope, poisoned, 1, tables, requests, positions, w, 0.3, 3)
        assert torch.equal(got[r], clean[r]), r


def test_a_bfloat16_model_decodes_within_bfloat16_rounding():
    """The queries up-projected in the weight's dtype (bfloat16), scores and softmax float32."""
    cache, tables, requests, positions, gen = batch([37, 5], 4, seed=3)
    last = torch.tensor([36, 41])
    q_nope, q_rope, w = queries(2, gen)
    args = (q_nope.bfloat16(), q_rope.bfloat16(), cache.bfloat16(), 1, tables, requests[last], positions[last],
            w.bfloat16(), 0.3)
    got = triton_mla.mla_decode_attention(*args)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), mla_reference.mla_decode_attention(*args).float(), rtol=3e-2, atol=3e-2)


def extend_rows(lengths, cached, page_size, seed, pad_rows=0):
    """Every request's whole context cached, its rows from ``cached[r]`` on extending it
    (a prefix hit or an earlier chunk before them), then ``pad_rows`` on the null page."""
    cache, tables, requests, positions, gen = batch(lengths, page_size, seed)
    fresh = positions >= torch.tensor(cached)[requests]
    requests = torch.cat([requests[fresh], torch.full((pad_rows,), len(lengths))])
    positions = torch.cat([positions[fresh], torch.zeros(pad_rows, dtype=torch.long)])
    return cache, tables, requests, positions, gen


@st.composite
def extends(draw):
    lengths = draw(st.lists(st.integers(1, 37), min_size=1, max_size=3))
    return lengths, [draw(st.integers(0, n - 1)) for n in lengths]


@settings(max_examples=10, deadline=None, derandomize=True)
@given(extend=extends(), page_size=st.sampled_from([4, 16]), pad_rows=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_the_triton_prefill_and_extend_equal_the_expanded_reference(extend, page_size, pad_rows, seed):
    """Odd lengths, several requests, chunks after a cached prefix, padding rows: each row
    as the reference's expanded runs (its absorbed lone rows) compute it."""
    lengths, cached = extend
    cache, tables, requests, positions, gen = extend_rows(lengths, cached, page_size, seed, pad_rows)
    q_nope, q_rope, w = queries(len(requests), gen)
    args = (q_nope, q_rope, cache, 1, tables, requests, positions, w, 0.3)
    torch.testing.assert_close(triton_mla.mla_attention(*args), mla_reference.mla_attention(*args),
                               rtol=1e-4, atol=1e-5)


@settings(max_examples=5, deadline=None, derandomize=True)
@given(extend=extends(), page_size=st.sampled_from([4, 16]), seed=st.integers(0, 2**16))
def test_the_triton_extend_reads_only_its_requests_pages(extend, page_size, seed):
    """NaN everywhere a request's rows may not read (test_mla_kernels.poisoned_cache)."""
    lengths, cached = extend
    cache, tables, requests, positions, gen = extend_rows(lengths, cached, page_size, seed)
    q_nope, q_rope, w = queries(len(requests), gen)
    clean = triton_mla.mla_attention(q_nope, q_rope, cache, 1, tables, requests, positions, w, 0.3)
    for r in range(len(lengths)):
        rows = (requests == r).nonzero().flatten()
        poisoned = poisoned_cache(cache, tables, r, lengths[r] - 1, page_size, gen)
        got = triton_mla.mla_attention(q_nope, q_rope, poisoned, 1, tables, requests, positions, w, 0.3)
        assert torch.equal(got[rows], clean[rows]), r


def test_a_bfloat16_prompt_attends_within_bfloat16_rounding_of_the_expanded_reference():
    cache, tables, requests, positions, gen = extend_rows([37, 21], [0, 9], 16, seed=4)
    q_nope, q_rope, w = queries(len(requests), gen)
    args = (q_nope.bfloat16(), q_rope.bfloat16(), cache.bfloat16(), 1, tables, requests, positions, w.bfloat16(), 0.3)
    got = triton_mla.mla_attention(*args)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), mla_reference.mla_attention(*args).float(), rtol=3e-2, atol=3e-2)
