"""The one decode path: refresh, publish into the slots, run the decode segments.

Replay pads the batch to the next captured rung; eager (no rung fits, or graphs are off)
uses the unpadded refresh over the same slots and segments. Both go through
``refresh_decode``; there is no other decode-metadata code.
"""

import bisect

import torch

from tokenspeed.backends.metadata import DecodeRow, refresh_decode
from tokenspeed.runtime.slots import MetadataSlots


class DecodeRunner:
    def __init__(self, lowered, kv_cache, max_decode_bs: int, max_pages: int, page_size: int,
                 graphs=None):
        self.lowered, self.kv_cache = lowered, kv_cache
        self.max_pages, self.page_size = max_pages, page_size
        self.device = kv_cache.device
        idle = self.refresh((), max_decode_bs)
        self.slots = MetadataSlots(idle, max_decode_bs)
        self.graphs = graphs  # a GraphSet over the ladder, or None for eager only

    def refresh(self, rows, num_rows: int):
        return refresh_decode(rows, num_rows, self.max_pages, self.page_size, self.device)

    def padded_size(self, bs: int) -> int | None:
        """The rung a batch of ``bs`` replays at, or None when it runs eagerly."""
        if self.graphs is None:
            return None
        ladder = self.graphs.sizes
        i = bisect.bisect_left(ladder, bs)
        return ladder[i] if i < len(ladder) else None

    def run(self, rows: list[DecodeRow]) -> torch.Tensor:
        """Logits ``[len(rows), vocab]``."""
        bs = len(rows)
        rung = self.padded_size(bs)
        view = self.slots.publish(self.refresh(rows, rung or bs))
        if rung is None:
            logits = self.lowered(self.kv_cache, view)
        else:
            logits = self.graphs.replay(rung, view)
        return logits[:bs]
