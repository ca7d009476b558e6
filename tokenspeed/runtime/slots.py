"""Persistent metadata buffers that captured graphs read.

Buffers are sized by ``max_decode_bs``; the view for a batch size is built once, cached,
and never moves. Publishing copies a descriptor into the view, so a graph captured over
a view sees each step's metadata at the same addresses.
"""

import torch

from tokenspeed.backends.descriptors import leaves, static_fields, tensor_fields


class MetadataSlots:
    def __init__(self, template, capacity: int):
        """``template``: a descriptor whose tensors have ``capacity`` rows (e.g. an idle refresh)."""
        self.cls = type(template)
        self.capacity = capacity
        self.buffers = {n: t.clone() for n, t in leaves(template).items()}
        self._views: dict[int, object] = {}

    def view(self, rows: int):
        if rows > self.capacity:
            raise ValueError(f"batch of {rows} rows exceeds the slots' capacity {self.capacity}")
        if rows not in self._views:
            statics = {n: rows for n in static_fields(self.cls)}
            self._views[rows] = self.cls(**{n: b[:rows] for n, b in self.buffers.items()}, **statics)
        return self._views[rows]

    def publish(self, meta):
        """Copy ``meta`` into the view of its size; returns that view."""
        rows = meta.input_ids.shape[0]
        view = self.view(rows)
        for name in tensor_fields(self.cls):
            getattr(view, name).copy_(getattr(meta, name))
        return view
