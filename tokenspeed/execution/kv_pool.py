"""The paged KV pool: one tensor of pages for every layer, sized to a memory budget. Page 0
is the null page: never handed out (``BlockAllocator``), the target of every padding row
and table tail.

Sizing, by the first that is given: ``num_kv_pages``; ``kv_cache_memory_bytes`` for the
pool; on a GPU, ``gpu_memory_utilization``, the share of the device's memory the engine may
fill, weights, graphs and workspaces included. What those take is known only once the
graphs are captured, so the engine binds a first pool, captures, measures, and rebinds a
pool that fills the rest of the share (``stages.compile``). The first pool is every
sequence at full length where that takes at most half of what the share leaves free
before the captures (``first_pages``): the measurement then almost always keeps it, and
the graphs are captured once; else it is a probe (one full-length request). On the CPU
the byte budget defaults to 512 MiB. No pool is larger than every sequence at full length
needs (``max_num_seqs`` of them, and the null page; with a window on every layer, a
sequence needs only its window's pages), so several engines can share a device.
"""

import attrs
import torch

from tokenspeed.backends.pool_geometry import PoolGeometry
from tokenspeed.ir.cache_groups import rows_per_page

CPU_KV_BYTES = 512 << 20
GIB = 2**30


def geometry_for(model_config, page_size: int, dtype, device) -> PoolGeometry:
    parts, heads, values = model_config.cache_row
    return PoolGeometry(rows_per_page(model_config.cache_groups), page_size, heads, values, dtype, device, parts)


def allocate(geometry: PoolGeometry, num_pages: int) -> torch.Tensor:
    return torch.zeros(geometry.shape(num_pages), dtype=geometry.dtype, device=geometry.device)


@attrs.frozen
class PoolSizing:
    """How the pool's pages were chosen, for the startup report. ``probe_pages`` and
    ``non_kv_bytes`` (device memory in use besides the pool once the probe's graphs were
    captured) are set when the pool was sized after a probe."""
    num_pages: int
    page_bytes: int
    pages_per_sequence: int         # the most one request at max_model_len holds at once
    rule: str                       # which option chose the size
    probe_pages: int = 0
    non_kv_bytes: int = 0
    rebind_seconds: float = 0.0

    @property
    def max_full_length_sequences(self) -> int:
        return (self.num_pages - 1) // self.pages_per_sequence

    def as_text(self) -> str:
        sequences = self.max_full_length_sequences
        text = (f"KV pool: {self.num_pages} pages ({_size(self.num_pages * self.page_bytes)}, "
                f"by {self.rule}), {sequences} sequence{'s' if sequences != 1 else ''} at full length")
        if self.probe_pages == self.num_pages:
            text += (f"; kept after its graphs were captured, when the device held {_size(self.non_kv_bytes)} "
                     f"besides it (weights, graphs, workspaces, other engines)")
        elif self.probe_pages:
            text += (f"; sized after a probe pool of {self.probe_pages} pages, when the device held "
                     f"{_size(self.non_kv_bytes)} besides it (weights, graphs, workspaces, other "
                     f"engines); rebound in {self.rebind_seconds:.1f} s")
        return text


def wanted_pages(max_num_seqs: int, pages_per_sequence: int) -> int:
    """Every sequence at full length, and the null page: the most any budget is given."""
    return max_num_seqs * pages_per_sequence + 1


def probe_pages(pages_per_sequence: int) -> int:
    """The probe pool: one request at full length (its graphs do not depend on the pool)."""
    return pages_per_sequence + 1


def first_pages(utilization: float, geometry: PoolGeometry, *, max_num_seqs: int, pages_per_sequence: int,
                companion_page_bytes: int = 0) -> int:
    """The pool bound before the device is measured: the most any budget is given
    (``wanted_pages``) when it takes at most half of what ``utilization`` leaves free now,
    so that the graphs and workspaces fit beside it; else the probe. Either way the
    measurement after the captures decides (``sized_after_probe``); a first pool it keeps
    saves capturing every graph twice (about 5 s of the default model's start on an H200)."""
    free, total = torch.cuda.mem_get_info(geometry.device)
    left = int(total * utilization) - (total - free)
    wanted = wanted_pages(max_num_seqs, pages_per_sequence)
    if wanted * (geometry.page_bytes + companion_page_bytes) <= left // 2:
        return wanted
    return probe_pages(pages_per_sequence)


