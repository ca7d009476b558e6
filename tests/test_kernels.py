"""Triton kernels against the torch reference of their op (``reference.py``, the kernels
the CPU runs).

On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py, or here as a fallback before triton is imported) on small fp32 shapes.
Tests marked ``gpu`` run bf16 at real shapes and are skipped without CUDA.
"""

import os

import attrs
import numpy as np
import pytest
import torch
import triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import given, settings, strategies as st  # noqa: E402

from tokenspeed.backends.kernels import reference  # noqa: E402
from tokenspeed.backends.kernels.blocks import next_power_of_2  # noqa: E402
from tokenspeed.backends.metadata import ExtendChunk, attention_tiles, plan_extend, tile_capacity  # noqa: E402
from tokenspeed.execution.slots import to_device  # noqa: E402
from tokenspeed.backends.kernels import triton_attention, triton_cache, triton_decode  # noqa: E402
from tokenspeed.backends.kernels import triton_fused, triton_gemv, triton_sampling  # noqa: E402
from tokenspeed.ir.rope import apply_rotary, cos_sin_table  # noqa: E402
from tokenspeed.errors import InternalError  # noqa: E402
from tokenspeed.execution.sampler import POSITION_KEY, RowSampling, sample  # noqa: E402
import tokenspeed as ts  # noqa: E402

FEW = settings(max_examples=15, deadline=None, derandomize=True)
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def paged_setup(lengths, page_size, kv_heads, head_dim, layers=2, dtype=torch.float32,
                device=DEVICE, seed=0):
    """Random cache; request i owns shuffled (non-contiguous) pages covering lengths[i].

    One extra request with an all-zero table row serves padding rows (page 0)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // page_size) for n in lengths]
    pages = sum(need) + 3
    kv = torch.randn(layers, 2, pages * page_size, kv_heads, head_dim, generator=gen)
    order = torch.randperm(pages - 1, generator=gen) + 1
    table = torch.zeros(len(lengths) + 1, max(need + [1]) + 1, dtype=torch.int32)
    used = 0
    for r, count in enumerate(need):
        table[r, :count] = order[used:used + count]
        used += count
    return kv.to(dtype).to(device), table.to(device)


def as_pages(kv, page_size: int):
    """A flat ``[L, 2, slots, Hkv, D]`` cache (what Triton kernels take) as the IR's
    ``[L, 2, pages, P, Hkv, D]`` (what the ops, and so the references, take)."""
    return kv.unflatten(2, (-1, page_size))


def rope_table(head_dim: int, positions: int, theta: float = 10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return cos_sin_table(inv_freq, torch.arange(positions)).to(DEVICE)


def decode_rows(lengths, pad_rows, device=DEVICE):
    pad = len(lengths)
    row_request = torch.tensor(list(range(len(lengths))) + [pad] * pad_rows, device=device)
    positions = torch.tensor([n - 1 for n in lengths] + [0] * pad_rows, device=device)
    return row_request, positions


def extend_rows(lengths, cached, pad_rows, device=DEVICE):
    """Rows for the uncached suffix of each request (prefix hits), then padding rows."""
    row_request, positions = [], []
    for r, (n, c) in enumerate(zip(lengths, cached)):
        row_request += [r] * (n - c)
        positions += list(range(c, n))
    row_request += [len(lengths)] * pad_rows
    positions += [0] * pad_rows
    return torch.tensor(row_request, device=device), torch.tensor(positions, device=device)


def check_attention(fn, lengths, rows, page_size, heads, kv_heads, head_dim, dtype, tol,
                    **kwargs):
    kv, table = paged_setup(lengths, page_size, kv_heads, head_dim, dtype=dtype)
    row_request, positions = rows
    q = torch.randn(len(positions), heads, head_dim, device=DEVICE).to(dtype)
    scale = head_dim ** -0.5
    got = fn(q, kv, 1, table, row_request, positions, scale, page_size, **kwargs)
    want = reference.attention(q, as_pages(kv, page_size), 1, table, row_request, positions, scale,
                               kwargs.get("window", 0))
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


heads_st = st.sampled_from([(4, 2), (4, 4), (6, 2), (4, 1)])


@FEW
@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=4),
       page_size=st.sampled_from([4, 16]), heads=heads_st,
       head_dim=st.sampled_from([16, 32, 24]), splits=st.sampled_from([None, 1, 3, 8]),
       pad_rows=st.integers(0, 2))
def test_decode_attention(lengths, page_size, heads, head_dim, splits, pad_rows):
    check_attention(triton_decode.decode_attention, lengths, decode_rows(lengths, pad_rows),
                    page_size, heads[0], heads[1], head_dim, torch.float32, 1e-4,
                    num_splits=splits, max_context=max(lengths))


def test_decode_more_splits_than_keys():
    lengths = [1, 2, 130]
    check_attention(triton_decode.decode_attention, lengths, decode_rows(lengths, 1), 4, 4,
                    2, 16, torch.float32, 1e-4, num_splits=16)


class _NanEmpty:
    """``torch`` as a kernel module sees it, but ``empty`` is filled with NaN: a kernel that
    reads a buffer element nobody wrote then returns NaN."""
    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        return torch.empty(*args, **kwargs).fill_(float("nan"))


@pytest.mark.parametrize("rope", [False, True])
def test_decode_merges_only_the_splits_that_hold_keys(monkeypatch, rope):
    """Most of 16 splits hold no key at these lengths: they write no partial, and the merge
    must not read one."""
    monkeypatch.setattr(triton_decode, "torch", _NanEmpty())
    lengths = [1, 2, 130]
    if rope:
        check_rope_decode(lengths, 1, 4, 4, 2, 16, torch.float32, 1e-4, num_splits=16)
    else:
        check_attention(triton_decode.decode_attention, lengths, decode_rows(lengths, 1), 4,
                        4, 2, 16, torch.float32, 1e-4, num_splits=16)


def rope_decode_case(lengths, pad_rows, page_size, heads, kv_heads, head_dim, dtype):
    """Cache, rows, and q, k, v as strided views of one projection output, like a layer's."""
    kv, table = paged_setup(lengths, page_size, kv_heads, head_dim, dtype=dtype)
    row_request, positions = decode_rows(lengths, pad_rows)
    pages = table[row_request, positions // page_size].long()
    slots = pages * page_size + positions % page_size
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * head_dim, device=DEVICE)
    q, k, v = qkv.to(dtype).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    views = (q.view(-1, heads, head_dim), *(t.view(-1, kv_heads, head_dim) for t in (k, v)))
    cos_sin = rope_table(head_dim, 4096)
    return kv, table, row_request, positions, slots, views, cos_sin


