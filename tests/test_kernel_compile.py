"""The Triton kernels compile for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter runs kernel bodies as Python, so code the compiler rejects can pass there:
e.g. Triton compiles the statements after a ``return`` inside a constexpr branch too.
Compiling ahead of time for sm_90 catches that before a GPU run does. The compile runs in
a child process, since the tests import the kernels in interpreter mode. Skipped on CUDA
machines, which compile and run every kernel in the GPU tests.
"""

import sys

import pytest
import torch

from sm90 import assert_compiles, compile_sm90

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="GPU tests compile for real")


def gemv_variants():
    from tokenspeed.backends.kernels import triton_gemv
    names = triton_gemv._gemv_kernel.arg_names
    signature = {**{n: "*bf16" for n in names[:6]}, "out_ptr": "*fp32",
                 **{n: "i32" for n in names[7:15]}, "eps": "fp32", "fin_ptr": "*bf16", "cnt_ptr": "*i32",
                 "stride_fm": "i32"}
    for rows in (1, 16):
        for fused in ("plain", "gated", "norm", "norm+residual", "norm+residual one tile", "merged"):
            flags = dict(HAS_BIAS=False, GATED=fused == "gated", NORM=fused.startswith("norm"),
                         HAS_RES="residual" in fused, ONE_TILE=fused.endswith("one tile"),
                         BLOCK_M=rows, BLOCK_N=4 if rows == 1 else 64,
                         BLOCK_K=1024 if rows == 1 else 128,
                         PRECISION="tf32", USE_PDL=True, MERGE=fused == "merged", MERGE_BIAS=fused == "merged")
            ptx = compile_sm90(triton_gemv._gemv_kernel, signature, flags).asm["ptx"]
            assert ("atom.global.gpu.acq_rel.add" in ptx) == (fused == "merged")


CACHES = ("*bf16", "*fp8e4nv")   # a 16-bit KV pool and an FP8 one


def decode_kernels():
    """Decode attention with and without the fused rotary, one split and several."""
    from tokenspeed.backends.kernels import triton_decode
    names = triton_decode._decode_kernel.arg_names
    pointers = dict(q_ptr="*bf16", bt_ptr="*i32", req_ptr="*i64",
                    pos_ptr="*i64", out_ptr="*bf16", mid_o_ptr="*fp32", mid_lse_ptr="*fp32",
                    kn_ptr="*bf16", vn_ptr="*bf16", cs_ptr="*fp32", slot_ptr="*i64", qn_ptr="*bf16", kw_ptr="*bf16")
    signature = {**pointers, "qk_scale": "fp32", "k_scale": "fp32", "v_scale": "fp32", "window": "i32",
                 "norm_eps": "fp32", **{n: "i32" for n in names if n.startswith("stride")}}
    for rope, splits, cache in [(r, s, c) for r in (False, True) for s in (1, 8) for c in CACHES]:
        flags = dict(NUM_HEADS=32, GROUP=4, HEAD_DIM=64, PAGE_SIZE=16, NUM_SPLITS=splits,
                     BLOCK_G=16, BLOCK_N=64, BLOCK_D=64, PRECISION="tf32", ROPE=rope,
                     Q_NORM=rope, K_NORM=rope, USE_PDL=True)   # with the rotary, Qwen3's head norms too
        ptx = compile_sm90(triton_decode._decode_kernel, {**signature, "k_ptr": cache, "v_ptr": cache},
                           flags).asm["ptx"]
        assert "griddepcontrol.wait" in ptx
    merge = compile_sm90(triton_decode._combine_kernel, dict(
        mid_o_ptr="*fp32", mid_lse_ptr="*fp32", pos_ptr="*i64", out_ptr="*bf16", window="i32",
        stride_or="i32", stride_oh="i32"),
        dict(NUM_HEADS=32, HEAD_DIM=64, NUM_SPLITS=8, BLOCK_N=64, BLOCK_S=8, BLOCK_D=64, USE_PDL=True), 2)
    assert "griddepcontrol.wait" in merge.asm["ptx"]


