"""Breakable prefill: graph segments replayed per ladder rung, breaks run eagerly.

Encoder graph segments are captured per token bucket, decoder graph segments per
decoder-view bucket, all in one memory pool; narrowing, finish and (lowered with attention
breaks) attention run eagerly with live metadata, and the padded rows of every eager
output are zeroed (scrubbed) so no undefined rows flow on. Attention captured in a graph
reads the block table and tile plans, whose shapes the bucket alone must fix: the tile
plans are padded for the most chunks a step holds (``max_chunks``), and the graphs read
the table from a slot with a row for each of them; a step's table is copied into its
first rows (the rows past it keep an earlier step's pages: no tile names them). Inside
those graphs the attention output's padded rows are left undefined (no tile covers them);
they flow only through padded rows, whose cache writes go to the null page. A batch above
the largest bucket, or any batch when no graphs were captured, runs every segment
eagerly: one walk over the same segments. A step is enqueued in two stages, the walk
(``forward``) and the sampling (``draw``), which a step with constrained rows launches once
the host has their masks.
"""

import attrs
import torch

from tokenspeed.backends.kernels.registry import direct_calls
from tokenspeed.backends.metadata import kept_rows, tile_plan_length
from tokenspeed.errors import InternalError
from tokenspeed.ir.descriptors import leaves
from tokenspeed.execution.ladders import bucket_for
from tokenspeed.execution.host_to_device import values_on
from tokenspeed.execution.sampler import RowSampling, SamplingTensors, sample
from tokenspeed.execution.segment_graphs import SegmentGraphs
from tokenspeed.execution.slots import MetadataSlots, to_device
from tokenspeed.execution.step_future import StepFuture, recorded_event
from tokenspeed.execution.step_masks import StepMasks
from tokenspeed.execution.token_column import FedRows

TOKEN_ROW_FIELDS = ("input_ids", "positions", "slot_mapping", "row_request")


@attrs.frozen(eq=False)
class ExtendForward:
    """An extend step whose model is enqueued (``PrefillRunner.forward``): its sampled rows'
    logits and positions, and their sampling."""
    logits: torch.Tensor
    positions: torch.Tensor
    sampling: list[RowSampling]


