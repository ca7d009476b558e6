"""Compile the Triton kernel variants a startup needs in parallel worker processes.

On a fresh machine each kernel variant compiles on its first launch, one after another,
which was most of a cold GPU startup (docs/PERFORMANCE.md, startup). Here a
dry run records every variant without compiling or launching it (Triton skips both when
its ``jit_cache_hook`` returns True), worker processes compile the variants (and, where
Triton builds one, their launchers) into Triton's on-disk cache, and the captures then
load them from there. A marker in that cache names the set compiled; a later start that
records the same set stops its workers (started before the dry run, so that their
imports overlap it) without giving them work. A second marker names the start (its
programs, weights' shapes and ladders): a later start described alike skips the dry run
too.

Workers are plain ``python -c`` subprocesses rather than multiprocessing children, so
the user's main module is never re-imported. A worker that fails or hangs costs only
time: the variants it did not compile compile at their first launch, as without this.
"""

import contextlib
import functools
from collections import defaultdict
import hashlib
import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs

log = logging.getLogger(__name__)
PACKAGE = __name__.split(".")[0] + "."   # tokenspeed's kernels: the ones the workers compile
# The jit hook and the kernels' caches are the process's: one dry run at a time.
ONE_DRY_RUN = threading.Lock()
WORKER_SECONDS = 600  # for all workers together; a compile takes well under a second
WORKER = ("import json, sys; sys.path.insert(0, {root!r}); "
          "from tokenspeed.backends.kernels.precompile import compile_variants; "
          "sys.exit(compile_variants(json.load(open(sys.stdin.readline().strip()))) > 0)")


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
    """Inside, no Triton kernel of this package is launched by this thread: each launch is
    skipped, and recorded where its variant is not compiled in this process yet. Kernels
    compiled earlier must not run either: they would read what a skipped kernel left
    unwritten (a mixture-of-experts product ran on the block plan of a skipped grouping
    kernel, at addresses no tensor holds). So their compiled variants are set aside for
    the dry run (``_kernels_set_aside``): every launch misses and reaches the hook. Other
    threads see the hook that was there before, but miss the caches too: what they launch
    meanwhile compiles again in the process (and is dropped with the stand-in caches).
    A second dry run waits for the first (``ONE_DRY_RUN``)."""
    from triton import knobs
    variants: list[Variant] = []
    with ONE_DRY_RUN, _kernels_set_aside() as compiled_before:
        owner, previous = threading.get_ident(), knobs.runtime.jit_cache_hook

        def record(**hook):
            if threading.get_ident() != owner:
                return previous(**hook) if previous else None
            fn = hook["fn"]   # another package's kernel (fla's) is skipped too, and compiles at its first launch
            if fn.module.startswith(PACKAGE) and not compiled_before(fn.jit_function, hook["key"]):
                variants.append(Variant(fn.module, fn.name, hook["compile"]["specialization_data"],
                                        fn.jit_function.cache_key))
            return True

        knobs.runtime.jit_cache_hook = record
        try:
            yield variants
        finally:
            knobs.runtime.jit_cache_hook = previous


def dry_run_possible() -> bool:
    """Whether this Triton keeps a kernel's compiled variants where the dry run can set
    them aside (``JITFunction.device_caches``, a ``defaultdict``: Triton 3.6 to 3.9 at least)."""
    return all(isinstance(getattr(fn, "device_caches", None), defaultdict) for fn in _package_kernels())


@contextlib.contextmanager
def _kernels_set_aside():
    """Every loaded kernel of this package with empty stand-in caches while inside; yields
    ``compiled_before(jit_function, key)``, asked of the caches set aside."""
    kept = {fn: fn.device_caches for fn in _package_kernels()}
    try:
        for fn, caches in kept.items():
            fn.device_caches = defaultdict(caches.default_factory)
        yield lambda fn, key: any(key in caches[0] for caches in kept.get(fn, {}).values())
    finally:
        for fn, caches in kept.items():
            fn.device_caches = caches


def _package_kernels() -> list:
    """The ``@triton.jit`` functions of this package's loaded modules."""
    from triton.runtime.jit import JITFunction
    return [value for name, module in list(sys.modules.items()) if name.startswith(PACKAGE) and module
            for value in vars(module).values() if isinstance(value, JITFunction)]