def sampling_kernels():
    from tokenspeed.backends.kernels import triton_sampling as s
    best = compile_sm90(s._block_best_kernel, dict(
        logits_ptr="*bf16", temp_ptr="*fp32", top_k_ptr="*i64", seed_ptr="*i64",
        pos_ptr="*i64", best_val_ptr="*fp32", best_idx_ptr="*i32", vocab="i32",
        stride_row="i32", num_blocks="i32"),
        dict(MIN_T=1e-5, KEY=s.POSITION_KEY, BLOCK=4096, USE_PDL=True), 8)
    for column in (False, True):   # the tokens into the token column's seats too
        row = compile_sm90(s._row_best_kernel, dict(
            best_val_ptr="*fp32", best_idx_ptr="*i32", out_ptr="*i64", num_blocks="i32", stride_out="i32",
            col_ptr="*i64", seat_ptr="*i64"), dict(BLOCKS=64, USE_PDL=True, COLUMN=column), 1)
        assert "griddepcontrol.wait" in best.asm["ptx"] and row.asm["ptx"]


def extend_kernels():
    """Extend attention and the device tile plan it reads."""
    from tokenspeed.backends.kernels import triton_attention as a
    plan = compile_sm90(a._tile_plan_kernel, dict(req_ptr="*i64", first_ptr="*i32", rows="i32",
                                                  max_tiles="i32"), dict(BLOCK_M=64, BLOCK=1024))
    names = a._extend_kernel.arg_names
    signature = {**dict(q_ptr="*bf16", bt_ptr="*i32", req_ptr="*i64",
                        pos_ptr="*i64", out_ptr="*bf16", tile_first_ptr="*i32", qk_scale="fp32",
                        v_scale="fp32", window="i32"),
                 **{n: "i32" for n in names if n.startswith("stride")}}
    for cache in CACHES:
        extend = compile_sm90(a._extend_kernel, {**signature, "k_ptr": cache, "v_ptr": cache}, dict(
            GROUP=4, GROUP_P=4, HEAD_DIM=64, PAGE_SIZE=16, BLOCK_M=64, BLOCK_N=a.extend_block_n(64), BLOCK_D=64,
            PRECISION="tf32",
            USE_PDL=True))
        assert plan.asm["ptx"] and "griddepcontrol.wait" in extend.asm["ptx"]


def cache_writes():
    """The cache writes, into a 16-bit pool and into an FP8 one (converted in the kernel)."""
    from tokenspeed.backends.kernels import triton_cache, triton_fused
    scales = dict(k_scale="fp32", v_scale="fp32", stride_sm="i32")
    for cache in CACHES:
        pointers = dict(k_ptr="*bf16", v_ptr="*bf16", k_cache_ptr=cache, v_cache_ptr=cache, slot_ptr="*i64")
        write = compile_sm90(triton_cache._write_kv_kernel, {**pointers, **scales, **{
            n: "i32" for n in triton_cache._write_kv_kernel.arg_names if n.startswith("stride_")}},
            dict(NUM_HEADS=8, HEAD_DIM=64, BLOCK_H=8, BLOCK_D=64, USE_PDL=True))
        rope = compile_sm90(triton_fused._rope_kv_kernel, {
            **pointers, **scales, "q_ptr": "*bf16", "cache_ptr": "*fp32", "pos_ptr": "*i64", "q_out_ptr": "*bf16",
            **{n: "i32" for n in triton_fused._rope_kv_kernel.arg_names if n.startswith("stride_")}},
            dict(NUM_Q=32, NUM_KV=8, HALF=32, BLOCK_Q=32, BLOCK_KV=8, BLOCK_HALF=32, USE_PDL=True))
        converts = ("cvt.rn.satfinite.e4m3x2.f32" in write.asm["ptx"]) + ("cvt.rn.satfinite.e4m3x2.f32" in
                                                                         rope.asm["ptx"])
        assert converts == (2 if cache == "*fp8e4nv" else 0)


def test_kernels_compile_for_sm90():
    """Every check in one child (one start of torch and Triton); a failure's traceback
    names its check."""
    assert_compiles([__file__, "gemv_variants", "decode_kernels", "sampling_kernels", "extend_kernels",
                     "cache_writes"])


def test_the_precompile_marker_names_the_variant_set(tmp_path, monkeypatch):
    import attrs
    from tokenspeed.backends.kernels.precompile import Variant, compiled_before, mark_compiled
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    gemv = Variant("tokenspeed.backends.kernels.triton_gemv", "_gemv_kernel", '{"n": 1}', "src1")
    norm = Variant("tokenspeed.backends.kernels.triton_fused", "_rms_norm_kernel", "{}", "src2")
    assert not compiled_before([gemv, norm])
    mark_compiled([norm, gemv, gemv])
    assert compiled_before([gemv, norm])
    assert not compiled_before([gemv])  # another set
    assert not compiled_before([gemv, attrs.evolve(norm, source="src3")])  # changed source
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert not compiled_before([gemv, norm])  # the marker lives in the cache it describes