def check_rope_decode(lengths, pad_rows, page_size, heads, kv_heads, head_dim, dtype, tol,
                      group_column=False, head_norms=False, **kwargs):
    """Fused = rotate and write, then attend; live rows only (padding rows share a slot).
    ``group_column``: the kernel takes its slots as one column of two groups' stacked slots.
    ``head_norms``: q and k RMS-normalised per head first (Qwen3's ``q_norm``, ``k_norm``)."""
    kv, table, row_request, positions, slots, (q, k, v), cos_sin = rope_decode_case(
        lengths, pad_rows, page_size, heads, kv_heads, head_dim, dtype)
    kernel_slots = torch.stack([torch.zeros_like(slots), slots], 1)[:, 1] if group_column else slots
    norms = triton_decode.HeadNorms(*(1 + torch.rand(head_dim, generator=torch.Generator().manual_seed(s)).to(
        DEVICE, dtype) for s in (1, 2)), 1e-6) if head_norms else triton_decode.HeadNorms()
    want_kv = kv.clone()
    scale = head_dim ** -0.5
    want = reference.rope_decode_attention(q, k, v, cos_sin, positions, as_pages(want_kv, page_size),
                                           1, slots, table, row_request, scale, kwargs.get("window", 0),
                                           q_norm=norms.q, k_norm=norms.k, norm_eps=norms.eps)
    got = triton_decode.rope_decode_attention(q, k, v, cos_sin, positions, kv, 1, kernel_slots,
                                              table, row_request, scale, page_size, head_norms=norms, **kwargs)
    live = len(lengths)
    torch.testing.assert_close(got[:live].float(), want[:live].float(), atol=tol, rtol=tol)
    torch.testing.assert_close(kv[:, :, slots[:live]].float(), want_kv[:, :, slots[:live]].float(),
                               atol=tol, rtol=tol)
    assert torch.equal(kv[0], want_kv[0])  # another layer's cache is untouched


@FEW
@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=4),
       page_size=st.sampled_from([4, 16]), heads=heads_st,
       head_dim=st.sampled_from([16, 24]), splits=st.sampled_from([None, 1, 3, 8]),
       pad_rows=st.integers(0, 1))
def test_rope_decode_attention_is_rope_write_then_attention(lengths, page_size, heads,
                                                            head_dim, splits, pad_rows):
    check_rope_decode(lengths, pad_rows, page_size, heads[0], heads[1], head_dim,
                      torch.float32, 1e-4, num_splits=splits, max_context=max(lengths))


@settings(max_examples=6, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3), heads=heads_st,
       head_dim=st.sampled_from([16, 24]), splits=st.sampled_from([1, 3]), pad_rows=st.integers(0, 1))
def test_rope_decode_attention_normalises_each_head_first(lengths, heads, head_dim, splits, pad_rows):
    """``q_norm`` and ``k_norm`` inside the kernel = ``rms_norm`` of q and k, then the rest
    (head sizes 16 and 24: a head narrower than its tile is normalised over its own values)."""
    check_rope_decode(lengths, pad_rows, 4, heads[0], heads[1], head_dim, torch.float32, 1e-4, head_norms=True,
                      num_splits=splits, max_context=max(lengths))


def test_rope_decode_attention_rejects_mismatched_keys():
    kv, table, row_request, positions, slots, (q, k, v), cos_sin = rope_decode_case(
        [5], 0, 4, 4, 2, 16, torch.float32)
    with pytest.raises(InternalError, match=r"k and v must be \[1, 2, 16\]"):
        triton_decode.rope_decode_attention(q, k[:, :1], v[:, :1], cos_sin, positions, kv, 0,
                                            slots, table, row_request, 1.0, 4)


