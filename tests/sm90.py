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
