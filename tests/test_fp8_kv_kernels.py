"""The FP8 KV cache's kernels: every Triton kernel that writes or reads the pool against
the torch reference over a float8 pool with non-unit scales (``kv_fp8`` states the rule).

Under the Triton interpreter (triton 3.9) a float32 -> float8e4nv conversion rounds wrongly
when rounding carries into the next exponent (7.79 becomes 4.0, not 8.0); GPUs round
right. So the interpreted write tests store values that sit exactly on the e4m3 grid
times the scale (no rounding happens: the kernels' conversion is still the one they run),
and a GPU test writes random values.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_kernels import DEVICE, as_pages, decode_rows, extend_rows, gpu, paged_setup  # noqa: E402
from tokenspeed.backends.kernels import reference, triton_attention, triton_cache  # noqa: E402
from tokenspeed.backends.kernels import triton_decode, triton_fused  # noqa: E402

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.5, 2.0      # powers of two: x * scale and x / scale are exact


def on_grid(shape, scale: float, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Values an FP8 cache with ``scale`` stores exactly (no rounding), some of them past
    its range (+-448 * scale, where it saturates)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 48).clamp(-448, 448).to(FP8).float()
    x.view(-1)[::7] = 1000.0
    x.view(-1)[3::7] = -1000.0
    return (x * scale).to(dtype).to(DEVICE)


def fp8_pool(layers, slots, kv_heads, head_dim) -> torch.Tensor:
    return torch.zeros(layers, 2, slots, kv_heads, head_dim, dtype=FP8, device=DEVICE)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def identity_rotation(head_dim: int, positions: int) -> torch.Tensor:
    """A ``cos_sin`` table that rotates nothing: rotated keys stay on the grid."""
    return torch.cat([torch.ones(positions, head_dim // 2), torch.zeros(positions, head_dim // 2)],
                     -1).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_keys_and_values_over_their_scales(dtype):
    tokens, kv_heads, head_dim, page_size = 9, 2, 16, 4
    k = on_grid((tokens, kv_heads, head_dim), K_SCALE, 1, dtype)
    v = on_grid((tokens, kv_heads, head_dim), V_SCALE, 2, dtype)
    slots = (torch.randperm(7 * page_size)[:tokens] + page_size).to(DEVICE)
    got, want = fp8_pool(2, 8 * page_size, kv_heads, head_dim), fp8_pool(2, 8 * page_size, kv_heads, head_dim)
    triton_cache.write_kv(k, v, got, 1, slots, K_SCALE, V_SCALE)
    reference.write_kv(k, v, as_pages(want, page_size), 1, slots, K_SCALE, V_SCALE)
    assert same_bytes(got, want)
    stored = want[1, 0, slots].float()
    assert torch.equal(stored, (k.float() / K_SCALE).clamp(-448, 448)) and stored.abs().max() == 448


def test_rope_and_write_kv_stores_the_rotated_keys_over_their_scale():
    tokens, heads, kv_heads, head_dim = 6, 4, 2, 16
    q = torch.randn(tokens, heads, head_dim, device=DEVICE)
    k = on_grid((tokens, kv_heads, head_dim), K_SCALE, 3)
    v = on_grid((tokens, kv_heads, head_dim), V_SCALE, 4)
    positions = torch.randint(0, 64, (tokens,), device=DEVICE)
    slots = (torch.randperm(60)[:tokens] + 4).to(DEVICE)
    table = identity_rotation(head_dim, 64)
    got, want = fp8_pool(2, 64, kv_heads, head_dim), fp8_pool(2, 64, kv_heads, head_dim)
    q_got = triton_fused.rope_and_write_kv(q, k, v, table, positions, got, 1, slots, K_SCALE, V_SCALE)
    q_want = reference.rope_write_kv(q, k, v, table, positions, as_pages(want, 4), 1, slots, K_SCALE, V_SCALE)
    torch.testing.assert_close(q_got, q_want)
    assert same_bytes(got, want) and want[1].float().abs().max() == 448


def fp8_cache(lengths, page_size, kv_heads, head_dim):
    kv, table = paged_setup(lengths, page_size, kv_heads, head_dim)
    return (kv * 8).to(FP8), table


def check_fp8_attention(fn, lengths, rows, page_size, heads, kv_heads, head_dim, window=0, **kwargs):
    """The kernel over an FP8 pool with non-unit scales equals the reference."""
    kv, table = fp8_cache(lengths, page_size, kv_heads, head_dim)
    row_request, positions = rows
    q = torch.randn(len(positions), heads, head_dim, device=DEVICE)
    scale = head_dim ** -0.5
    got = fn(q, kv, 1, table, row_request, positions, scale, page_size, window=window, k_scale=K_SCALE,
             v_scale=V_SCALE, **kwargs)
    want = reference.attention(q, as_pages(kv, page_size), 1, table, row_request, positions, scale, window,
                               K_SCALE, V_SCALE)
    live = len(lengths) if fn is triton_decode.decode_attention else len(positions)
    torch.testing.assert_close(got[:live], want[:live], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("splits,window", [(1, 0), (3, 0), (3, 5)])
def test_decode_attention_reads_an_fp8_pool(splits, window):
    lengths = [7, 40, 19]
    check_fp8_attention(triton_decode.decode_attention, lengths, decode_rows(lengths, 1), 4, 4, 2, 16,
                        window=window, num_splits=splits)


@pytest.mark.parametrize("window", [0, 6])
def test_extend_attention_reads_an_fp8_pool(window):
    lengths, cached = [12, 30], [5, 0]
    check_fp8_attention(triton_attention.extend_attention, lengths, extend_rows(lengths, cached, 1), 4, 4, 2,
                        16, window=window)


@pytest.mark.parametrize("splits", [1, 3])
def test_rope_decode_attention_writes_and_reads_an_fp8_pool(splits):
    """The row's own key, quantized as the cache stores it, is attended from registers."""
    lengths, page_size, heads, kv_heads, head_dim = [9, 30], 4, 4, 2, 16
    kv, table = fp8_cache(lengths, page_size, kv_heads, head_dim)
    row_request, positions = decode_rows(lengths, 0)
    slots = table[row_request, positions // page_size].long() * page_size + positions % page_size
    q = torch.randn(len(lengths), heads, head_dim, device=DEVICE)
    k = on_grid((len(lengths), kv_heads, head_dim), K_SCALE, 5)
    v = on_grid((len(lengths), kv_heads, head_dim), V_SCALE, 6)
    cos_sin, want_kv = identity_rotation(head_dim, 64), kv.clone()
    args = (table, row_request, head_dim ** -0.5)
    got = triton_decode.rope_decode_attention(q, k, v, cos_sin, positions, kv, 1, slots, *args, page_size,
                                              num_splits=splits, k_scale=K_SCALE, v_scale=V_SCALE)
    want = reference.rope_decode_attention(q, k, v, cos_sin, positions, as_pages(want_kv, page_size), 1, slots,
                                           *args, 0, K_SCALE, V_SCALE)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert same_bytes(kv, want_kv)


def test_a_pool_of_the_model_s_dtype_ignores_the_scales():
    """As vLLM with ``kv_cache_dtype="auto"``: the scales are a float8 pool's."""
    lengths, page_size = [6, 13], 4
    kv, table = paged_setup(lengths, page_size, 2, 8)
    row_request, positions = decode_rows(lengths, 0)
    slots = table[row_request, positions // page_size].long() * page_size + positions % page_size
    q, k, v = torch.randn(2, 4, 8, device=DEVICE), *(torch.randn(2, 2, 8, device=DEVICE) for _ in range(2))
    args = (table, row_request, positions, 0.3, page_size)
    for write in (triton_cache.write_kv, lambda *a: reference.write_kv(a[0], a[1], as_pages(a[2], page_size), *a[3:])):
        scaled, plain = kv.clone(), kv.clone()
        write(k, v, scaled, 1, slots, K_SCALE, V_SCALE)
        write(k, v, plain, 1, slots)
        assert torch.equal(scaled, plain)
    for attend in (triton_decode.decode_attention, triton_attention.extend_attention):
        assert torch.equal(attend(q, kv, 1, *args, k_scale=K_SCALE, v_scale=V_SCALE), attend(q, kv, 1, *args))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_write_kernels_round_random_values_as_torch_does(dtype):
    """Off the grid: the device's conversion rounds to nearest as torch's does (one e4m3
    step apart at most where the division rounds differently)."""
    tokens, heads, kv_heads, head_dim = 64, 8, 2, 128
    q, k, v = (torch.randn(tokens, h, head_dim, device="cuda").mul(300).to(dtype) for h in (heads, kv_heads, kv_heads))
    slots, positions = torch.randperm(512, device="cuda")[:tokens] + 16, torch.arange(tokens, device="cuda")
    table = identity_rotation(head_dim, tokens)
    writes = [(lambda kv: triton_cache.write_kv(k, v, kv, 1, slots, K_SCALE, V_SCALE),
               lambda kv: reference.write_kv(k, v, as_pages(kv, 16), 1, slots, K_SCALE, V_SCALE)),
              (lambda kv: triton_fused.rope_and_write_kv(q, k, v, table, positions, kv, 1, slots, K_SCALE, V_SCALE),
               lambda kv: reference.rope_write_kv(q, k, v, table, positions, as_pages(kv, 16), 1, slots, K_SCALE,
                                                  V_SCALE))]
    for kernel, ref in writes:
        got, want = fp8_pool(2, 544, kv_heads, head_dim), fp8_pool(2, 544, kv_heads, head_dim)
        kernel(got)
        ref(want)
        assert (got.view(torch.uint8) == want.view(torch.uint8)).float().mean() > 0.999
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -3, atol=2 ** -9)
