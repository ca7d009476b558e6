"""Runs extend batches through the narrowed prefill program."""

import torch

from tokenspeed.backends.metadata import ExtendChunk, plan_extend


class PrefillRunner:
    def __init__(self, lowered, kv_cache, max_pages: int, page_size: int, view_width: int = 1):
        self.lowered, self.kv_cache = lowered, kv_cache
        self.max_pages, self.page_size, self.view_width = max_pages, page_size, view_width

    def plan(self, chunks: list[ExtendChunk]):
        return plan_extend(chunks, num_rows=sum(len(c.tokens) for c in chunks),
                           num_table_rows=len(chunks) + 1, max_pages=self.max_pages,
                           page_size=self.page_size, view_width=self.view_width,
                           device=self.kv_cache.device)

    def run(self, chunks: list[ExtendChunk]) -> torch.Tensor:
        """Logits of the completing chunks' last rows, in chunk order."""
        return self.lowered(self.kv_cache, self.plan(chunks))
