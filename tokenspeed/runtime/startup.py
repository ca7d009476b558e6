"""Startup: build the runners and capture every graph, once, with a progress bar."""

import time

import attrs
import torch
from tqdm import tqdm

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


def build_runners(llm, *, max_num_seqs, max_num_batched_tokens, capture_sizes, token_buckets,
                  view_width, seed):
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
    start, memory = time.perf_counter(), _reserved(device)
    sweeps = prefill.capture_sweeps if llm.support.prefill_graph else 0
    with torch.inference_mode(), tqdm(total=len(ladder) + sweeps, desc="capturing graphs",
                                      disable=None, leave=False) as bar:
        if ladder:
            decode.capture(capturer, ladder, bar)
        if sweeps:
            prefill.capture(capturer, bar)
    capturer.seal()
    report = StartupReport(ladder, tokens, rows, capturer.count, time.perf_counter() - start,
                           _reserved(device) - memory)
    return prefill, decode, report


def _reserved(device) -> int:
    """Bytes the caching allocator holds, unused cached blocks released first (capture
    releases them too, which would otherwise count against the graphs)."""
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)
