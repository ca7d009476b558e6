"""Startup: build the runners and capture every graph, once, with a progress bar."""

import gc
import logging
import time

import attrs
import torch
from tqdm import tqdm

from tokenspeed.backends.kernels import precompile
from tokenspeed.runtime.decode_runner import DecodeRunner
from tokenspeed.runtime.graphs import GraphCapturer
from tokenspeed.runtime.ladders import decode_ladder, row_buckets, token_buckets as default_buckets
from tokenspeed.runtime.prefill_graph import PrefillGraph


@attrs.frozen
class StartupReport:
    decode_ladder: tuple[int, ...]
    token_buckets: tuple[int, ...]
    row_buckets: tuple[int, ...]
    num_graphs: int
    capture_seconds: float
    graph_memory_bytes: int
    kernel_variants_precompiled: int = 0
    precompile_seconds: float = 0.0


log = logging.getLogger(__name__)


def build_runners(llm, *, max_num_seqs, max_num_batched_tokens, capture_sizes, token_buckets,
                  view_width, seed, compile_workers: precompile.CompileWorkers):
    """``compile_workers``: started by the caller, stopped here once the captures' kernels
    are compiled."""
    device = llm.kv_cache.device
    generator = torch.Generator(device=device).manual_seed(seed)
    ladder = decode_ladder(max_num_seqs, capture_sizes) if llm.support.decode_graph else ()
    tokens = default_buckets(max_num_batched_tokens, token_buckets)
    rows = row_buckets(view_width * max_num_seqs)
    max_decode_bs = max((max_num_seqs, *ladder))
    decode = DecodeRunner(llm.lowered["decode"], llm.kv_cache, llm.backend.leaf, max_decode_bs,
                          llm.max_pages, llm.page_size, generator)
    prefill = PrefillGraph(llm.lowered["prefill"], llm.kv_cache, llm.backend.leaf, llm.max_pages,
                           llm.page_size, view_width, generator, tokens, rows)
    capturer = GraphCapturer(device)
    sweeps = prefill.capture_sweeps if llm.support.prefill_graph else 0
    start = time.perf_counter()
    precompiled = _precompile(decode, prefill, ladder, sweeps, compile_workers) \
        if compile_workers.running and (ladder or sweeps) else 0
    compile_workers.stop()
    compiled, memory = time.perf_counter(), _reserved(device)
    with torch.inference_mode(), tqdm(total=len(ladder) + sweeps, desc="capturing graphs",
                                      disable=None, leave=False) as bar:
        if ladder:
            decode.capture(capturer, ladder, bar)
        if sweeps:
            prefill.capture(capturer, bar)
    capturer.seal()
    report = StartupReport(ladder, tokens, rows, capturer.count, time.perf_counter() - compiled,
                           _reserved(device) - memory, precompiled, compiled - start)
    return prefill, decode, report


def _precompile(decode, prefill, ladder, sweeps, pool: precompile.CompileWorkers) -> int:
    """Record the kernel variants the captures launch and compile them in the ``pool``'s
    processes (see ``precompile``); returns how many they compiled (none when an earlier
    start on this machine compiled the same set, or when a worker failed)."""
    with torch.inference_mode(), precompile.dry_run() as variants:
        for bs in ladder:  # every rung: few, and 16 (Triton specializes multiples of 16)
            decode.dry_step(bs)  # is new after two rungs that were not
        if sweeps:
            view, tokens = min(prefill.view_ladder), min(prefill.token_ladder)
            _walk_until_quiet(lambda t: prefill.dry_walk(t, view), prefill.token_ladder, variants)
            _walk_until_quiet(lambda v: prefill.dry_walk(tokens, v), prefill.view_ladder, variants)
    unique = sorted(set(variants))
    if not unique or precompile.compiled_before(unique):
        return 0  # the caller stops the workers
    workers = len(pool.running)
    with tqdm(total=1, desc=f"compiling {len(unique)} kernels", disable=None, leave=False):
        if not pool.compile(unique):
            return 0  # what the workers missed compiles at its first launch (logged)
    precompile.mark_compiled(unique)
    log.info("compiled %d Triton kernel variants in %d processes", len(unique), workers)
    return len(unique)


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
