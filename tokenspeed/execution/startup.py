"""Startup: build the runners and capture every graph, once, with a progress bar."""

import contextlib
import gc
import logging
import time
from collections.abc import Iterator

import attrs
import torch
from tqdm import tqdm

from tokenspeed.backends.kernels import precompile
from tokenspeed.backends.support import CudaGraphSupport, walk
from tokenspeed.execution.compile_config import CompileConfig, EngineLimits
from tokenspeed.execution.decode_runner import DecodeRunner
from tokenspeed.execution.graphs import GraphCapturer
from tokenspeed.execution.ladders import decode_ladder, token_buckets as default_buckets, view_buckets
from tokenspeed.execution.prefill_runner import PrefillRunner
from tokenspeed.execution.token_column import token_column


@attrs.frozen
class StartupReport:
    decode_ladder: tuple[int, ...]
    token_buckets: tuple[int, ...]
    view_buckets: tuple[int, ...]
    num_graphs: int
    capture_seconds: float
    graph_memory_bytes: int
    kernel_variants_precompiled: int = 0
    precompile_seconds: float = 0.0

    def as_text(self) -> str:
        if not self.num_graphs:
            return "no graphs captured: every batch runs eagerly"
        return (f"{self.num_graphs} graphs captured in {self.capture_seconds:.1f} s "
                f"({self.graph_memory_bytes / 2**20:.0f} MiB); decode ladder "
                f"{_ladder_text(self.decode_ladder)}; token buckets "
                f"{_ladder_text(self.token_buckets)}; view buckets {_ladder_text(self.view_buckets)}")


log = logging.getLogger(__name__)


def build_runners(programs: dict, kv_cache: torch.Tensor, backend, *, support: CudaGraphSupport,
                  config: CompileConfig, limits: EngineLimits, compile_workers: precompile.CompileWorkers,
                  verify_window: int = 1, num_groups: int = 1):
    """The prefill and decode runners, over one token column (``token_column``), and a
    verify runner, when ``programs`` has one, for windows of ``verify_window`` rows per
    request (a verify step is read at once: no column), over ``kv_cache``, every graph
    ``support`` allows captured, and the report. ``compile_workers``: started by the
    caller, stopped here once the captures' kernels are compiled."""
    device = kv_cache.device
    ladder = decode_ladder(config.max_num_seqs, config.capture_sizes) if support.decode_graph else ()
    tokens, views = _prefill_ladders(config, support)
    column = token_column(config.max_num_seqs, device)   # the decode and prefill runners' (module doc)
    decode = DecodeRunner(programs["decode"], kv_cache, backend, max_decode_bs=max((config.max_num_seqs, *ladder)),
                          max_pages=limits.max_pages, page_size=config.page_size, num_groups=num_groups,
                          column=column)
    verify, verify_ladder = None, ()
    if "verify" in programs:
        rows = config.max_num_seqs * verify_window
        verify_ladder = decode_ladder(rows) if support.decode_graph else ()
        verify = DecodeRunner(programs["verify"], kv_cache, backend, max_decode_bs=max((rows, *verify_ladder)),
                              max_pages=limits.max_pages, page_size=config.page_size, num_groups=num_groups)
    prefill = PrefillRunner(programs["prefill"], kv_cache, backend, max_pages=limits.max_pages,
                            page_size=config.page_size, view_width=config.view_width, token_ladder=tokens,
                            view_ladder=views, max_chunks=config.max_num_seqs, num_groups=num_groups,
                            column=column)
    capturer = GraphCapturer(device)
    walks = len(prefill.capture_walks())
    start = time.perf_counter()
    steps = [(decode, ladder), *([(verify, verify_ladder)] if verify is not None else [])]
    precompiled = _precompile(steps, prefill, walks, compile_workers) \
        if compile_workers.running and (ladder or walks) else 0
    compile_workers.stop()
    compiled, memory = time.perf_counter(), _reserved(device)
    total = len(ladder) + len(verify_ladder) + walks
    with torch.inference_mode(), tqdm(total=total, desc="capturing graphs",
                                      disable=None if total else True, leave=False) as bar:
        decode.capture(capturer, ladder, bar)
        if verify is not None:
            verify.capture(capturer, verify_ladder, bar, name="verify")
        prefill.capture(capturer, bar)
    capturer.seal()
    report = StartupReport(decode_ladder=ladder, token_buckets=tokens, view_buckets=views,
                           num_graphs=capturer.count, capture_seconds=time.perf_counter() - compiled,
                           graph_memory_bytes=_reserved(device) - memory,
                           kernel_variants_precompiled=precompiled, precompile_seconds=compiled - start)
    return prefill, decode, verify, report