class PrefillRunner:
    def __init__(self, program, kv_cache, backend, *, max_pages: int, page_size: int,
                 view_width: int, token_ladder, view_ladder, max_chunks: int, num_groups: int = 1,
                 column: torch.Tensor | None = None):
        """Empty ladders: no graphs, every batch runs unpadded. ``column``: the token column
        (``token_column``) its sampled rows write to and fed rows read from."""
        self.program, self.kv_cache, self.backend = program, kv_cache, backend
        self.column = column
        self.max_pages, self.page_size, self.view_width = max_pages, page_size, view_width
        self.num_groups = num_groups
        self.token_ladder, self.view_ladder = tuple(token_ladder), tuple(view_ladder)
        tables_in_graphs = bool(self.token_ladder) and \
            any("block_tables" in seg.inputs for seg in program.segments if seg.kind == "graph")
        self.max_chunks = max_chunks if tables_in_graphs else None
        fields, lengths = TOKEN_ROW_FIELDS, {}
        if tables_in_graphs:   # pinned like the token rows: one copy per step, none per graph
            fields += ("block_tables", "attention_tiles")
            lengths = {"block_tables": lambda rows: max_chunks + 1,
                       "attention_tiles": lambda rows: tile_plan_length(rows, max_chunks)}
        self.graphs = SegmentGraphs(("kv_cache", *fields))
        self.eager = {seg.name: direct_calls(seg.graph_module, kv_cache.device.type).forward
                      for seg in program.segments}   # what runs eagerly skips the dispatcher
        top = max(self.token_ladder, default=0)
        self.slots = MetadataSlots(self.plan([], top), top, kv_cache.device, fields, lengths=lengths) \
            if top else None

    def plan(self, chunks, num_rows: int, num_view_rows: int | None = None):
        """Host-side descriptor; publishing (or ``to_device``) moves it to the device."""
        return self.backend.plan_extend(chunks, num_rows=num_rows, num_table_rows=len(chunks) + 1,
                                        max_pages=self.max_pages, page_size=self.page_size,
                                        view_width=self.view_width, num_view_rows=num_view_rows,
                                        max_chunks=self.max_chunks, num_groups=self.num_groups)

    def capture(self, capturer, progress=None) -> None:
        """Every token bucket's graphs first, then every view bucket's, largest first.

        All graphs share one pool, where a graph captured later may hold its outputs in
        memory an earlier capture used for temporaries, so replaying the earlier graph
        overwrites them. A walk replays one token bucket's graphs and then one view
        bucket's; captured in that order, no graph a walk replays was captured before the
        graphs whose outputs it still needs (a view graph never before a token graph), for
        any pairing of the two buckets at run time."""
        for ladder, (tokens, view) in self.capture_walks():
            self._walk(self.slots.publish(self.plan([], tokens, view)), capturer, ladder)
            if progress is not None:
                progress.update(1)

    def dry_walk(self, tokens: int, view: int) -> None:
        """The capture walk of a token bucket and a view bucket, eagerly: under
        ``precompile.dry_run`` it records the kernel variants the captures will launch."""
        self._walk(self.slots.publish(self.plan([], tokens, view)))

    def capture_walks(self) -> list[tuple[str, tuple[int, int]]]:
        """(ladder captured, (token bucket, view bucket)) of each capture walk, in order."""
        if not self.token_ladder:
            return []
        smallest_view, smallest_tokens = min(self.view_ladder), min(self.token_ladder)
        walks = [("tokens", (t, smallest_view)) for t in sorted(self.token_ladder, reverse=True)]
        return walks + [("view", (smallest_tokens, v)) for v in sorted(self.view_ladder, reverse=True)]

    def run(self, chunks, sampling: list[RowSampling]) -> list[int]:
        """Sampled tokens of the completing chunks, in chunk order."""
        return self.launch(chunks, sampling).tokens()

    def launch(self, chunks, sampling: list[RowSampling], fed: FedRows | None = None) -> StepFuture:
        """Run the chunks; ``sampling``: one row per completing chunk, in chunk order;
        ``fed``: token rows whose inputs are unread tokens, read from the token column (their
        chunks are marked ``fed``). Each sampled row's token goes to its seat."""
        return self.draw(self.forward(chunks, sampling, fed))

    def forward(self, chunks, sampling: list[RowSampling], fed: FedRows | None = None) -> "ExtendForward":
        """The step's first stage, the model over the chunks, enqueued at once; ``draw``
        samples its rows (a step with constrained rows draws once their masks are known)."""
        tokens = sum(c.num_rows for c in chunks)
        views = sum(kept_rows(c, self.view_width) for c in chunks)
        t = bucket_for(self.token_ladder, tokens)
        v = bucket_for(self.view_ladder, views) if t else None   # above the buckets: all eager
        meta = self.plan(chunks, t or tokens, v)
        meta = self.slots.publish(meta) if t else to_device(meta, self.kv_cache.device)
        if fed is not None and fed.rows:
            self._feed(meta.input_ids, fed)
        logits = self._walk(meta, replay=t is not None)
        return ExtendForward(logits, meta.positions.index_select(0, meta.sample_rows), sampling)

    def draw(self, forward: "ExtendForward", masks: StepMasks | None = None) -> StepFuture:
        """The step's second stage: its rows sampled (``masks``: the constrained rows'), each
        token into its seat of the column and on its way to the host."""
        settings = SamplingTensors.build(forward.sampling, forward.logits.device)
        sampled = sample(forward.logits, forward.sampling, forward.positions, settings=settings, masks=masks)
        if self.column is not None:
            self.column.index_copy_(0, settings.seat, sampled.tokens)
        return StepFuture(sampled.tokens.to("cpu", non_blocking=True), recorded_event(forward.logits.device),
                          forward.sampling, sampled.logprobs)

    def _feed(self, input_ids: torch.Tensor, fed: FedRows) -> None:
        """Fed rows' inputs from the token column (their rows and seats in one copy)."""
        if self.column is None:
            raise InternalError(f"token rows {fed.rows} fed without a token column")
        rows, seats = values_on([fed.rows, fed.seats], torch.int64, input_ids.device)
        input_ids.index_copy_(0, rows, self.column.index_select(0, seats).to(input_ids.dtype))

    @torch.no_grad()   # kernels called directly run under autograd, which the dispatcher skipped
    def _walk(self, meta, capturer=None, capture_ladder: str | None = None, replay: bool = True) -> torch.Tensor:
        """Run every segment; with a capturer, capture the missing graphs of the segments
        padded by ``capture_ladder`` (others replay if captured and ``replay``, else run
        eagerly: a batch above the token buckets is not in the slots the graphs read)."""
        env = {"kv_cache": self.kv_cache, **leaves(meta)}
        sizes = {"tokens": meta.input_ids.shape[0], "view": meta.view_rows.shape[0]}
        live = {"tokens": meta.num_live_rows, "view": meta.num_live_view_rows}
        stable = {id(env[n]) for n in self.graphs.pinned_inputs}
        for seg in self.program.segments:
            rung = sizes.get(seg.ladder)
            if seg.kind == "graph" and replay and (seg.name, rung) in self.graphs:
                outputs = self.graphs.replay(seg, rung, env)
            elif seg.kind == "graph" and capturer is not None and seg.ladder == capture_ladder:
                outputs = self.graphs.capture(capturer, seg, rung, env, stable,
                                              lambda names, r=rung: self._sources(names, r))
            else:
                env.update(zip(seg.outputs, self.eager[seg.name](*[env[n] for n in seg.inputs])))
                _scrub(seg, env, rung, live.get(seg.ladder))
                continue
            env.update(zip(seg.outputs, outputs))
            stable.update(id(o) for o in outputs)
        return env[self.program.output]

    def _sources(self, names, rows: int) -> dict[str, torch.Tensor]:
        """Where pinned inputs live now: the guard compares them with the capture. A view
        bucket may pass the token buckets; its graphs read no token rows, only the table,
        which is one tensor for every batch."""
        views = self.slots.view(min(rows, self.slots.capacity)) if self.slots else {}
        return {n: self.kv_cache if n == "kv_cache" else views.get(n) for n in names}


def _scrub(seg, env, size, live) -> None:
    """Zero the padded rows of an eager segment's row-shaped outputs (``row_outputs``: a
    weight the segment passes on may have as many rows as the bucket; zeroing it by its
    shape emptied a 32-token vocabulary's head in the precompile dry run)."""
    if size is None or live is None or live >= size:
        return
    for name in seg.row_outputs:
        env[name][live:] = 0
