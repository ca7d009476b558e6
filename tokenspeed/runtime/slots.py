"""Persistent buffers that captured graphs read (metadata, sampling settings).

Buffers are sized for the largest batch; the views for a batch size are built once,
cached, and never move. Publishing copies a descriptor's slotted fields into the views of
its size and returns the descriptor over those views, so a graph captured over them sees
each step's values at the same addresses.
"""

import attrs
import torch

from tokenspeed.backends.descriptors import tensor_fields


class MetadataSlots:
    def __init__(self, template, capacity: int, fields: tuple[str, ...] | None = None):
        """``template``: a descriptor with ``capacity`` rows in each slotted field."""
        self.fields = fields or tensor_fields(type(template))
        self.capacity = capacity
        self.buffers = {n: getattr(template, n).clone() for n in self.fields}
        self._views: dict[int, dict[str, torch.Tensor]] = {}

    def view(self, rows: int) -> dict[str, torch.Tensor]:
        if rows > self.capacity:
            raise ValueError(f"batch of {rows} rows exceeds the slots' capacity {self.capacity}")
        if rows not in self._views:
            self._views[rows] = {n: b[:rows] for n, b in self.buffers.items()}
        return self._views[rows]

    def publish(self, meta):
        """Copy ``meta``'s slotted fields into the views of its size."""
        view = self.view(getattr(meta, self.fields[0]).shape[0])
        for name, slot in view.items():
            slot.copy_(getattr(meta, name), non_blocking=True)
        return attrs.evolve(meta, **view)