class CompileWorkers:
    """Worker processes started before tracing, so that their imports overlap it and the
    dry run."""

    def __init__(self, count: int):
        self.running: list[tuple[subprocess.Popen, object]] = []
        if count == 0:  # no graphs, or no GPU: nothing to compile ahead (Triton may be absent)
            return
        from triton import knobs
        if not sys.executable or getattr(sys, "frozen", False):
            log.warning("no Python interpreter to run kernel compile workers: kernels compile "
                        "at their first launch")
            return
        command = [sys.executable, "-c", WORKER.format(root=_package_root())]
        env = {**os.environ, "TRITON_CACHE_DIR": str(knobs.cache.dir)}
        try:
            for _ in range(count):
                errors = tempfile.TemporaryFile()
                self.running.append((subprocess.Popen(command, stdin=subprocess.PIPE, text=True, env=env,
                                                      stdout=subprocess.DEVNULL, stderr=errors), errors))
        except OSError as exc:
            log.warning("started %d of %d kernel compile workers (%s)", len(self.running), count, exc)

    def compile(self, variants: Sequence[Variant]) -> bool:
        """Compile ``variants`` into the on-disk cache, shared out among the workers;
        whether every one of them was compiled."""
        if not self.running:
            return False
        unique = list(dict.fromkeys(variants))
        with tempfile.TemporaryDirectory() as folder:
            ok = True
            for i, (process, _) in enumerate(self.running):
                share = Path(folder) / f"share{i}.json"
                share.write_text(json.dumps([attrs.asdict(v) for v in unique[i::len(self.running)]]))
                ok &= _hand_over(process, share)
            deadline = time.monotonic() + WORKER_SECONDS
            return all([_finished(process, errors, deadline) for process, errors in self.running]) and ok

    def stop(self) -> None:
        """Workers never handed a share (the variants were compiled before, or the dry run
        raised) are stopped; none remain running."""
        for process, errors in self.running:
            if process.poll() is None:
                process.kill()
            process.wait()
            errors.close()
        self.running = []

    def __enter__(self) -> "CompileWorkers":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _hand_over(process: subprocess.Popen, share: Path) -> bool:
    try:
        process.stdin.write(f"{share}\n")
        process.stdin.close()
        return True
    except OSError:  # the worker is gone; _finished reports why
        return False


def _finished(process: subprocess.Popen, errors, deadline: float) -> bool:
    try:
        code = process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        code = process.wait()
    if code != 0:
        errors.seek(0)
        log.warning("a kernel compile worker failed with code %s (its kernels compile at their "
                    "first launch): %s", code, errors.read().decode(errors="replace")[-2000:])
    return code == 0


def compiled_before(variants: Sequence[Variant]) -> bool:
    """Whether workers compiled exactly these variants into this Triton cache before."""
    return _marker(*(attrs.astuple(v) for v in sorted(set(variants)))).exists()


def mark_compiled(variants: Sequence[Variant]) -> None:
    touch(_marker(*(attrs.astuple(v) for v in sorted(set(variants)))))


def start_marker(start: Sequence[str]) -> Path:
    """The marker of a start described by ``start`` (what decides the variants its captures
    launch: programs, weights' shapes, ladders; ``startup.start_description``), made once
    such a start found every variant in this Triton cache: a later one described alike need
    not record them (the dry run costs about what the captures' warm-ups do). The loaded
    kernels' sources are part of it, so it is named before the dry run, whose launches
    import more kernel modules."""
    return _marker("start", *sorted(fn.cache_key for fn in _package_kernels()), *start)


def touch(marker: Path) -> None:
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()


def _marker(*listed) -> Path:
    """A file in Triton's cache named by the Triton version, the GPU, Triton's settings
    and what is ``listed`` (variants or a start, the kernels' sources included): it goes
    when the cache goes. A stale one costs only time: a variant missing from the cache
    compiles at its first launch."""
    import triton
    from triton import knobs
    settings = sorted((k, v) for k, v in os.environ.items()
                      if k.startswith("TRITON_") and k != "TRITON_CACHE_DIR")
    listing = json.dumps([triton.__version__, repr(_target()), settings, *listed])
    digest = hashlib.sha256(listing.encode()).hexdigest()[:32]
    return Path(knobs.cache.dir) / f"tokenspeed-precompiled-{digest}"


def _target():
    import triton
    try:
        return triton.runtime.driver.active.get_current_target()
    except RuntimeError:  # no GPU driver (the CPU machine): the variants name the target
        return None


def _package_root() -> str:
    """The folder holding the ``tokenspeed`` package (this file is tokenspeed/backends/kernels/)."""
    return str(Path(__file__).resolve().parents[3])


def compile_variants(variants: list[dict]) -> int:
    """A worker's job: compile each variant (and its launcher, where Triton builds one)
    into the on-disk cache. Returns how many failed; each failure is printed."""
    import triton
    failed = 0
    for v in variants:
        try:
            fn = functools.reduce(getattr, v["name"].split("."), importlib.import_module(v["module"]))
            kernel = fn.preload(v["specialization"])
            triton.runtime.driver.active.launcher_cls(kernel.src, kernel.metadata)
        except Exception as exc:  # noqa: BLE001 - reported, and the kernel compiles at launch
            print(f"{v['module']}.{v['name']}: {type(exc).__name__}: {exc}", file=sys.stderr)
            failed += 1
    return failed
