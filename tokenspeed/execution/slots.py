"""Persistent buffers that captured graphs read (metadata, sampling settings).

All slotted fields live in one device byte buffer, each a typed view sized for the largest
batch; the views for a batch size are built once, cached, and never move. Publishing
writes a descriptor (built on the host) into a pinned staging copy of that buffer and
moves the part the batch uses with one host-to-device copy, so a graph captured over the
views sees each step's values at the same addresses. Two staging copies alternate, so the
host can stage step n+1 while the copy for step n may still be queued behind the GPU.
"""

import attrs
import torch

from tokenspeed.errors import InternalError
from tokenspeed.ir.descriptors import tensor_fields
from tokenspeed.execution.host_to_device import to_device_async

ALIGN = 64


@attrs.frozen(eq=False)
class Staged:
    """A descriptor staged for publishing (``MetadataSlots.stage``): the staging copy
    holding its first ``end`` bytes (``turn``; None where the slots have no staging copies
    or nothing is sent); ``current``: it is the descriptor published last, already on the
    device; ``stage``: which of the slots' stagings it is (only the latest is sent)."""
    meta: object
    turn: int | None
    end: int
    current: bool
    stage: int


class MetadataSlots:
    def __init__(self, template, capacity: int, device, fields: tuple[str, ...] | None = None,
                 staged: bool | None = None, lengths: dict | None = None):
        """``template``: a host descriptor with ``capacity`` rows in each slotted field;
        ``staged``: publish through host staging copies (default: on CUDA, pinned);
        ``lengths``: for a field whose rows are not the batch's rows (a table of fixed rows,
        a tile plan), its rows in a batch of ``rows``, from that function of ``rows``. Such a
        field's view has that many rows whatever a descriptor holds: a publish copies the
        descriptor's rows into its first rows and leaves the rest as they were."""
        self.fields = fields or tensor_fields(type(template))
        self.lengths = lengths or {}
        self.capacity, self.device = capacity, torch.device(device)
        specs = sorted(((n, _full(getattr(template, n), self._rows(n, capacity))) for n in self.fields),
                       key=lambda s: _row_bytes(s[1]))
        offsets, size = [], 0
        for _, t in specs:
            offsets.append(size)
            size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        self._row_spans = [(n, o, _row_bytes(t)) for (n, t), o in zip(specs, offsets)]
        self.device_bytes = torch.zeros(size, dtype=torch.uint8, device=self.device)
        pinned = self.device.type == "cuda"
        self.host_bytes = [torch.zeros(size, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)] \
            if (pinned if staged is None else staged) else [self.device_bytes]
        self.buffers = {n: _typed(self.device_bytes, o, t) for (n, t), o in zip(specs, offsets)}
        self.staging = [{n: _typed(host, o, t) for (n, t), o in zip(specs, offsets)}
                        for host in self.host_bytes]
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        self._field_views: dict[tuple[str, int], torch.Tensor] = {}
        self._staging_views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._turn = 0      # the staging copy sent last: the next stage writes the other
        self._stages = 0    # stagings so far
        self._others: dict[type, tuple[str, ...]] = {}
        self._last = (None, None)  # (descriptor published last, what publish returned)

    def view(self, rows: int) -> dict[str, torch.Tensor]:
        if rows > self.capacity:
            raise InternalError(f"batch of {rows} rows exceeds the slots' capacity {self.capacity}")
        if rows not in self._views:
            self._views[rows] = {n: self._field_view(n, self._rows(n, rows)) for n in self.buffers}
        return self._views[rows]

    def _rows(self, name: str, rows: int) -> int:
        return self.lengths[name](rows) if name in self.lengths else rows

    def _field_view(self, name: str, length: int) -> torch.Tensor:
        """One view per field and length: batches whose field has as many rows share it (a
        table of fixed rows is one tensor for every batch)."""
        if (name, length) not in self._field_views:
            self._field_views[name, length] = self.buffers[name][:length]
        return self._field_views[name, length]

    def publish(self, meta):
        """Stage ``meta``'s slotted fields and copy them over in one transfer; returns
        ``meta`` over the views of its size, its other tensors moved to the device.

        Republishing the descriptor published last is free: the device bytes still hold
        it, since nothing but ``send`` writes these slots between two publishes (the one
        outside write, the decode runner's chained input ids, goes into metadata slots,
        whose descriptor is new every step). The decode runner relies on it to keep
        unchanged sampling settings off the per-step path."""
        return self.send(self.stage(meta))

    def stage(self, meta) -> "Staged":
        """A publish's host part: ``meta``'s slotted fields written to the next staging copy,
        nothing enqueued (``send`` does that), so the host can stage a step while the device
        still reads the slots for the one before. Slots without staging copies write at
        ``send``. The copy written is the one not sent last, so a staging never sent (a
        step abandoned) leaves the alternation as it was."""
        if meta is self._last[0]:
            return Staged(meta, None, 0, current=True, stage=self._stages)
        self._stages += 1
        if self.host_bytes[0] is self.device_bytes:
            return Staged(meta, None, 0, current=False, stage=self._stages)
        rows, turn = getattr(meta, self.fields[0]).shape[0], (self._turn + 1) % len(self.host_bytes)
        return Staged(meta, turn, self._stage(meta, self._staging_view(turn, rows)), current=False,
                      stage=self._stages)

    def send(self, staged: "Staged"):
        """Enqueue a staged descriptor's copy (publish's device part); returns it over the
        views of its size, its other tensors moved to the device."""
        meta = staged.meta
        if staged.current:
            if meta is not self._last[0]:
                raise InternalError("a descriptor staged as the one published last was published over "
                                    "before it was sent")
            return self._last[1]
        if staged.stage != self._stages:
            raise InternalError(f"staging {staged.stage} was staged over (by staging {self._stages}) before "
                                f"it was sent")
        rows = getattr(meta, self.fields[0]).shape[0]
        view = self.view(rows)
        if staged.turn is None:   # no staging copies: the device bytes are written in place
            self._stage(meta, self._staging_view(0, rows))
        else:
            self.device_bytes[:staged.end].copy_(self.host_bytes[staged.turn][:staged.end], non_blocking=True)
            self._turn = staged.turn
        others = {n: to_device_async(getattr(meta, n), self.device) for n in self._unslotted(type(meta))}
        self._last = (meta, attrs.evolve(meta, **view, **others))
        return self._last[1]

    def _stage(self, meta, staging: dict[str, torch.Tensor]) -> int:
        """Stage each field's rows (for a field of ``lengths``, the descriptor's, into the
        first rows of its view); the bytes from the buffer's start that hold them."""
        end = 0
        for name, offset, row in self._row_spans:
            value = getattr(meta, name)
            (staging[name][:value.shape[0]] if name in self.lengths else staging[name]).copy_(value)
            end = max(end, offset + value.shape[0] * row)
        return end

    def used_bytes(self, rows: int) -> int:
        """Bytes from the buffer's start that hold the views for ``rows``: what a publish
        copies (less, for a field of ``lengths`` whose descriptor holds fewer rows). Fields
        are laid out by bytes per row, widest last, so a small batch does not copy the block
        table's unused rows (32 KiB each at 131072 tokens of context)."""
        view = self.view(rows)
        return max(offset + view[name].shape[0] * row for name, offset, row in self._row_spans)

    def _unslotted(self, cls) -> tuple[str, ...]:
        """``cls``'s tensor fields outside the slots, looked up once per descriptor class."""
        if cls not in self._others:
            self._others[cls] = tuple(n for n in tensor_fields(cls) if n not in self.buffers)
        return self._others[cls]

    def _staging_view(self, turn: int, rows: int) -> dict[str, torch.Tensor]:
        """The first ``rows`` rows of one staging copy, built once per (turn, rows)."""
        if (turn, rows) not in self._staging_views:
            self._staging_views[turn, rows] = {n: t[:self._rows(n, rows)] for n, t in self.staging[turn].items()}
        return self._staging_views[turn, rows]


def _full(template: torch.Tensor, rows: int) -> torch.Tensor:
    """A stand-in of ``template``'s dtype and row shape with ``rows`` rows (no storage)."""
    return template if template.shape[0] == rows else \
        torch.empty((rows, *template.shape[1:]), dtype=template.dtype, device="meta")


def _row_bytes(t: torch.Tensor) -> int:
    return t[0].numel() * t.element_size() if t.dim() and t.shape[0] else 0


def to_device(meta, device):
    return attrs.evolve(meta, **{n: to_device_async(getattr(meta, n), device)
                                 for n in tensor_fields(type(meta))})


def _typed(raw: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    nbytes = like.numel() * like.element_size()
    return raw[offset:offset + nbytes].view(like.dtype).view(like.shape)