def test_the_dry_run_skips_every_launch_and_records_only_variants_not_compiled_here(monkeypatch):
    """Inside the dry run every launch reaches the hook and is skipped (True), a variant
    compiled earlier in this process too: it would read what a skipped kernel left
    unwritten. Only the others are recorded for the workers; the compiled variants are
    back after it."""
    import types
    from triton import knobs
    from triton.runtime.jit import JITFunction
    from tokenspeed.backends.kernels import precompile

    def kernel(x):
        pass
    fn = JITFunction(kernel)
    module = types.ModuleType("tokenspeed.backends.kernels.a_test_kernel")
    module.kernel = fn
    monkeypatch.setitem(sys.modules, module.__name__, module)
    compiled = object()
    fn.device_caches[0] = ({"compiled key": compiled}, {}, None, None, None)   # as a launch leaves it
    info = types.SimpleNamespace(module=module.__name__, name="kernel", jit_function=fn)

    def launch(key):
        return knobs.runtime.jit_cache_hook(key=key, fn=info, compile={"specialization_data": key})
    assert precompile.dry_run_possible()
    with precompile.dry_run() as variants:
        assert not fn.device_caches   # set aside: a launch misses, so it reaches the hook
        assert launch("compiled key") is True and launch("new key") is True
    assert [v.specialization for v in variants] == ["new key"]
    assert fn.device_caches[0][0] == {"compiled key": compiled}
    hook = knobs.runtime.jit_cache_hook
    with pytest.raises(RuntimeError, match="a failing dry step"):   # a step that raises restores both
        with precompile.dry_run():
            raise RuntimeError("a failing dry step")
    assert knobs.runtime.jit_cache_hook is hook and fn.device_caches[0][0] == {"compiled key": compiled}
    assert not precompile.ONE_DRY_RUN.locked()


MISSING = ("tokenspeed.backends.kernels.no_such_module", "kernel", "{}", "src")


@pytest.mark.parametrize("worker", ["fails", "dies", "hangs"])
def test_a_failing_worker_costs_time_not_the_startup(worker, monkeypatch, caplog):
    """Its kernels then compile at their first launch: ``compile`` reports False (so no
    marker is written), logs why, and returns once the workers are gone."""
    from tokenspeed.backends.kernels import precompile
    if worker == "dies":
        monkeypatch.setattr(precompile, "WORKER", "import sys; sys.exit(3)")
    if worker == "hangs":
        monkeypatch.setattr(precompile, "WORKER", "import time; time.sleep(60)")
        monkeypatch.setattr(precompile, "WORKER_SECONDS", 1)
    with precompile.CompileWorkers(2) as workers:
        started = [process for process, _ in workers.running]
        if worker == "dies":
            for process in started:
                process.wait()  # gone before its share is handed over
        assert not workers.compile([precompile.Variant(*MISSING)])
    assert len(started) == 2 and all(process.poll() is not None for process in started)
    expected = {"fails": "no_such_module", "dies": "code 3", "hangs": "code -9"}[worker]
    assert expected in caplog.text


def test_unused_workers_are_stopped():
    from tokenspeed.backends.kernels import precompile
    with precompile.CompileWorkers(2) as workers:
        started = [process for process, _ in workers.running]
    assert len(started) == 2 and all(process.poll() is not None for process in started)
    assert workers.running == []
    assert not precompile.CompileWorkers(0).compile([precompile.Variant(*MISSING)])


def test_no_compile_workers_need_no_triton(monkeypatch):
    """A CPU or eager engine starts none, and must build where Triton is not installed."""
    from tokenspeed.backends.kernels.precompile import CompileWorkers
    monkeypatch.setitem(sys.modules, "triton", None)  # any import of it now fails
    with CompileWorkers(0) as workers:
        assert workers.running == []


@pytest.mark.parametrize("cores, workers", [(1, 0), (2, 1), (16, 8), (64, 8)])
def test_default_workers_leave_half_the_cores_to_the_engine(monkeypatch, cores, workers):
    from tokenspeed.execution import compile_config
    monkeypatch.setattr(compile_config, "allowed_cpus", lambda: cores)
    assert compile_config.default_workers() == workers


if __name__ == "__main__":
    for check in sys.argv[1:]:
        globals()[check]()
