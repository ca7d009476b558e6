"""``tokenspeed::decode_layer``: the one-launch layer kernel against the ops it fuses, and
the pass that fuses them (``fuse_decode_layers``).

On the CPU the kernel runs under the Triton interpreter as a grid of one program (every
barrier passed at once), in float32 and float16 (the interpreter's bfloat16 products are
not bfloat16's); ``gpu`` tests run the whole grid in bfloat16.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import given, settings, strategies as st  # noqa: E402

import tokenspeed as ts  # noqa: E402
from tokenspeed import stages  # noqa: E402
from tokenspeed.api.model_source import as_model  # noqa: E402
from tokenspeed.backends.kernels import cuda, layer_steps, reference, triton_layer  # noqa: E402
from tokenspeed.backends.kernels.layer_steps import layer_kernel_refuses  # noqa: E402
from tokenspeed.ir.ops import DECODE_LAYER  # noqa: E402
from tokenspeed.ir.rope import cos_sin_table  # noqa: E402
from tests import hf_models  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def layer_case(hidden, inter, heads, kv_heads, head_dim, lengths, page_size, dtype, device=DEVICE, seed=0):
    """Weights, a paged cache whose requests own shuffled pages, and a decode row per
    request at its last position; the arguments of ``decode_layer`` after ``x, residual``."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.1):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)
    need = [-(-n // page_size) for n in lengths]
    order = torch.randperm(sum(need) + 2, generator=gen) + 1
    table = torch.zeros(len(lengths), max(need) + 1, dtype=torch.int32)
    used = 0
    for r, count in enumerate(need):
        table[r, :count] = order[used:used + count]
        used += count
    kv = rnd(1, 2, sum(need) + 3, page_size, kv_heads, head_dim, scale=1.0)
    positions = torch.tensor([n - 1 for n in lengths], device=device)
    slots = (table[torch.arange(len(lengths)), positions.cpu() // page_size].long() * page_size
             + positions.cpu() % page_size).to(device)
    inv_freq = 1000.0 ** -(torch.arange(0, head_dim, 2) / head_dim)
    cos_sin = cos_sin_table(inv_freq, torch.arange(max(lengths) + 1)).to(dtype).to(device)
    weights = (1 + rnd(hidden), rnd((heads + 2 * kv_heads) * head_dim, hidden), rnd(hidden, heads * head_dim),
               1 + rnd(hidden), rnd(2 * inter, hidden), rnd(hidden, inter))
    return (*weights, 1e-5, cos_sin, positions, kv, 0, slots, table.to(device),
            torch.arange(len(lengths), dtype=torch.int32, device=device), head_dim ** -0.5, heads, kv_heads)


def run_both(args, x, residual, kernel=triton_layer.decode_layer, **options):
    """(kernel's outputs and cache, the ops' outputs and cache), from equal caches."""
    counters = torch.zeros(8, dtype=torch.int32, device=x.device)
    kv = args[9]
    mine = list(args)
    mine[9] = kv.clone()
    expected = layer_steps.decode_layer_by_ops(reference if x.device.type == "cpu" else cuda, x, residual, *args)
    got = kernel(x, residual, *mine, counters, **options)
    assert not counters.any(), "the barriers left their counters set"
    return (got, mine[9]), (expected, kv)


def assert_close(got, expected, dtype):
    tol = 2e-5 if dtype == torch.float32 else 4e-3
    for g, e in zip(got, expected):
        scale = e.float().abs().max().item() + 1e-6
        assert (g.float() - e.float()).abs().max().item() <= tol * max(1.0, scale), (g, e)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=3), page_size=st.sampled_from([4, 16]),
       splits=st.sampled_from([1, 2, 4]), with_residual=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16]))
