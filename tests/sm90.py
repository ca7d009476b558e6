"""Kernels compiled for the H100/H200 (sm_90) on a machine without a GPU: a child process
without the Triton interpreter runs ``code``, which compiles and asserts on the output.

Not a test module: shared by the kernel-compile tests.
"""

import os
import subprocess
import sys

import pytest


def assert_compiles(code: list[str]) -> None:
    """``code``: the child's argv after the interpreter (``["-c", SOURCE, arg]`` or a file)."""
    pytest.importorskip("triton.backends.nvidia")
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), here, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, *code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def compile_sm90(kernel, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3):
    """``kernel`` compiled for sm_90 (run in the child). Pointers and integers are marked
    divisible by 16, as a launch specializes torch's allocations and round sizes: without
    it the compiler cannot vectorize a load, and the code is not what a GPU runs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = kernel.arg_names
    aligned = {(names.index(a),): [["tt.divisibility", 16]] for a, t in signature.items() if t != "fp32"}
    source = ASTSource(fn=kernel, signature={**signature, **{k: "constexpr" for k in constexprs}},
                       constexprs={(names.index(k),): c for k, c in constexprs.items()}, attrs=aligned)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
