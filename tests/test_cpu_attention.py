"""The CPU's C decode attention (``cpu_attention.c``) against the torch formulation it
stands for (``torch_attention.lone_rows_attention``, ``reference.rope_write_kv``): over
request lengths, page sizes, head groupings, head sizes, windows and padding rows. Scores
and softmax are float32 in both, summed in another order: compared within 1e-5. The
rotation and the cache write are the reference's to the bit.
"""

import os
import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tokenspeed.backends.kernels import cpu_attention, reference, torch_attention
from test_kernels import as_pages, decode_rows, paged_setup, rope_table

needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                    reason="no C compiler on PATH")
SOME = settings(max_examples=40, deadline=None, derandomize=True)
HEADS = [(4, 2), (4, 4), (6, 2), (4, 1), (9, 3), (32, 2)]   # (query heads, KV heads)


def decode_case(lengths, page_size, heads, head_dim, pad_rows, seed=0):
    kv, table = paged_setup(lengths, page_size, heads[1], head_dim, device="cpu", seed=seed)
    row_request, positions = decode_rows(lengths, pad_rows, device="cpu")
    q = torch.randn(len(positions), heads[0], head_dim, generator=torch.Generator().manual_seed(seed))
    return q, kv[1], table, row_request, positions


@needs_compiler
@SOME
@given(lengths=st.lists(st.integers(1, 150), min_size=1, max_size=6), page_size=st.sampled_from([1, 4, 16]),
       heads=st.sampled_from(HEADS), head_dim=st.sampled_from([16, 64, 128]), pad_rows=st.integers(0, 2),
       window=st.sampled_from([0, 1, 7, 64]))
