"""The one decode path: refresh, publish into the slots, then replay or run eagerly.

Capture = idle refresh (no live rows, placeholder tables of null pages) + capture of the
whole step (model, logits, sampling) per ladder rung. Replay = ``refresh_decode`` padded
to the rung and staged on the host (``prepare``), then its copy and the replay
(``enqueue``). Eager = ``refresh_decode`` unpadded + the same step over the same slots;
batches above the ladder take it. Tokens land in one persistent buffer and reach the host
in one asynchronous copy: ``launch`` returns a ``StepFuture`` at once, so the host can
prepare the next step while the GPU runs this one. The step writes each row's token into
its request's seat of the token column (``token_column``), inside the graph; a chained
step takes its input tokens from there (``fed``). Rows whose sampling needs more than the
step's keyed Gumbel-max (penalties, masks, log-probabilities) are resampled from the
step's logits before the copy. A step with constrained rows is enqueued in two stages
(``prepare`` then ``enqueue``; then ``draw`` with the rows' masks), so the host computes
the masks while the device runs the model; a step whose rows need only their masks replays
its rung's captured masked draw (``masked_draws``).
"""

import attrs
import torch

from tokenspeed.backends.kernels.registry import direct_calls
from tokenspeed.backends.metadata import DecodeColumns, DecodeRow, decode_columns
from tokenspeed.errors import InternalError
from tokenspeed.execution.graphs import state_tensors
from tokenspeed.ir.descriptors import leaves
from tokenspeed.execution.ladders import bucket_for
from tokenspeed.execution.masked_draws import MaskedDraws
from tokenspeed.execution.sampler import RowSampling, SamplingTensors, gumbel_argmax, sample
from tokenspeed.execution.sampling_params import SamplingParams
from tokenspeed.execution.slots import MetadataSlots, Staged
from tokenspeed.execution.step_future import StepFuture, recorded_event
from tokenspeed.execution.step_masks import StepMasks
from tokenspeed.execution.token_column import FedRows

PAD_ROW = RowSampling(SamplingParams(temperature=0.0), seed=0)


@attrs.frozen(eq=False)
class DecodeInputs:
    """A decode step prepared on the host (``DecodeRunner.prepare``), not yet enqueued: its
    live rows, its rung (None: eager), its rows' sampling and fed rows, its metadata and
    settings staged for their copies, and whether a row is resampled whatever its masks."""
    bs: int
    rung: int | None
    sampling: list[RowSampling]
    fed: FedRows | None
    meta: Staged
    settings: Staged
    processed: bool


@attrs.frozen(eq=False)
class Forward:
    """A decode step whose first stage is enqueued (``DecodeRunner.enqueue``): its rung (None
    when run eagerly), its logits and positions (padded to the rung; the live rows first),
    its rows' sampling and their settings on the device, whether a row is resampled
    whatever its masks (``processed``), and the views its draw writes."""
    rung: int | None
    logits: torch.Tensor
    positions: torch.Tensor
    sampling: list[RowSampling]
    settings: SamplingTensors       # the rows' published settings, padded like the logits
    processed: bool
    seats: torch.Tensor
    out: torch.Tensor
    hosts: tuple[torch.Tensor, torch.Tensor]