@FEW
@given(data=st.data(), lengths=st.lists(st.integers(1, 50), min_size=1, max_size=3),
       page_size=st.sampled_from([4, 16]), heads=heads_st, head_dim=st.sampled_from([16, 32]),
       pad_rows=st.integers(0, 2))
def test_extend_attention(data, lengths, page_size, heads, head_dim, pad_rows):
    cached = [data.draw(st.integers(0, n - 1)) for n in lengths]
    check_attention(triton_attention.extend_attention, lengths,
                    extend_rows(lengths, cached, pad_rows), page_size, heads[0], heads[1],
                    head_dim, torch.float32, 1e-4)


@FEW
@given(lengths=st.lists(st.integers(1, 90), min_size=1, max_size=3), window=st.integers(1, 40),
       splits=st.sampled_from([None, 1, 3, 8]), rope=st.booleans())
def test_decode_attention_in_a_sliding_window(lengths, window, splits, rope):
    """Each row sees its last ``window`` positions; the splits share them."""
    kwargs = dict(num_splits=splits, max_context=max(lengths), window=window)
    if rope:
        check_rope_decode(lengths, 1, 4, 4, 2, 16, torch.float32, 1e-4, **kwargs)
    else:
        check_attention(triton_decode.decode_attention, lengths, decode_rows(lengths, 1), 4, 4, 2,
                        16, torch.float32, 1e-4, **kwargs)


@FEW
@given(data=st.data(), lengths=st.lists(st.integers(1, 150), min_size=1, max_size=3),
       window=st.integers(1, 70))
def test_extend_attention_in_a_sliding_window(data, lengths, window):
    """Tiles whose rows' windows start in different key blocks, prefix hits included."""
    cached = [data.draw(st.integers(0, n - 1)) for n in lengths]
    check_attention(triton_attention.extend_attention, lengths, extend_rows(lengths, cached, 1),
                    4, 4, 2, 16, torch.float32, 1e-4, window=window)


def test_extend_long_request_spans_tiles_and_pages():
    lengths, cached = [150, 20, 3], [37, 0, 2]
    check_attention(triton_attention.extend_attention, lengths,
                    extend_rows(lengths, cached, 1), 4, 4, 2, 16, torch.float32, 1e-4)


def test_extend_tile_plan_never_mixes_requests():
    row_request = torch.tensor([0] * 5 + [2] * 17 + [1] * 1, device=DEVICE)
    plan = triton_attention.extend_tile_plan(row_request, max_runs=3, block_m=16)
    assert plan.first.tolist() == [0, 5, 21, 22, 23, 23]   # an unused tile starts at the end


