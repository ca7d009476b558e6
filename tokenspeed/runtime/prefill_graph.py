"""Breakable prefill graphs: graph segments captured per bucket, breaks run eagerly.

Encoder graph segments are captured per token bucket, decoder graph segments per
decoder-row bucket, all in one memory pool; attention, narrowing and finish run eagerly
with live metadata, and the padded rows of every eager output are zeroed (scrubbed) so no
undefined rows flow on. A batch above the largest bucket runs every segment eagerly:
eager prefill and graphed prefill are one walk over the same segments.
"""

import torch

from tokenspeed.backends.descriptors import leaves
from tokenspeed.backends.metadata import kept_rows
from tokenspeed.runtime.graphs import MovedTensorError, state_tensors
from tokenspeed.runtime.ladders import bucket_for
from tokenspeed.runtime.sampler import SamplingTensors, needs_filter, sample
from tokenspeed.runtime.slots import MetadataSlots, to_device

TOKEN_ROW_FIELDS = ("input_ids", "positions", "slot_mapping", "row_request")


class PrefillGraph:
    def __init__(self, lowered, kv_cache, backend, max_pages: int, page_size: int,
                 view_width: int, generator: torch.Generator | None, token_ladder, view_ladder):
        """Batches are padded to the ladders whether or not graphs get captured, so an
        eager run has the shapes (and so the numerics) of a replay."""
        self.lowered, self.kv_cache, self.backend = lowered, kv_cache, backend
        self.max_pages, self.page_size, self.view_width = max_pages, page_size, view_width
        self.generator = generator
        self.token_ladder, self.view_ladder = tuple(token_ladder), tuple(view_ladder)
        self.graphs: dict[tuple[str, int], tuple[object, dict, tuple[str, ...]]] = {}
        top = max(self.token_ladder, default=0)
        self.slots = MetadataSlots(self.plan([], top), top, kv_cache.device, TOKEN_ROW_FIELDS) \
            if top else None

    def plan(self, chunks, num_rows: int, num_view_rows: int | None = None):
        """Host-side descriptor; publishing (or ``to_device``) moves it to the device."""
        return self.backend.plan_extend(chunks, num_rows=num_rows, num_table_rows=len(chunks) + 1,
                                        max_pages=self.max_pages, page_size=self.page_size,
                                        view_width=self.view_width, num_view_rows=num_view_rows)

    def capture(self, capturer, progress=None) -> None:
        """Every token bucket's graphs first, then every decoder-row bucket's, largest first.

        All graphs share one pool, where a graph captured later may hold its outputs in
        memory an earlier capture used for temporaries, so replaying the earlier graph
        overwrites them. A walk replays one token bucket's graphs and then one row
        bucket's; captured in that order, no graph a walk replays was captured before the
        graphs whose outputs it still needs (a row graph never before a token graph), for
        any pairing of the two buckets at run time."""
        for rows, (t, v) in self._sweeps():
            self._walk(self.slots.publish(self.plan([], t, v)), capturer, capture_rows=rows)
            if progress is not None:
                progress.update(1)

    def dry_walk(self, tokens: int, view: int) -> None:
        """The capture walk of a token bucket and a row bucket, eagerly: under
        ``precompile.dry_run`` it records the kernel variants the captures will launch."""
        self._walk(self.slots.publish(self.plan([], tokens, view)))

    def _sweeps(self) -> list[tuple[str, tuple[int, int]]]:
        """(ladder captured, (token bucket, row bucket)) of each capture walk, in order."""
        smallest_view, smallest_tokens = min(self.view_ladder), min(self.token_ladder)
        sweeps = [("tokens", (t, smallest_view)) for t in sorted(self.token_ladder, reverse=True)]
        return sweeps + [("view", (smallest_tokens, v)) for v in sorted(self.view_ladder, reverse=True)]

    @property
    def capture_sweeps(self) -> int:
        return len(self._sweeps())

    def run(self, chunks, params) -> list[int]:
        """Sampled tokens of the completing chunks, in chunk order."""
        rows = sum(len(c.tokens) for c in chunks)
        views = sum(kept_rows(c, self.view_width) for c in chunks)
        t, v = bucket_for(self.token_ladder, rows), bucket_for(self.view_ladder, views)
        meta = self.plan(chunks, t or rows, v)
        meta = self.slots.publish(meta) if t else to_device(meta, self.kv_cache.device)
        logits = self._walk(meta)
        settings = SamplingTensors.build(params, logits.device)
        return sample(logits, settings, self.generator, needs_filter(params)).tolist()

    def _walk(self, meta, capturer=None, capture_rows: str | None = None) -> torch.Tensor:
        """Run every segment; with a capturer, capture the missing graphs of segments padded
        by ``capture_rows`` (others replay if captured, else run eagerly)."""
        env = {"kv_cache": self.kv_cache, **leaves(meta)}
        sizes = {"tokens": meta.input_ids.shape[0], "view": meta.view_rows.shape[0]}
        live = {"tokens": meta.num_live_rows, "view": meta.num_live_view_rows}
        stable = {id(env[n]) for n in ("kv_cache", *TOKEN_ROW_FIELDS)}
        for seg in self.lowered.segments:
            key = (seg.name, sizes.get(seg.rows))
            capturing = capturer is not None and seg.rows == capture_rows
            if seg.kind == "graph" and (key in self.graphs or capturing):
                self._graph_segment(seg, key, env, stable, capturer)
            else:
                seg(env)
                _scrub(seg, env, sizes.get(seg.rows), live.get(seg.rows))
        return env[self.lowered.program.output]

    def _graph_segment(self, seg, key, env, stable, capturer) -> None:
        """Slot views, the cache and earlier graphs' outputs are read in place (the first two
        pinned: a replay over other tensors is an error); eager values are copied in."""
        if key not in self.graphs:
            static = {n: env[n] if id(env[n]) in stable else env[n].clone() for n in seg.inputs}
            pinned = tuple(n for n in seg.inputs if n in ("kv_cache", *TOKEN_ROW_FIELDS))
            graph = capturer.capture(f"prefill[{seg.name}, rows={key[1]}]",
                                     lambda: seg.graph_module(*[static[n] for n in seg.inputs]),
                                     reach=lambda: {**static, **self._sources(pinned, key[1]),
                                                    **state_tensors(seg.graph_module)})
            self.graphs[key] = (graph, static, pinned)
            outputs = graph.outputs
        else:
            graph, static, pinned = self.graphs[key]
            for name in seg.inputs:
                if env[name] is static[name]:
                    continue
                if name in pinned:
                    raise MovedTensorError(f"graph {graph.name}: input {name!r} is no longer the "
                                           "tensor it was captured over")
                static[name].copy_(env[name])
            outputs = graph.replay()
        env.update(zip(seg.outputs, outputs))
        stable.update(id(o) for o in outputs)

    def _sources(self, names, rows: int) -> dict[str, torch.Tensor]:
        """Where stable inputs live now: the guard compares them with the capture."""
        views = self.slots.view(rows) if self.slots and rows <= self.slots.capacity else {}
        return {n: self.kv_cache if n == "kv_cache" else views.get(n) for n in names}


def _scrub(seg, env, size, live) -> None:
    """Zero the padded rows of an eager segment's row-shaped outputs."""
    if size is None or live is None or live >= size:
        return
    for name in seg.outputs:
        value = env[name]
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == size:
            value[live:] = 0