def test_the_layer_kernel_computes_the_ops_it_fuses(lengths, page_size, splits, with_residual, dtype):
    """Rows at positions across page and split boundaries, a first layer (no residual) and
    a later one: the two outputs and the cache (the row's key and value written) agree."""
    if dtype == torch.float16 and HAS_CUDA:
        dtype = torch.bfloat16
    args = layer_case(96, 160, 6, 2, 16, lengths, page_size, dtype)
    gen = torch.Generator().manual_seed(len(lengths))
    x = torch.randn(len(lengths), 96, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(len(lengths), 96, generator=gen).to(dtype).to(DEVICE) if with_residual else None
    (got, kv), (expected, kv_expected) = run_both(args, x, residual, splits=splits)
    assert_close(got, expected, dtype)
    assert_close([kv], [kv_expected], dtype)


def test_an_odd_shape_takes_several_tiles_a_program():
    """A hidden size and head count off the powers of two, one program walking every tile
    of each phase (the interpreter's grid), and several rows of one request's pages."""
    args = layer_case(80, 200, 5, 1, 32, [33, 9], 8, torch.float32, seed=3)
    x = torch.randn(2, 80).to(DEVICE)
    (got, kv), (expected, kv_expected) = run_both(args, x, torch.randn(2, 80).to(DEVICE), splits=2)
    assert_close(got, expected, torch.float32)
    assert_close([kv], [kv_expected], torch.float32)


def test_a_cache_groups_column_of_slots_is_read_by_its_stride():
    """A model of several cache groups hands each layer its group's column of the slot
    mapping (stride 2 here): each row's key and value reach that row's slot."""
    args = list(layer_case(96, 160, 6, 2, 16, [20, 35], 4, torch.float32, seed=5))
    slots = args[11]
    args[11] = torch.stack([slots, torch.zeros_like(slots)], 1)[:, 0]   # the other group: the null slot
    assert args[11].stride(0) == 2
    x = torch.randn(2, 96).to(DEVICE)
    (got, kv), (expected, kv_expected) = run_both(tuple(args), x, None, splits=2)
    assert_close(got, expected, torch.float32)
    assert_close([kv], [kv_expected], torch.float32)


def test_the_kernel_refuses_a_missing_counter_buffer():
    args = layer_case(96, 160, 6, 2, 16, [5], 4, torch.float32)
    with pytest.raises(Exception, match="split_counters"):
        triton_layer.decode_layer(torch.zeros(1, 96, device=DEVICE), None, *args, None)


def test_tiles_and_splits_follow_the_shape():
    assert triton_layer.tile_rows(576, 576, 132, 8192, padded=1024) == 8     # one tile a program
    assert triton_layer.tile_rows(2048, 8192, 132, 8192) == 1                # within the budget
    assert triton_layer.choose_splits(1, 3, 4096, 132, 16 * 64) == 8
    assert triton_layer.choose_splits(8, 8, 4096, 132, 32 * 64) == 2          # the grid filled once
    assert triton_layer.choose_splits(1, 3, 200, 132, 16 * 64) == 1
    assert triton_layer.choose_splits(1, 8, 8192, 132, 32 * 128) == 4         # the merge's tile
    assert layer_kernel_refuses(576, 1536, 9, 3, 64) is None
    assert "head_dim 80" in layer_kernel_refuses(576, 1536, 9, 3, 80)
    assert "intermediate" in layer_kernel_refuses(8192, 28672, 64, 8, 128)


def _decode_ir(variant: str, dtype=torch.bfloat16):
    return stages.trace(as_model(str(hf_models.checkpoint(variant)), dtype, "cpu")).lower("decode")


def test_the_pass_fuses_each_llama_layer():
    lowered = _decode_ir("llama")
    nodes = list(lowered.segments[0].graph_module.graph.nodes)
    layers = [n for n in nodes if n.target == DECODE_LAYER]
    assert [n.args[12] for n in layers] == [0, 1]
    assert not any(str(n.target).startswith(("tokenspeed.norm_linear", "tokenspeed.gated_linear",
                                             "tokenspeed.rope_decode_attention")) for n in nodes)
    assert layers[0].args[1] is None and layers[1].args[0].args == (layers[0], 0)
    assert "tokenspeed.decode_layer(" in lowered.as_text() and "fuse_decode_layers" in \
        [name for name, _ in lowered.history]


@pytest.mark.parametrize("variant, dtype, reason", [("qwen2", torch.bfloat16, "a bias"),
                                                    ("qwen3", torch.bfloat16, "head norms"),
                                                    ("mistral", torch.bfloat16, "a sliding window"),
                                                    ("llama", torch.float32, "weights not 16-bit")])
def test_a_layer_the_kernel_cannot_take_stays_unfused_and_says_why(variant, dtype, reason):
    lowered = _decode_ir(variant, dtype)
    assert not any(n.target == DECODE_LAYER for n in lowered.segments[0].graph_module.graph.nodes)
    assert f"unfused={reason}" in lowered.as_text()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_layer_kernel_on_a_gpu_at_the_default_models_shape(rows):
    """The whole grid of one program an SM, barriers and all, against the CUDA ops; twenty
    more launches give the same bits and leave the counters zero."""
    args = layer_case(576, 1536, 9, 3, 64, [512 + 37 * r for r in range(rows)], 16, torch.bfloat16)
    x = torch.randn(rows, 576, device="cuda").to(torch.bfloat16)
    residual = torch.randn(rows, 576, device="cuda").to(torch.bfloat16)
    (got, kv), (expected, kv_expected) = run_both(args, x, residual)
    assert_close(got, expected, torch.bfloat16)
    assert_close([kv], [kv_expected], torch.bfloat16)
    counters = torch.zeros(2, dtype=torch.int32, device="cuda")
    mine = list(args)
    mine[9] = kv
    for _ in range(20):
        again = triton_layer.decode_layer(x, residual, *mine, counters)
        assert all(torch.equal(a, g) for a, g in zip(again, got)) and not counters.any()


@gpu
@pytest.mark.gpu
def test_fused_decoding_keeps_the_unfused_tokens_on_a_gpu(monkeypatch):
    """Greedy tokens through ``ts.LLM`` (captured graphs) with the layer kernel
    (``TOKENSPEED_LAYER_KERNEL=1``) and with the ops it fuses, on margin-checked prompts."""
    path = str(hf_models.checkpoint("llama"))
    prompts = hf_models.make_prompts([5, 11, 30], seed=4)
    params = ts.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    monkeypatch.setenv("TOKENSPEED_LAYER_KERNEL", "1")
    fused = ts.LLM(path, dtype=torch.bfloat16).generate(prompts, params)
    monkeypatch.setenv("TOKENSPEED_LAYER_KERNEL", "0")
    plain = ts.LLM(path, dtype=torch.bfloat16).generate(prompts, params)
    assert [o.token_ids for o in fused] == [o.token_ids for o in plain]