@FEW
@given(runs=st.lists(st.integers(1, 70), min_size=1, max_size=6), block_m=st.sampled_from([16, 64]))
def test_extend_tile_plan_covers_every_row_once(runs, block_m):
    row_request = torch.tensor([r for r, n in enumerate(runs) for _ in range(n)], device=DEVICE)
    first = triton_attention.extend_tile_plan(row_request, len(runs), block_m).first.tolist()
    tiles = [(a, b) for a, b in zip(first, first[1:]) if b > a]
    assert [row for a, b in tiles for row in range(a, b)] == list(range(len(row_request)))
    assert all(b - a <= block_m and len(set(row_request[a:b].tolist())) == 1 for a, b in tiles)
    assert len(tiles) == sum(-(-n // block_m) for n in runs)


@FEW
@given(runs=st.lists(st.integers(1, 70), min_size=1, max_size=6), block_m=st.sampled_from([16, 64]))
def test_the_host_tile_plan_is_the_device_plan(runs, block_m):
    """``plan_extend``'s tiles, from the chunks' lengths, are the ones the device builds from
    ``row_request``: both grids are sized for the most tiles, and end with unused tiles."""
    row_request = torch.tensor([r for r, n in enumerate(runs) for _ in range(n)], device=DEVICE)
    device = triton_attention.extend_tile_plan(row_request, len(runs), block_m).first.tolist()
    host = attention_tiles(np.array(runs), block_m, tile_capacity(sum(runs), len(runs), block_m)).tolist()
    assert device == host and host[-1] == sum(runs)


@given(st.integers(0, 1 << 24))
def test_block_sizes_are_tritons_powers_of_two(n):
    import triton
    assert next_power_of_2(n) == triton.next_power_of_2(n)


def test_a_tile_plan_past_its_capacity_is_refused():
    """Cutting it would leave rows outside every tile: undefined output, no error."""
    with pytest.raises(InternalError, match="2 attention tiles do not fit a plan of 1"):
        attention_tiles(np.array([64, 64]), 64, 1)
    assert attention_tiles(np.array([64, 64]), 64, 3).tolist() == [0, 64, 128, 128]


def test_the_plan_of_no_chunks_tiles_its_padding_rows():
    """Captures and the startup's dry run walk a plan of no chunks: its tiles cover the
    padding rows, so those walks launch (and compile) the kernel real steps launch."""
    meta = plan_extend([], 70, 1, 4, 4, num_view_rows=8)
    assert meta.attention_tiles.tolist() == [0, 64, 70] and meta.view_attention_tiles.tolist() == [0, 8]


@FEW
@given(data=st.data(), lengths=st.lists(st.integers(1, 90), min_size=1, max_size=4),
       width=st.integers(1, 3), pad_rows=st.integers(0, 9), window=st.sampled_from([0, 7]))
def test_extend_attention_over_the_steps_plan(data, lengths, width, pad_rows, window):
    """The tiles ``plan_extend`` builds, over the token rows and over the decoder view
    (the rows an attention after the narrowing sees): every live row as the reference."""
    page_size, tile_rows, scale = 4, 16, 16 ** -0.5
    cached = [data.draw(st.integers(0, n - 1)) for n in lengths]
    kv, table = paged_setup(lengths, page_size, 2, 16)
    chunks = [ExtendChunk(tuple(range(n - c)), c, tuple(table[r, :-(-n // page_size)].tolist()),
                          data.draw(st.booleans())) for r, (n, c) in enumerate(zip(lengths, cached))]
    rows = sum(len(c.tokens) for c in chunks)
    table_rows = len(chunks) + 1 + data.draw(st.integers(0, 3))   # a table of fixed rows: empty tiles
    meta = to_device(plan_extend(chunks, rows + pad_rows, table_rows, table.shape[1], page_size,
                                 view_width=width, tile_rows=tile_rows), DEVICE)
    assert len(meta.attention_tiles) == tile_capacity(rows + pad_rows, table_rows - 1, tile_rows) + 1
    q = torch.randn(rows + pad_rows, 4, 16, device=DEVICE)
    for picked, tiles, live in ((slice(None), meta.attention_tiles, rows),
                                (meta.view_rows, meta.view_attention_tiles, meta.num_live_view_rows)):
        args = (q[picked], kv, 1, meta.block_tables, meta.row_request[picked], meta.positions[picked], scale)
        got = triton_attention.extend_attention(*args, page_size, window=window,
                                                plan=triton_attention.ExtendPlan(tiles, tile_rows))
        want = reference.attention(args[0], as_pages(kv, page_size), *args[2:], window)
        torch.testing.assert_close(got[:live], want[:live], atol=1e-4, rtol=1e-4)


def test_attention_rejects_bad_shapes():
    kv, table = paged_setup([4], 4, 2, 16)
    rows = decode_rows([4], 0)
    with pytest.raises(InternalError, match="multiple of kv heads"):
        triton_decode.decode_attention(torch.zeros(1, 3, 16, device=DEVICE), kv, 0, table,
                                       *rows, 1.0, 4)


@FEW
@given(tokens=st.integers(1, 12), kv_heads=st.sampled_from([1, 2, 3]),
       head_dim=st.sampled_from([8, 16, 20]))
def test_write_kv(tokens, kv_heads, head_dim):
    page_size, pages = 4, 8
    kv = torch.zeros(2, 2, pages * page_size, kv_heads, head_dim, device=DEVICE)
    fused = torch.randn(tokens, 3, kv_heads, head_dim, device=DEVICE)
    k, v = fused[:, 1], fused[:, 2]                     # strided views, as from a QKV split
    slots = torch.randperm((pages - 1) * page_size)[:tokens] + page_size
    slots[::3] = torch.arange(0, tokens, 3) % page_size  # padding rows into page 0
    slots = slots.to(DEVICE)
    want = kv.clone()
    reference.write_kv(k, v, as_pages(want, page_size), 1, slots)
    triton_cache.write_kv(k, v, kv, 1, slots)
    torch.testing.assert_close(kv[:, :, page_size:], want[:, :, page_size:], atol=0, rtol=0)


@FEW
@given(tokens=st.integers(1, 5), hidden=st.sampled_from([8, 40, 64]))
def test_norms(tokens, hidden):
    x, res = torch.randn(2, tokens, hidden, device=DEVICE)
    if tokens % 2:                                   # leading dims are flattened
        x, res = x[:, None], res[:, None]
    w = torch.randn(hidden, device=DEVICE)
    torch.testing.assert_close(triton_fused.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    got = triton_fused.add_rms_norm(x, res, w, 1e-6)
    want = reference.add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


@FEW
@given(tokens=st.integers(1, 5), inter=st.sampled_from([8, 24, 96]))
def test_silu_and_mul(tokens, inter):
    gate_up = torch.randn(tokens, 1, 2 * inter, device=DEVICE) * 3
    torch.testing.assert_close(triton_fused.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))


def check_rope(tokens, heads, kv_heads, head_dim, dtype, tol):
    cache = rope_table(head_dim, 4096)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, device=DEVICE).to(dtype)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    positions = torch.randint(0, 4096, (tokens,), device=DEVICE)
    slots = (torch.randperm(64)[:tokens] + 8).to(DEVICE)
    kv = torch.zeros(2, 2, 80, kv_heads, head_dim, device=DEVICE, dtype=dtype)
    want_kv = kv.clone()
    want = reference.rope_write_kv(q, k, v, cache, positions, as_pages(want_kv, 8), 1, slots)
    got = triton_fused.rope_and_write_kv(q, k, v, cache, positions, kv, 1, slots)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(kv.float(), want_kv.float(), atol=tol, rtol=tol)


@FEW
@given(tokens=st.integers(1, 6), heads=heads_st, head_dim=st.sampled_from([8, 16, 24]))
def test_rope_and_write_kv(tokens, heads, head_dim):
    check_rope(tokens, heads[0], heads[1], head_dim, torch.float32, 1e-5)


def test_cache_writes_take_a_group_s_column_of_slots():
    """With several cache groups each layer writes through its group's column of the
    stacked slots, a strided view: every writing kernel equals the reference."""
    tokens, kv_heads, head_dim, page_size = 5, 2, 8, 4
    stacked = (torch.randperm(6 * page_size)[:tokens * 2] + page_size).view(tokens, 2).to(DEVICE)
    column = stacked[:, 1]
    assert not column.is_contiguous()
    q = torch.randn(tokens, 4, head_dim, device=DEVICE)
    k, v = (torch.randn(tokens, kv_heads, head_dim, device=DEVICE) for _ in range(2))
    positions, table = torch.arange(tokens, device=DEVICE) + 3, rope_table(head_dim, 32)
    writes = [(lambda kv, slots: triton_cache.write_kv(k, v, kv, 1, slots),
               lambda kv, slots: reference.write_kv(k, v, as_pages(kv, page_size), 1, slots)),
              (lambda kv, slots: triton_fused.rope_and_write_kv(q, k, v, table, positions, kv, 1, slots),
               lambda kv, slots: reference.rope_write_kv(q, k, v, table, positions, as_pages(kv, page_size),
                                                         1, slots))]
    for kernel, ref in writes:
        got, want = (torch.zeros(2, 2, 8 * page_size, kv_heads, head_dim, device=DEVICE) for _ in range(2))
        kernel(got, column)
        ref(want, column.contiguous())
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    check_rope_decode([9, 30], 1, page_size, 4, kv_heads, 16, torch.float32, 1e-4, group_column=True)


def test_rope_matches_hf_rotate_half():
    """Same result as HF's apply_rotary_pos_emb with cos/sin = cat(freqs, freqs)."""
    head_dim, pos = 8, torch.tensor([3, 17], device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    emb = torch.cat([pos.float()[:, None] * inv_freq] * 2, -1)
    x = torch.randn(2, 1, head_dim, device=DEVICE)
    hf = x * emb.cos()[:, None] + torch.cat([-x[..., 4:], x[..., :4]], -1) * emb.sin()[:, None]
    kv = torch.zeros(1, 2, 8, 1, head_dim, device=DEVICE)
    cache = rope_table(head_dim, 32)
    got = triton_fused.rope_and_write_kv(x, x, x, cache, pos, kv, 0,
                                         torch.tensor([1, 2], device=DEVICE))
    torch.testing.assert_close(got, hf, atol=1e-5, rtol=1e-5)


@FEW
@given(rows=st.integers(1, 5), heads=st.integers(1, 4), half=st.integers(1, 40),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_apply_rotary_is_hf_rotate_half_bit_for_bit(rows, heads, half, dtype):
    """The reference's rotation by halves gives Hugging Face's ``x * cos + rotate_half(x) *
    sin`` exactly, in float32 and in bfloat16 (each op rounded alike)."""
    x = torch.randn(rows, heads, 2 * half).to(dtype)
    cos_sin = cos_sin_table(torch.rand(half), torch.arange(rows) * 7)
    cos, sin = (torch.cat((c, c), dim=-1).to(dtype)[:, None, :] for c in cos_sin.chunk(2, dim=-1))
    hf = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    assert torch.equal(apply_rotary(x, cos_sin), hf)


@FEW
@given(shape=st.sampled_from([(1, 8), (3, 64), (2, 3, 16), (5, 576)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_rms_norm_is_hf_rms_norm(shape, dtype):
    """Hugging Face's RMSNorm: float32 rows through torch's kernel (equal within rounding of
    the mean), 16-bit rows rounded before the weight as Hugging Face rounds them (equal)."""
    x, weight = torch.randn(shape).to(dtype) * 3, torch.randn(shape[-1]).to(dtype)
    h = x.float()
    hf = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    got = reference.rms_norm(x, weight, 1e-6)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, hf, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(got, hf)


@FEW
@given(m=st.sampled_from([1, 3, 16]), n=st.integers(1, 80), k=st.integers(1, 300),
       bias=st.booleans(), splits=st.sampled_from([None, 1, 3]))
def test_gemv(m, n, k, bias, splits):
    x = torch.randn(m, k, device=DEVICE)
    w = torch.randn(n, k, device=DEVICE)
    b = torch.randn(n, device=DEVICE) if bias else None
    config = None if splits is None else (32, 64, splits, 4, 2)
    got = triton_gemv.linear(x, w, b, config=config)
    torch.testing.assert_close(got, reference.linear(x, w, b), atol=1e-4, rtol=1e-4)


@FEW
@given(m=st.sampled_from([1, 5]), n=st.integers(1, 40), k=st.integers(1, 200),
       splits=st.sampled_from([1, 2]))
def test_gated_gemv_is_silu_mul_then_gemv(m, n, k, splits):
    """The MLP's activation fused into the down projection: same bits as the two kernels."""
    gate_up = torch.randn(m, 2 * k, device=DEVICE)
    w = torch.randn(n, k, device=DEVICE)
    config = (16, 64, splits, 4, 2)
    got = triton_gemv.linear(gate_up, w, config=config, gated=True)
    unfused = triton_gemv.linear(triton_fused.silu_and_mul(gate_up), w, config=config)
    assert torch.equal(got, unfused)
    want = reference.gated_linear(gate_up, w, None)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(InternalError, match=r"\[M, 2K\]"):
        triton_gemv.linear(gate_up[:, :k], w, gated=True)


@FEW
@given(m=st.sampled_from([1, 5]), n=st.integers(1, 40), k=st.integers(1, 200),
       residual=st.booleans(), splits=st.sampled_from([None, 1, 2]))
def test_norm_gemv_is_norm_then_gemv(m, n, k, residual, splits):
    """The norm feeding a projection, fused into its GEMV: the sum is exact, the output
    matches norm-then-linear (the squares are summed in another order). Rows of one tile
    (the default config, or k <= 64) take the read-once path."""
    x, res = torch.randn(2, m, k, device=DEVICE)
    norm_w, w = torch.randn(k, device=DEVICE), torch.randn(n, k, device=DEVICE)
    res = res if residual else None
    config = None if splits is None else (16, 64, splits, 4, 2)
    out, total = triton_gemv.norm_linear(x, res, norm_w, 1e-6, w, config=config)
    want_total = x + res if residual else x
    [want, *_] = reference.norm_linear(x, res, norm_w, 1e-6, w, None)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    assert (total is None) == (not residual)
    if residual:
        assert torch.equal(total, want_total)


@FEW
@given(m=st.sampled_from([1, 3, 16]), n=st.integers(1, 80), k=st.integers(65, 300), bias=st.booleans(),
       splits=st.sampled_from([2, 3, 4]), fused=st.sampled_from(["plain", "gated", "norm", "norm+residual"]))
def test_a_split_k_reduced_in_its_own_launch_is_the_reduction_kernels_to_the_bit(m, n, k, bias, splits, fused):
    """The last split of each column block sums the partials in split order, as
    ``_reduce_kernel`` does, then adds the bias: the same bits; the counters zeroed after."""
    x, res = torch.randn(2, m, 2 * k if fused == "gated" else k, device=DEVICE)
    w, norm_w = torch.randn(n, k, device=DEVICE), torch.randn(k, device=DEVICE)
    b = torch.randn(n, device=DEVICE) if bias else None
    counters = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    config = (16, 64, splits, 4, 2)

    def run(split_counters):
        if fused.startswith("norm"):
            residual = res if fused == "norm+residual" else None
            return triton_gemv.norm_linear(x, residual, norm_w, 1e-6, w, b, config, split_counters)[0]
        return triton_gemv.linear(x, w, b, config, fused == "gated", split_counters)
    assert torch.equal(run(counters), run(None))
    assert not counters.any()
    with pytest.raises(InternalError, match="one per column block"):
        run(counters[:triton.cdiv(n, 16) - 1] if n > 16 else counters.to(torch.int64))


def test_norm_gemv_rejects_a_wrong_norm_weight():
    with pytest.raises(InternalError, match=r"norm weight must be \[4\]"):
        triton_gemv.norm_linear(torch.zeros(1, 4), None, torch.zeros(3), 1e-6, torch.zeros(2, 4))


def test_gemv_rejects_large_m():
    with pytest.raises(InternalError, match="M 17"):
        triton_gemv.linear(torch.zeros(17, 4), torch.zeros(4, 4))


def gumbel(logits, temperature, top_k, seeds, block=16, positions=None):
    positions = torch.zeros(len(seeds), dtype=torch.int64) if positions is None else positions
    return triton_sampling.gumbel_argmax(logits.to(DEVICE), temperature.to(DEVICE),
                                         top_k.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE),
                                         block=block)


@pytest.mark.parametrize("on", ["triton", "sampler"])
def test_the_draw_writes_each_rows_token_into_its_seat_of_the_column(on):
    """Into ``column[seat]`` as the column's own ``index_copy_`` did; other seats untouched."""
    from tokenspeed.execution.sampler import SamplingTensors, gumbel_argmax
    rows, vocab = 3, 50
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    s = SamplingTensors(torch.ones(rows, device=DEVICE), torch.tensor([1, 0, 1], device=DEVICE),
                        torch.arange(rows, device=DEVICE), torch.tensor([4, 0, 2], device=DEVICE))
    positions, out = torch.zeros(rows, dtype=torch.int64, device=DEVICE), torch.empty(rows, dtype=torch.int64,
                                                                                      device=DEVICE)
    column = torch.full((6,), -1, dtype=torch.int64, device=DEVICE)
    if on == "triton":
        triton_sampling.gumbel_argmax(logits, s.temperature, s.top_k, s.seed, positions, out=out, block=16,
                                      column=triton_sampling.ColumnWrite(column, s.seat))
    else:   # the CPU's reference and the column's index_copy_
        out, column = out.cpu(), column.cpu()
        cpu_settings = SamplingTensors(*(t.cpu() for t in attrs.astuple(s, recurse=False)))
        gumbel_argmax(logits.cpu(), cpu_settings, positions.cpu(), out, column)
    assert out[0] == logits[0].argmax().item() and out[2] == logits[2].argmax().item()
    assert column.tolist() == [out[1].item(), -1, out[2].item(), -1, out[0].item(), -1]


@FEW
@given(rows=st.integers(1, 4), vocab=st.integers(1, 70), data=st.data())
def test_greedy_sampling_is_first_argmax(rows, vocab, data):
    """Integer logits make ties common: greedy rows must take the first maximum."""
    values = st.lists(st.integers(-3, 3), min_size=rows * vocab, max_size=rows * vocab)
    logits = torch.tensor(data.draw(values), dtype=torch.float32).view(rows, vocab)
    got = gumbel(logits, torch.ones(rows), torch.ones(rows, dtype=torch.int64),
                 torch.arange(rows))
    assert got.cpu().tolist() == logits.argmax(-1).tolist()


def test_sampling_follows_the_softmax_and_its_keys():
    """The kernel's draws follow the tempered softmax, as the torch reference's do (the
    two use different random streams, so they agree in distribution, not draw by draw);
    the noise is keyed by seed and position."""
    rows, probs = 256, torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().expand(rows, 4).contiguous()
    ones, sampled = torch.ones(rows), torch.zeros(rows, dtype=torch.int64)
    seeds = torch.randint(2**62, (rows,), generator=torch.Generator().manual_seed(0))
    tokens = gumbel(logits, ones, sampled, seeds, block=4).cpu()
    freq = torch.bincount(tokens, minlength=4) / rows
    torch.testing.assert_close(freq, probs, atol=0.1, rtol=0)     # 3.4 sd; fixed seeds: no flakes
    few = slice(0, 16)
    again = gumbel(logits[few], ones[few], sampled[few], seeds[few], block=4).cpu()
    assert torch.equal(tokens[few], again)
    other = gumbel(logits[few], ones[few], sampled[few], seeds[few] + 1, block=4).cpu()
    assert not torch.equal(tokens[few], other)
    positions = torch.arange(16)
    moved = gumbel(logits[few], ones[few], sampled[few], seeds[few], block=4, positions=positions)
    assert not torch.equal(moved.cpu(), tokens[few])               # the position keys the noise
    shifted = gumbel(logits[few], ones[few], sampled[few], seeds[few] - positions * POSITION_KEY,
                     block=4, positions=positions)
    assert torch.equal(shifted.cpu(), tokens[few])                 # key = seed + position * K
    reference = sample(logits, [RowSampling(ts.SamplingParams(), int(s)) for s in seeds],
                       torch.zeros(rows, dtype=torch.int64)).tokens
    torch.testing.assert_close(torch.bincount(reference, minlength=4) / rows, probs, atol=0.1, rtol=0)
    cold = gumbel(logits[few], torch.full((16,), 1e-6), sampled[few], seeds[few], block=4)
    assert (cold.cpu() == 3).all()                                # temperature -> 0 is argmax


def test_sampling_rejects_mismatched_settings():
    with pytest.raises(InternalError, match=r"top_k must be \[2\]"):
        triton_sampling.gumbel_argmax(torch.zeros(2, 5), torch.ones(2),
                                      torch.ones(3, dtype=torch.int64), torch.zeros(2),
                                      torch.zeros(2, dtype=torch.int64))


# --- GPU, bf16, real shapes -------------------------------------------------------------

REAL_HEADS = [(14, 2), (32, 8)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("heads", REAL_HEADS)
def test_gpu_decode_attention(heads):
    lengths = [1, 17, 300, 1000, 4096, 2049]
    check_attention(triton_decode.decode_attention, lengths, decode_rows(lengths, 2), 16,
                    heads[0], heads[1], 64, torch.bfloat16, 2e-2, max_context=4096)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("heads", REAL_HEADS)
@pytest.mark.parametrize("head_norms", [False, True], ids=["plain", "head_norms"])
def test_gpu_rope_decode_attention(heads, head_norms):
    check_rope_decode([1, 17, 300, 1000, 4096, 2049], 1, 16, heads[0], heads[1], 64,
                      torch.bfloat16, 2e-2, head_norms=head_norms, max_context=4096)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("heads", REAL_HEADS)
def test_gpu_extend_attention(heads):
    lengths, cached = [4096, 700, 33, 1], [0, 512, 17, 0]
    check_attention(triton_attention.extend_attention, lengths,
                    extend_rows(lengths, cached, 3), 16, heads[0], heads[1], 64,
                    torch.bfloat16, 2e-2)


@gpu
@pytest.mark.gpu
def test_gpu_decode_attention_cuda_graph():
    lengths = [5, 900, 4000]
    kv, table = paged_setup(lengths, 16, 2, 64, dtype=torch.bfloat16)
    row_request, positions = decode_rows(lengths, 1)
    q = torch.randn(len(positions), 14, 64, device="cuda", dtype=torch.bfloat16)
    args = (q, kv, 0, table, row_request, positions, 0.125, 16)
    triton_decode.decode_attention(*args, max_context=4096)          # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_decode.decode_attention(*args, max_context=4096)
    positions.copy_(torch.tensor([3, 37, 3999, 0], device="cuda"))
    graph.replay()
    want = reference.attention(q, as_pages(kv, 16), 0, table, row_request, positions, 0.125, 0)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.gpu
def test_gpu_fused_bf16():
    x, res = torch.randn(2, 7, 896, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(896, device="cuda", dtype=torch.bfloat16)
    got = triton_fused.add_rms_norm(x, res, w, 1e-6)
    want = reference.add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
    gate_up = torch.randn(7, 2 * 4864, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(triton_fused.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))
    check_rope(9, 14, 2, 64, torch.bfloat16, 2e-2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("k,n", [(896, 4864), (4864, 896), (2048, 8192), (896, 151936)])
def test_gpu_gemv(m, k, n):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    want = torch.nn.functional.linear(x.float(), w.float())
    got = triton_gemv.linear(x, w)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=2e-2)
    assert torch.equal(got, triton_gemv.linear(x, w))                      # deterministic


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
def test_gpu_gemv_cuda_graph(m):
    """Split K, reduced by a second launch or by the last split in its own: the same bits,
    replay after replay, and the counters zeroed."""
    x = torch.randn(m, 8192, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 8192, device="cuda", dtype=torch.bfloat16) / 90
    assert triton_gemv.choose_config(m, 256, 8192, 132)[2] > 1            # split-K path
    counters = torch.zeros(64, dtype=torch.int32, device="cuda")
    triton_gemv.linear(x, w)
    triton_gemv.linear(x, w, split_counters=counters)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_gemv.linear(x, w)
        merged = triton_gemv.linear(x, w, split_counters=counters)
    x.copy_(torch.randn_like(x))
    for _ in range(10):
        graph.replay()
        assert torch.equal(merged, out)
    torch.testing.assert_close(out.float(), x.float() @ w.float().T, atol=3e-2, rtol=2e-2)
    assert not counters.any()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
def test_gpu_gated_gemv_is_exact(m):
    gate_up = torch.randn(m, 2 * 4864, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(896, 4864, device="cuda", dtype=torch.bfloat16) / 70
    unfused = triton_gemv.linear(triton_fused.silu_and_mul(gate_up), w)
    assert torch.equal(triton_gemv.linear(gate_up, w, gated=True), unfused)


@gpu
@pytest.mark.gpu
def test_gpu_sampling_in_a_graph():
    """Greedy rows are argmax at the real vocabulary; a replay at new positions draws new
    noise, one at the same positions the same tokens."""
    rows, vocab = 32, 151936
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    top_k = torch.tensor([1, 0] * (rows // 2), device="cuda")
    temperature = torch.ones(rows, device="cuda")
    seeds, positions = torch.arange(rows, device="cuda"), torch.zeros(rows, dtype=torch.int64, device="cuda")
    out = torch.zeros(rows, 2, dtype=torch.int64, device="cuda")
    triton_sampling.gumbel_argmax(logits, temperature, top_k, seeds, positions, out=out[:, 0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_sampling.gumbel_argmax(logits, temperature, top_k, seeds, positions, out=out[:, 0])
    graph.replay()
    first = out[:, 0].clone()
    assert torch.equal(first[::2], logits[::2].float().argmax(-1))
    graph.replay()
    assert torch.equal(out[:, 0], first)
    positions += 1
    graph.replay()
    assert torch.equal(out[::2, 0], first[::2]) and not torch.equal(out[1::2, 0], first[1::2])


def test_extend_tile_plan_stays_inside_its_buffer():
    """Rows of two requests interleaved (outside the contract): 80 runs, room for 2 + 2."""
    plan = triton_attention.extend_tile_plan(torch.tensor([0, 1] * 40, device=DEVICE), max_runs=2)
    assert plan.first.tolist() == [0, 1, 2, 3, 80]


@settings(max_examples=25, deadline=None)
@given(lead=st.lists(st.integers(1, 5), min_size=0, max_size=2), rows=st.integers(1, 40),
       features=st.integers(1, 24), threads=st.sampled_from([1, 2, 3, 4]), with_bias=st.booleans())
def test_the_cpu_linear_in_slabs_is_the_plain_product(lead, rows, features, threads, with_bias):
    """The CPU's dense linear splits the weight's rows into a slab per torch thread (one
    batched product) when they divide evenly: the same ``x @ w.T + b`` for any leading
    shape, thread count and row count, slabs or not."""
    g = torch.Generator().manual_seed(rows * 31 + features)
    x = torch.randn(*lead, 3, features, generator=g)
    w, b = torch.randn(rows, features, generator=g), torch.randn(rows, generator=g)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = reference.linear(x, w, b if with_bias else None)
    finally:
        torch.set_num_threads(previous)
    assert got.shape == (*lead, 3, rows)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b if with_bias else None),
                               rtol=1e-5, atol=1e-5)