class DecodeRunner:
    def __init__(self, program, kv_cache, backend, *, max_decode_bs: int, max_pages: int,
                 page_size: int, num_groups: int = 1, column: torch.Tensor | None = None):
        """``column``: the token column its rows write to and chained rows read from (None:
        no step of this runner is chained, as a verify step's)."""
        self.program, self.kv_cache, self.backend = program, kv_cache, backend
        self.column = column
        self.max_pages, self.page_size = max_pages, page_size
        self.num_groups = num_groups
        device = kv_cache.device
        self._segments = [(seg, direct_calls(seg.graph_module, device.type).forward) for seg in program.segments]
        self.slots = MetadataSlots(self.refresh((), max_decode_bs), max_decode_bs, device)
        self.sampling = MetadataSlots(self._padded([], max_decode_bs), max_decode_bs, device)
        self.out = torch.zeros(max_decode_bs, dtype=torch.int64, device=device)  # tokens
        pinned = kv_cache.is_cuda
        self.host_out = [torch.zeros_like(self.out, device="cpu", pin_memory=pinned) for _ in range(2)]
        self._turn = 0
        self._last_settings = ((), None)  # (key, (settings, ...)): unchanged ones republish free
        self._views: dict[tuple[int, int], tuple] = {}
        self.graphs: dict[int, object] = {}
        self.ladder: tuple[int, ...] = ()
        self.masked = MaskedDraws(max_decode_bs, device) if column is not None else None   # chained steps' draws

    def columns(self, rows: list[DecodeRow]) -> DecodeColumns:
        """``rows`` as the columns ``launch`` also takes (a decode chain keeps them)."""
        return decode_columns(rows, self.max_pages, self.num_groups)

    def refresh(self, rows, num_rows: int):
        """Host-side descriptor; publishing moves it to the device in one copy."""
        return self.backend.refresh_decode(rows, num_rows, self.max_pages, self.page_size,
                                           num_groups=self.num_groups)

    def capture(self, capturer, ladder: tuple[int, ...], progress=None, name: str = "decode") -> None:
        """Largest rung first, so smaller graphs reuse the shared pool's memory; with a token
        column, each rung's masked draw too (``masked_draws``)."""
        self.ladder = ladder
        for bs in sorted(ladder, reverse=True):
            view, sampling, out = self.idle_inputs(bs)
            reach = lambda bs=bs: self.reach(bs)  # noqa: E731
            self.graphs[bs] = capturer.capture(
                f"{name}[bs={bs}]", lambda v=view, s=sampling, o=out: self.step(v, s, o), reach=reach,
                count_kernels=True)
            if self.masked is not None:
                draw = lambda l=self.graphs[bs].outputs, v=view, s=sampling, o=out: \
                    self.masked.step(l, s, v.positions, o, self.column)  # noqa: E731
                self.masked.capture(capturer, f"{name}.masked_draw[bs={bs}]", bs, draw, reach)
            if progress is not None:
                progress.update(1)

    def dry_step(self, bs: int) -> None:
        """Rung ``bs``'s idle step (and masked draw), eagerly: under ``precompile.dry_run``
        it records the kernel variants its capture will launch (sampling keeps no state to
        restore)."""
        view, sampling, out = self.idle_inputs(bs)
        logits = self.step(view, sampling, out)
        if self.masked is not None:
            self.masked.step(logits, sampling, view.positions, out, self.column)

    def idle_inputs(self, bs: int) -> tuple:
        """The step's inputs for rung ``bs`` with no live rows: the published metadata and
        sampling settings, and the output rows."""
        return (self.slots.publish(self.refresh((), bs)), self.sampling.publish(self._padded([], bs)),
                self.out[:bs])

    def reach(self, bs: int) -> dict[str, torch.Tensor]:
        """Every tensor the step for ``bs`` reads or writes through the slots, and the
        weights it reads."""
        named = {f"meta.{n}": t for n, t in self.slots.view(bs).items()}
        named.update({f"sampling.{n}": t for n, t in self.sampling.view(bs).items()})
        state = state_tensors(*(s.graph_module for s in self.program.segments))
        column = {} if self.column is None else {"column": self.column}
        return {**named, **state, "kv_cache": self.kv_cache, "out": self.out, **column}

    def run(self, rows, sampling: list[RowSampling]) -> list[int]:
        """One sampled token per row."""
        return self.launch(rows, sampling).tokens()

    def launch(self, rows: list[DecodeRow] | DecodeColumns, sampling: list[RowSampling],
               fed: FedRows | None = None, masks: StepMasks | None = None) -> StepFuture:
        """Enqueue one step. ``fed``: every row's input is its request's unread token, read
        from the token column at the row's seat (a chained step); else the rows' tokens.
        ``masks``: the constrained rows' token masks."""
        return self.draw(self.enqueue(self.prepare(rows, sampling, fed)), masks)

    def prepare(self, rows: list[DecodeRow] | DecodeColumns, sampling: list[RowSampling],
                fed: FedRows | None = None) -> "DecodeInputs":
        """The first stage's host work: the rung, the metadata and sampling settings staged
        for their copies. Nothing is enqueued, so the engine prepares a step while the
        device still runs (and the host has yet to draw) the one before."""
        bs = len(rows)
        rung = bucket_for(self.ladder, bs) if self.graphs else None
        settings, processed = self._settings(sampling, rung or bs)
        return DecodeInputs(bs, rung, sampling, fed, self.slots.stage(self.refresh(rows, rung or bs)),
                            self.sampling.stage(settings), processed)

    def enqueue(self, inputs: "DecodeInputs") -> "Forward":
        """The first stage's device work: the staged copies, the fed rows' gather, and the
        rung's replay (or the eager step): the graph (model, keyed draw of every row, column
        write). ``draw`` enqueues the rest; until it has, the step's tokens are neither
        final nor on their way to the host."""
        input_ids, seats, out, hosts = self._row_views(inputs.bs, inputs.rung or inputs.bs)
        view = self.slots.send(inputs.meta)
        settings = self.sampling.send(inputs.settings)
        if inputs.fed is not None:
            self._feed(input_ids, inputs.fed, seats)
        logits = self.step(view, settings, out) if inputs.rung is None else self.graphs[inputs.rung].replay()
        return Forward(inputs.rung, logits, view.positions, inputs.sampling, settings, inputs.processed, seats,
                       out, hosts)

    def draw(self, forward: "Forward", masks: StepMasks | None = None) -> StepFuture:
        """The step's second stage: rows whose sampling needs more than the graph's draw
        (``masks``, processing) drawn again from its logits into the column, then the
        tokens' copy to the host. Enqueued after ``enqueue``, before the next step's (which
        may already be prepared)."""
        logprobs, out, replayed = None, forward.out, False
        if forward.processed or masks is not None:
            bs = len(forward.sampling)
            if masks is not None and masks.masks_only and not forward.processed:
                replayed = self.masked is not None and self.masked.replay(forward.rung, masks.bitmask)
                if not replayed:
                    masks.draw(forward.logits[:bs], forward.settings.head(bs), forward.positions[:bs], out,
                               self.column)
            else:
                logprobs = sample(forward.logits[:bs], forward.sampling, forward.positions[:bs], out=out,
                                  settings=forward.settings.head(bs), masks=masks).logprobs
                self._write_column(forward.seats, out)
        self._turn ^= 1
        host = forward.hosts[self._turn]
        host.copy_(out, non_blocking=True)
        future = StepFuture(host, recorded_event(self.kv_cache.device), forward.sampling, logprobs)
        if replayed:
            self.masked.staged_until(future.event)
        return future

    def _feed(self, input_ids: torch.Tensor, fed: FedRows, seats: torch.Tensor) -> None:
        """The rows' inputs from the token column. Each row reads the seat it writes (its
        request's: ``fed.seats``), which the published sampling settings already hold on
        the device (``seats``): one gather, nothing copied from the host."""
        if len(fed.rows) != len(input_ids) or self.column is None:
            raise InternalError(f"a decode step of {len(input_ids)} rows fed {len(fed.rows)} rows "
                                f"{'without' if self.column is None else 'from'} a token column")
        torch.index_select(self.column, 0, seats, out=input_ids)

    def _write_column(self, seats: torch.Tensor, tokens: torch.Tensor) -> None:
        if self.column is not None:
            self.column.index_copy_(0, seats, tokens)

    def _row_views(self, bs: int, size: int) -> tuple:
        """The first ``bs`` rows of the input ids and the seats (of the slots' views for
        ``size``), of the output tokens and of both host copies: built once per pair, as each
        slice costs about a microsecond of every step."""
        if (bs, size) not in self._views:
            self._views[bs, size] = (self.slots.view(size)["input_ids"][:bs], self.sampling.view(size)["seat"][:bs],
                                     self.out[:bs], tuple(h[:bs] for h in self.host_out))
        return self._views[bs, size]

    def step(self, view, sampling: SamplingTensors, out):
        """The whole step; returns the logits (a graph's static output when captured)."""
        logits = self._model(view)
        gumbel_argmax(logits, sampling, view.positions, out, self.column)
        return logits

    @torch.no_grad()   # kernels called directly run under autograd, which the dispatcher skipped
    def _model(self, view) -> torch.Tensor:
        """The program's segments, their IR ops calling the device's kernels directly
        (``direct_calls``): the dispatcher's wrappers cost more than many of a decode step's
        kernels on the CPU (a cache write's version bump alone, for the kernel's 17
        arguments, about 100 us a layer), and a capture records only the kernels."""
        env = {"kv_cache": self.kv_cache, **leaves(view)}
        for seg, forward in self._segments:
            env.update(zip(seg.outputs, forward(*[env[name] for name in seg.inputs])))
        return env[self.program.output]

    def _padded(self, sampling: list[RowSampling], size: int) -> SamplingTensors:
        return SamplingTensors.build(list(sampling) + [PAD_ROW] * (size - len(sampling)), "cpu")

    def _settings(self, sampling: list[RowSampling], size: int) -> tuple[SamplingTensors, bool]:
        """The rows' settings padded to ``size``, and whether a row is resampled (its
        sampling needs more than the step's own). A request's settings and seed never
        change, so a batch's are mostly those of the step before: equal ones get back the
        same object, which the slots republish for free. Only a ``min_tokens`` mask ends
        as a row grows: those rows are asked again each step."""
        key = (size, *sampling)  # rows are kept per request: compared by identity first
        if key != self._last_settings[0]:
            masked = tuple(r for r in sampling if r.masked_until)
            self._last_settings = (key, (self._padded(sampling, size),
                                         any(r.masks_or_logprobs for r in sampling), masked))
        settings, always, masked = self._last_settings[1]
        return settings, always or any(r.needs_processing for r in masked)
