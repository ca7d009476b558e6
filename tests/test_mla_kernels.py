"""The latent-attention reference kernels: both forms equal plain multi-head attention
over the expanded keys and values, and no row reads outside its own request's pages."""

import torch
from hypothesis import given, settings, strategies as st

import tokenspeed.backends  # noqa: F401  (registers the kernels)
from tokenspeed.backends.kernels.mla_reference import mla_attention, mla_decode_attention, write_latent

HEADS, NOPE, ROPE, V, LATENT = 3, 8, 4, 6, 10


def batch(lengths, page_size, seed):
    """A pool whose pages are dealt to the requests in a shuffled order (page 0 never),
    every request's positions written, and the kernels' arguments for its last rows."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // page_size) for n in lengths]
    order = (torch.randperm(sum(pages) + 2, generator=gen) + 1).tolist()
    cache = torch.zeros(2, 1, sum(pages) + 3, page_size, 1, LATENT + ROPE)
    tables = torch.zeros(len(lengths) + 1, max(pages) + 1, dtype=torch.int32)    # row -1: padding's
    for r, n in enumerate(pages):
        tables[r, :n] = torch.tensor(order[:n])
        order = order[n:]
    requests = torch.cat([torch.full((n,), r) for r, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    slots = tables[requests, positions // page_size].long() * page_size + positions % page_size
    write_latent(torch.randn(len(slots), LATENT, generator=gen), torch.randn(len(slots), ROPE, generator=gen),
                 cache, 1, slots)
    return cache, tables, requests, positions, gen


def queries(rows, gen):
    return (torch.randn(rows, HEADS, NOPE, generator=gen), torch.randn(rows, HEADS, ROPE, generator=gen),
            torch.randn(HEADS * (NOPE + V), LATENT, generator=gen) / LATENT ** 0.5)


def expanded_attention(q_nope, q_rope, cache, table, position, w, page_size):
    """Row-by-row multi-head attention over keys and values up-projected from the latents."""
    keys = torch.arange(position + 1)
    rows = cache[1, 0].flatten(0, 1)[table[keys // page_size].long() * page_size + keys % page_size, 0]
    kv = (rows[:, :LATENT] @ w.T).view(-1, HEADS, NOPE + V)
    k = torch.cat((kv[..., :NOPE], rows[:, None, LATENT:].expand(-1, HEADS, -1)), dim=-1)
    scores = torch.einsum("hd,lhd->hl", torch.cat((q_nope, q_rope), dim=-1), k) * 0.3
    return torch.einsum("hl,lhv->hv", scores.softmax(-1), kv[..., NOPE:])


@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=4), page_size=st.sampled_from([1, 4, 16]),
       seed=st.integers(0, 2**16))
def test_both_forms_equal_multi_head_attention_over_the_expanded_latents(lengths, page_size, seed):
    cache, tables, requests, positions, gen = batch(lengths, page_size, seed)
    q_nope, q_rope, w = queries(len(requests), gen)
    got = mla_attention(q_nope, q_rope, cache, 1, tables, requests, positions, w, 0.3)
    last = torch.tensor([sum(lengths[:r + 1]) - 1 for r in range(len(lengths))])
    decoded = mla_decode_attention(q_nope[last], q_rope[last], cache, 1, tables, requests[last], positions[last],
                                   w, 0.3)
    for row in range(len(requests)):
        want = expanded_attention(q_nope[row], q_rope[row], cache, tables[requests[row]], int(positions[row]), w,
                                  page_size)
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decoded, got[last], rtol=1e-5, atol=1e-5)


@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=4), page_size=st.sampled_from([1, 4, 16]),
       pad_rows=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_no_row_reads_outside_its_requests_pages(lengths, page_size, pad_rows, seed):
    """Every value a request's rows may not read changed (other requests' pages, free
    pages and the other layer to NaN, which any read, even masked, would spread; its own
    slots past its rows' positions and the null page its table's tail points at to
    noise): their outputs stay bit for bit. Padding rows point at the null page."""
    cache, tables, requests, positions, gen = batch(lengths, page_size, seed)
    requests = torch.cat([requests, torch.full((pad_rows,), len(lengths))])
    positions = torch.cat([positions, torch.zeros(pad_rows, dtype=torch.long)])
    q_nope, q_rope, w = queries(len(requests), gen)
    for kernel in (mla_attention, mla_decode_attention):
        clean = kernel(q_nope, q_rope, cache, 1, tables, requests, positions, w, 0.3)
        for r in range(len(lengths)):
            rows = (requests == r).nonzero().flatten()
            poisoned = poisoned_cache(cache, tables, r, int(positions[rows].max()), page_size, gen)
            got = kernel(q_nope, q_rope, poisoned, 1, tables, requests, positions, w, 0.3)
            assert torch.equal(got[rows], clean[rows]), (kernel.__name__, r)


def poisoned_cache(cache, tables, request, last, page_size, gen):
    """``cache`` with every value request ``request``'s rows may not read changed."""
    poisoned = torch.full_like(cache, float("nan"))
    own = tables[request][tables[request] > 0].long()
    poisoned[:, :, own] = 1e3 * torch.randn(poisoned[:, :, own].shape, generator=gen)
    poisoned[:, :, 0] = 1e3 * torch.randn(poisoned[:, :, 0].shape, generator=gen)   # table tails: masked
    keys = torch.arange(last + 1)
    slots = tables[request][keys // page_size].long() * page_size + keys % page_size
    poisoned[1, 0].flatten(0, 1)[slots] = cache[1, 0].flatten(0, 1)[slots]
    return poisoned
