"""Compile the Triton kernel variants a startup needs in parallel worker processes.

On a fresh machine each kernel variant compiles on its first launch, one after another:
35 variants took about 20 of the 30 seconds of a Llama-3.2-1B startup on the H200. Here a
dry run records every variant without compiling or launching it (Triton skips both when
its ``jit_cache_hook`` returns True), worker processes compile the variants (and their
launchers) into Triton's on-disk cache, and the real run then loads them from there. A
marker in that cache records the set compiled, so later starts skip the workers.

Workers are plain ``python -c`` subprocesses rather than multiprocessing children, so
the user's main module is never re-imported. A worker that fails costs only time: the
variants it did not compile are compiled on first launch, as without this module.
"""

import contextlib
import hashlib
import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs

log = logging.getLogger(__name__)
WORKER = ("import json, sys; from tokenspeed.backends.kernels.precompile import compile_variants; "
          "compile_variants(json.load(sys.stdin))")


@attrs.frozen(order=True)
class Variant:
    """One kernel specialization, as Triton serializes it for ``JITFunction.preload``, and
    the hash of the kernel's source."""
    module: str
    name: str
    specialization: str
    source: str


@contextlib.contextmanager
def dry_run() -> Iterator[list[Variant]]:
    """Inside, a Triton kernel not yet compiled in this process is neither compiled nor
    launched, only recorded (kernels compiled earlier launch as usual)."""
    from triton import knobs
    variants: list[Variant] = []

    def record(*, fn, compile, **_) -> bool:
        variants.append(Variant(fn.module, fn.name, compile["specialization_data"],
                                fn.jit_function.cache_key))
        return True

    previous, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, record
    try:
        yield variants
    finally:
        knobs.runtime.jit_cache_hook = previous


class CompileWorkers:
    """Worker processes started before the dry run, so that their imports overlap it."""

    def __init__(self, count: int):
        path = os.pathsep.join([_package_root(), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "PYTHONPATH": path}
        self.running = []
        for _ in range(count):
            errors = tempfile.TemporaryFile()
            process = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE,
                                       stdout=subprocess.DEVNULL, stderr=errors, env=env, text=True)
            self.running.append((process, errors))

    def compile(self, variants: Sequence[Variant]) -> bool:
        """Compile ``variants`` into the on-disk cache, shared out among the workers;
        whether every worker succeeded."""
        unique = list(dict.fromkeys(variants))
        for i, (process, _) in enumerate(self.running):
            process.stdin.write(json.dumps([attrs.asdict(v) for v in unique[i::len(self.running)]]))
            process.stdin.close()
        ok = True
        for process, errors in self.running:
            if process.wait() != 0:
                errors.seek(0)
                log.warning("a kernel compile worker failed (its kernels compile on first launch "
                            "instead): %s", errors.read().decode(errors="replace")[-2000:])
                ok = False
        return ok

    def __enter__(self) -> "CompileWorkers":
        return self

    def __exit__(self, *exc) -> None:
        """Workers not given their share (the dry run raised) are stopped."""
        for process, errors in self.running:
            if process.poll() is None and not process.stdin.closed:
                process.kill()
            process.wait()
            errors.close()


def compiled_before(variants: Sequence[Variant]) -> bool:
    """Whether workers compiled exactly these variants into this Triton cache before: a
    warm start then skips them (their imports alone cost seconds)."""
    return _marker(variants).exists()


def mark_compiled(variants: Sequence[Variant]) -> None:
    marker = _marker(variants)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()


def _marker(variants: Sequence[Variant]) -> Path:
    """A file in Triton's cache named by the Triton version and the variants: it goes
    when the cache goes, and a changed kernel source changes the name."""
    import triton
    from triton import knobs
    listing = json.dumps([triton.__version__, *(attrs.astuple(v) for v in sorted(set(variants)))])
    digest = hashlib.sha256(listing.encode()).hexdigest()[:32]
    return Path(knobs.cache.dir) / f"tokenspeed-precompiled-{digest}"


def _package_root() -> str:
    import tokenspeed
    return os.path.dirname(os.path.dirname(os.path.abspath(tokenspeed.__file__)))


def compile_variants(variants: list[dict]) -> None:
    """A worker's job: compile each variant and its launcher into the on-disk cache."""
    import triton
    for v in variants:
        kernel = getattr(importlib.import_module(v["module"]), v["name"]).preload(v["specialization"])
        triton.runtime.driver.active.launcher_cls(kernel.src, kernel.metadata)  # cached launcher
