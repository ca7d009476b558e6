"""The paged KV pool and its block allocator. Page 0 is the null page: never handed out,
the target of every padding row and table tail."""

import torch

from tokenspeed.backends.metadata import NULL_PAGE


class OutOfPages(RuntimeError):
    """Raised before any page changes hands: the allocator's state is as it was."""


CPU_KV_BYTES = 512 << 20
GPU_FREE_SHARE = 0.8


def allocate_kv_cache(config, num_pages: int, page_size: int, dtype, device) -> torch.Tensor:
    return torch.zeros(_shape(config, num_pages, page_size), dtype=dtype, device=device)


def default_num_pages(config, page_size: int, max_pages: int, max_num_seqs: int, dtype,
                      device: torch.device) -> int:
    """Enough pages for ``max_num_seqs`` requests of ``max_pages`` pages each (plus the
    null page), within a budget: 512 MiB on the CPU, 80% of free memory on a GPU."""
    wanted = max_num_seqs * max_pages + 1
    page_bytes = _shape(config, 1, page_size).numel() * torch.empty((), dtype=dtype).element_size()
    budget = CPU_KV_BYTES if device.type == "cpu" else \
        int(torch.cuda.mem_get_info(device)[0] * GPU_FREE_SHARE)
    return max(2, min(wanted, budget // page_bytes))


def _shape(config, num_pages: int, page_size: int) -> torch.Size:
    return torch.Size((config.num_layers, 2, num_pages, page_size, config.num_kv_heads,
                       config.head_dim))


class BlockAllocator:
    """Hands out pages and takes them back; a page several requests share (the prompt
    pages of ``n`` samples) is counted once per holder and returns to the free list when
    the last one lets go."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is the null page)")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self._holders: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} KV pages, {len(self._free)} of {self.num_pages - 1} free")
        pages = [self._free.pop() for _ in range(n)]
        self._holders.update(dict.fromkeys(pages, 1))
        return pages

    def share(self, pages) -> list[int]:
        """One more holder of each of ``pages`` (all allocated); returns them."""
        pages = list(pages)
        for page in pages:
            self._check_held(page)
        for page in pages:
            self._holders[page] += 1
        return pages

    def free(self, pages) -> None:
        for page in pages:
            self._check_held(page)
            self._holders[page] -= 1
            if not self._holders[page]:
                del self._holders[page]
                self._free.append(page)

    def holders(self, page: int) -> int:
        return self._holders.get(page, 0)

    def _check_held(self, page: int) -> None:
        if page not in self._holders:
            raise ValueError(f"page {page} is not allocated")
