"""The paged KV pool: one tensor of pages for every layer, sized to a memory budget. Page 0
is the null page: never handed out (``BlockAllocator``), the target of every padding row
and table tail."""

import torch


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