def _prefill_ladders(config: CompileConfig, support: CudaGraphSupport) -> tuple[tuple, tuple]:
    """Token and view buckets, or none when prefill graphs are not captured (then every
    batch runs unpadded)."""
    if not support.prefill_graph:
        return (), ()
    tokens = default_buckets(config.max_num_batched_tokens, config.token_buckets)
    return tokens, view_buckets(config.view_width * config.max_num_seqs)


def _ladder_text(ladder: tuple[int, ...]) -> str:
    if len(ladder) <= 6:
        return str(list(ladder))
    return f"[{ladder[0]}, {ladder[1]}, {ladder[2]} .. {ladder[-1]}] ({len(ladder)} rungs)"


def _precompile(steps, prefill, walks: int, pool: precompile.CompileWorkers) -> int:
    """Record the kernel variants the captures launch (``steps``: each decode-like runner
    with its ladder) and compile them in the ``pool``'s processes (see ``precompile``);
    returns how many they compiled (none when an earlier start on this machine compiled
    the same set, or when a worker failed, or when this Triton keeps its compiled kernels
    where the dry run cannot set them aside)."""
    if not precompile.dry_run_possible():
        log.warning("this Triton keeps compiled kernels where the dry run cannot set them aside: "
                    "kernels compile at their first launch")
        return 0
    started_alike = precompile.start_marker(start_description(steps, prefill))
    if started_alike.exists():
        return 0
    with torch.inference_mode(), precompile.dry_run() as variants:
        for runner, ladder in steps:
            for bs in ladder:  # every rung: few, and 16 (Triton specializes multiples of 16)
                runner.dry_step(bs)  # is new after two rungs that were not
        if walks:
            view, tokens = min(prefill.view_ladder), min(prefill.token_ladder)
            _walk_until_quiet(lambda t: prefill.dry_walk(t, view), prefill.token_ladder, variants)
            _walk_until_quiet(lambda v: prefill.dry_walk(tokens, v), prefill.view_ladder, variants)
    unique = sorted(set(variants))
    if not unique or precompile.compiled_before(unique):
        precompile.touch(started_alike)
        return 0  # the caller stops the workers
    workers = len(pool.running)
    with tqdm(total=1, desc=f"compiling {len(unique)} kernels", disable=None, leave=False):
        if not pool.compile(unique):
            return 0  # what the workers missed compiles at its first launch (logged)
    precompile.mark_compiled(unique)
    precompile.touch(started_alike)
    log.info("compiled %d Triton kernel variants in %d processes", len(unique), workers)
    return len(unique)


def start_description(steps, prefill) -> list[str]:
    """What decides the kernel variants a start's captures launch, as text: each runner's
    program (its segments' code), the shapes and dtypes of the weights and the pool, the
    backend's nodes and the ladders. Kernel sources and the GPU are added by the marker."""
    runners = [runner for runner, _ in steps] + [prefill]
    described = [repr([type(node).__qualname__ for node in walk(prefill.backend)]),
                 repr((tuple(prefill.kv_cache.shape), prefill.kv_cache.dtype, prefill.max_pages)),
                 repr([ladder for _, ladder in steps]), repr((prefill.token_ladder, prefill.view_ladder)),
                 repr([getattr(runner, "masked", None) is not None for runner, _ in steps])]   # masked draws
    for runner in runners:
        gm = runner.program.graph_module
        described += [seg.graph_module.code for seg in runner.program.segments] or [gm.code]
        described.append(repr([(name, tuple(t.shape), t.dtype) for name, t in gm.state_dict(keep_vars=True).items()]))
    return described


def _walk_until_quiet(walk, sizes, variants: list, quiet_walks: int = 2) -> None:
    """Walk ``sizes`` from the smallest up until ``quiet_walks`` walks in a row record no
    new kernel variant, then the largest. The prefill ladders have up to 40 buckets, each
    walk costs about what its capture warm-up does, and the variants come with the small
    sizes (GEMV rows, attention tiles); one missed here still compiles, at its capture."""
    quiet, ordered = 0, sorted(sizes)
    for size in ordered:
        if quiet == quiet_walks:
            walk(ordered[-1])
            return
        known = len(set(variants))
        walk(size)
        quiet = quiet + 1 if len(set(variants)) == known else 0


def _reserved(device) -> int:
    """Bytes the caching allocator holds, unused cached blocks released first (capture
    releases them too, which would otherwise count against the graphs), and engines
    dropped earlier collected first (their graphs form reference cycles; collected during
    the captures, they made the graph memory negative)."""
    if device.type != "cuda":
        return 0
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while an engine starts. Loading, tracing, lowering
    and capturing allocate hundreds of thousands of objects (a GGUF vocabulary's fields,
    graph nodes, kernel launches), and every full collection walks all that the process
    holds: 1.2-1.3 s of the default model's start on the CPU machine went to collections
    (docs/PERFORMANCE.md). Explicit collections (before device memory is measured) still
    run, and the collector's state is put back whatever happens."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