def sized_by_bytes(config, geometry: PoolGeometry, pages_per_sequence: int, *,
                   companion_page_bytes: int = 0) -> PoolSizing | None:
    """The pool's size when an option fixes it without measuring (``num_kv_pages`` first,
    then ``kv_cache_memory_bytes``), else None (a GPU sized by ``gpu_memory_utilization``).
    ``companion_page_bytes``: a page of another pool that will hold as many pages (a draft
    model's), paid from the same budget."""
    wanted, page_bytes = wanted_pages(config.max_num_seqs, pages_per_sequence), geometry.page_bytes
    if config.num_kv_pages is not None:   # no more than every sequence at full length uses
        pages = min(config.num_kv_pages, wanted)
        rule = _rule(f"num_kv_pages={config.num_kv_pages}", pages, config.num_kv_pages, config.max_num_seqs)
        return PoolSizing(pages, page_bytes, pages_per_sequence, rule)
    if config.kv_cache_memory_bytes is None and geometry.device.type == "cuda":
        return None
    budget = CPU_KV_BYTES if config.kv_cache_memory_bytes is None else config.kv_cache_memory_bytes
    rule = f"the CPU's default budget of {_size(CPU_KV_BYTES)}" if config.kv_cache_memory_bytes is None else \
        f"kv_cache_memory_bytes={config.kv_cache_memory_bytes}"
    pages = _pages(budget, page_bytes + companion_page_bytes, wanted, rule)
    asked = budget // (page_bytes + companion_page_bytes)
    return PoolSizing(pages, page_bytes, pages_per_sequence, _rule(rule, pages, asked, config.max_num_seqs))


def sized_after_probe(utilization: float, probe: torch.Tensor, geometry: PoolGeometry, *,
                      max_num_seqs: int, pages_per_sequence: int, companion_page_bytes: int = 0) -> PoolSizing:
    """Pages that fill ``utilization`` of the device once everything the probe engine holds
    but its pool stays (measured while it is alive: graphs, weights, workspaces, and what
    other engines and processes hold, which the share must leave room for too) and its
    captures' transient peak comes back, with as many of ``companion_page_bytes`` each
    (see ``sized_by_bytes``)."""
    free, total = torch.cuda.mem_get_info(geometry.device)
    non_kv = total - free - probe.numel() * probe.element_size() + _transient_peak(geometry.device)
    budget = int(total * utilization) - non_kv
    rule = f"gpu_memory_utilization={utilization}"
    wanted = wanted_pages(max_num_seqs, pages_per_sequence)
    pages = _pages(budget, geometry.page_bytes + companion_page_bytes, wanted, rule,
                   f" of {_size(total)}: the device holds {_size(non_kv)} besides it (weights, graphs, "
                   f"workspaces, other engines and processes)")
    asked = max(budget, 0) // (geometry.page_bytes + companion_page_bytes)
    return PoolSizing(pages, geometry.page_bytes, pages_per_sequence, _rule(rule, pages, asked, max_num_seqs),
                      probe.shape[2], non_kv)


def reset_peak(device: torch.device) -> None:
    """Start counting the allocator's peak: the probe's captures set it."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _transient_peak(device: torch.device) -> int:
    """Bytes the allocator held at its peak since ``reset_peak`` beyond what it holds now:
    the eager warm-ups of the largest buckets, whose activations are freed (and released)
    by the time the probe is measured, but come back whenever such a batch runs eagerly."""
    if device.type != "cuda":
        return 0
    return max(torch.cuda.max_memory_reserved(device) - torch.cuda.memory_reserved(device), 0)


def _rule(rule: str, pages: int, asked: int, max_num_seqs: int) -> str:
    """What chose ``pages``: ``rule`` (which allows ``asked``), unless the cap of
    ``max_num_seqs`` sequences at full length cut it, which the report must then name: a
    pool "by num_kv_pages=100000" of 2049 pages reads as a misreport."""
    return rule if pages >= asked else f"max_num_seqs={max_num_seqs} sequences at full length; {rule} allows more"


def _pages(budget: int, page_bytes: int, wanted: int, rule: str, context: str = "") -> int:
    pages = min(wanted, max(budget, 0) // page_bytes)
    if pages < 2:
        raise ValueError(f"{rule} leaves {_size(max(budget, 0))} for the KV pool{context}: "
                         f"fewer than 2 pages of {page_bytes} bytes (page 0 is the null page); "
                         f"give it more memory or shorten max_model_len")
    return pages


def _size(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / 2**20:.2f} MiB"