def test_decode_attention_equals_the_torch_formulation(lengths, page_size, heads, head_dim, pad_rows, window):
    q, kv, table, row_request, positions = decode_case(lengths, page_size, heads, head_dim, pad_rows)
    scale = head_dim ** -0.5
    got = cpu_attention.decode_attention(q, kv, table, row_request, positions, scale, page_size, window)
    want = torch_attention.lone_rows_attention(q, kv, table, row_request, positions, scale, page_size, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_compiler
@SOME
@given(lengths=st.lists(st.integers(1, 90), min_size=1, max_size=5), page_size=st.sampled_from([1, 4, 16]),
       heads=st.sampled_from(HEADS), head_dim=st.sampled_from([16, 64]), pad_rows=st.integers(0, 2),
       window=st.sampled_from([0, 5]))
def test_rope_decode_attention_is_the_references_rotation_write_and_attention(lengths, page_size, heads, head_dim,
                                                                              pad_rows, window):
    """q, k and v as the views of one projection's row that a layer passes; the cache the
    C kernel writes equals the reference's to the bit. Padding rows all write the null page's
    first slot, in any order, and read it: that page and their outputs are not compared."""
    q, _, table, row_request, positions = decode_case(lengths, page_size, heads, head_dim, pad_rows)
    cache, _ = paged_setup(lengths, page_size, heads[1], head_dim, device="cpu", seed=1)
    qkv = torch.randn(q.shape[0], (heads[0] + 2 * heads[1]) * head_dim, generator=torch.Generator().manual_seed(2))
    q, k, v = (part.unflatten(-1, (-1, head_dim)) for part in qkv.split(
        [heads[0] * head_dim, heads[1] * head_dim, heads[1] * head_dim], dim=-1))
    slots = torch.stack([table[r, p // page_size].long() * page_size + p % page_size
                         for r, p in zip(row_request.tolist(), positions.tolist())])
    cos_sin, scale = rope_table(head_dim, 160).cpu(), head_dim ** -0.5
    ours, theirs = as_pages(cache.clone(), page_size), as_pages(cache.clone(), page_size)
    got = reference.rope_decode_attention(q, k, v, cos_sin, positions, ours, 1, slots, table, row_request, scale,
                                          window)
    q_rot = reference.rope_write_kv(q, k, v, cos_sin, positions, theirs, 1, slots)
    want = torch_attention.lone_rows_attention(q_rot, theirs.flatten(2, 3)[1], table, row_request, positions, scale,
                                               page_size, window)
    real = len(lengths)
    assert torch.equal(ours[:, :, 1:], theirs[:, :, 1:])
    torch.testing.assert_close(got[:real], want[:real], atol=1e-5, rtol=1e-5)


@needs_compiler
def test_the_cpu_ops_take_the_c_kernel_for_float32_caches_only(monkeypatch):
    q, kv, table, row_request, positions = decode_case([5, 9], 4, (4, 2), 16, 0)
    calls = []
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *args: calls.append(args) or args[0])
    cache = as_pages(torch.stack([kv, kv]), 4)
    reference.decode_attention(q, cache, 1, table, row_request, positions, 0.25, 0)
    assert len(calls) == 1
    out = reference.decode_attention(q.bfloat16(), cache.bfloat16(), 1, table, row_request, positions, 0.25, 0)
    assert len(calls) == 1 and out.dtype == torch.bfloat16   # the torch formulation
    odd = torch.randn(2, 4, 24)   # heads of 24 elements: not a multiple of 16
    assert not cpu_attention.reads(odd, torch.zeros(2, 8, 2, 24))
    assert not cpu_attention.reads(torch.randn(2, 4, 16), torch.zeros(2, 8, 2, 32))   # the cache's heads differ


@needs_compiler
def test_rows_outside_the_tables_or_the_cache_are_refused_not_read():
    """The C reads where it is told: a position past the block table's width, a request
    past its rows, a page or slot past the cache, or a position past the rotary table is an
    IndexError before any read."""
    q, kv, table, row_request, positions = decode_case([5, 9], 4, (4, 2), 16, 0)
    attend = lambda **changed: cpu_attention.decode_attention(  # noqa: E731
        *{**dict(q=q, kv=kv, block_tables=table, row_request=row_request, positions=positions), **changed}.values(),
        0.25, 4, 0)
    with pytest.raises(IndexError, match="outside the block tables"):
        attend(positions=torch.tensor([4, 399_999]))
    with pytest.raises(IndexError, match="outside the block tables"):
        attend(row_request=torch.tensor([0, 7]))
    with pytest.raises(IndexError, match="outside the block tables"):
        attend(block_tables=torch.full_like(table, 10_000))
    slots = torch.tensor([4, kv.shape[1]])   # one past the cache's last slot
    k = v = torch.randn(2, 2, 16)
    with pytest.raises(IndexError, match="outside the block tables"):
        cpu_attention.rope_decode_attention(q, k, v, torch.zeros(16, 16), positions, kv, slots, table, row_request,
                                            0.25, 4, 0)
    with pytest.raises(IndexError, match="rotary table"):
        cpu_attention.rope_decode_attention(q, k, v, torch.zeros(4, 16), positions, kv, slots - 1, table,
                                            row_request, 0.25, 4, 0)


@needs_compiler
def test_misfit_inputs_are_refused_by_name():
    q, kv, table, row_request, positions = decode_case([5], 4, (4, 2), 16, 0)
    with pytest.raises(ValueError, match="float32 q and cache, D a multiple of 16"):
        cpu_attention.decode_attention(q.bfloat16(), kv, table, row_request, positions, 0.25, 4, 0)
    with pytest.raises(ValueError, match="at most 16 query heads a KV head"):
        cpu_attention.decode_attention(torch.randn(1, 34, 16), kv, table, row_request, positions, 0.25, 4, 0)
    with pytest.raises(ValueError, match="each row's heads dense"):
        cpu_attention.rope_decode_attention(q, q.transpose(1, 2)[:, :2].transpose(1, 2), q[:, :2], torch.zeros(8, 16),
                                            positions, kv, positions, table, row_request, 0.25, 4, 0)
