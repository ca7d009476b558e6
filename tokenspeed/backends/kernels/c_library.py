"""A C file of this package built into a shared library, once per machine, and loaded.

The CPU's block kernels (``cpu_blocks.c``) are C: no library ships a float32 product over
GGUF blocks for torch's tensors, and torch's own int4 kernel computes in bfloat16. The
file is compiled by the system's C compiler (``$CC``, else ``cc``) for the machine it runs
on (``-march=native``) with OpenMP, whose runtime is the one torch has loaded (``libgomp``,
asked for by name from clang), so the kernels share torch's threads. The library is kept
under the cache folder (``$TOKENSPEED_CACHE_DIR``, else ``$XDG_CACHE_HOME/tokenspeed``,
else ``~/.cache/tokenspeed``) under a name hashed from the source, the compiler, its flags
and the CPU, so a change of any one builds anew; processes building at once each write
their own file and rename it into place. Without a working compiler the build fails with
the compiler's message, and the caller decides (``cpu_blocks.available``).
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
LIBRARIES = ("-lm",)   # libm and, through it, glibc's vector functions (libmvec)


class BuildError(RuntimeError):
    """The C compiler is missing or refused the source."""


def cache_dir(environ=os.environ) -> Path:
    if environ.get("TOKENSPEED_CACHE_DIR"):
        return Path(environ["TOKENSPEED_CACHE_DIR"])
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenspeed"


@functools.cache
def kernels(source: Path, signatures: tuple[tuple[str, tuple], ...]) -> tuple[ctypes.CDLL | None, str]:
    """``source``'s library, each function of ``signatures`` (name, argument types) typed
    with an ``int`` result, built once a process; or None and the reason it was not."""
    try:
        library = load(source)
    except (BuildError, OSError) as exc:
        return None, str(exc)
    for name, argtypes in signatures:
        getattr(library, name).argtypes, getattr(library, name).restype = list(argtypes), ctypes.c_int
    return library, ""


def call(built: tuple[ctypes.CDLL | None, str], name: str, *args) -> int:
    """``name``'s status from a library ``kernels`` returned; an error if it was not built."""
    library, reason = built
    if library is None:
        raise RuntimeError(f"the CPU's C kernels are not built: {reason}")
    return getattr(library, name)(*args)


def load(source: Path, environ=os.environ) -> ctypes.CDLL:
    """``source`` built (or found built) and loaded; ``BuildError`` if it cannot be built."""
    compiler = shutil.which(environ.get("CC") or "cc")
    if compiler is None:
        raise BuildError(f"no C compiler: {environ.get('CC') or 'cc'} is not on PATH (set CC)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, errors="replace").stdout
    target = cache_dir(environ) / f"{source.stem}-{_build_key(source, compiler, version)}.so"
    if not target.is_file():
        _build(source, compiler, flags(version), target)
    return ctypes.CDLL(str(target))


def flags(version: str) -> tuple[str, ...]:
    """``FLAGS`` for the compiler whose ``--version`` says ``version``: clang's OpenMP is GNU's
    libgomp, the runtime torch loaded (its own default, libomp, is often not installed)."""
    gnu_openmp = "-fopenmp=libgomp" if "clang" in version else "-fopenmp"
    return tuple(gnu_openmp if flag == "-fopenmp" else flag for flag in FLAGS)


def _build_key(source: Path, compiler: str, version: str) -> str:
    """A hash of what the library depends on; the headers beside the source (which it may
    include) count as its source."""
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    parts = (source.read_bytes(), headers, compiler.encode(), version.encode(),
             " ".join(flags(version) + LIBRARIES).encode(), platform.machine().encode(), _cpu_identity().encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _cpu_identity() -> str:
    """The CPU's model and feature flags (what ``-march=native`` compiles for), where the OS
    tells them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags", "Features"))}))


def _build(source: Path, compiler: str, options: tuple[str, ...], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        done = subprocess.run([compiler, *options, str(source), "-o", partial, *LIBRARIES], capture_output=True,
                              text=True, errors="replace")
        if done.returncode:
            raise BuildError(f"{compiler} could not build {source.name}: {done.stderr.strip()[-2000:]}")
        os.chmod(partial, 0o755)   # mkstemp's file is its owner's alone; a shared cache folder serves all
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
