"""The latent-attention (MLA) leaf: paged attention over a cache of one latent row per
token and layer (``kv_cache[layer, 0, page, offset, 0, latent + rope]``, no heads).

Its metadata is the paged leaf's (block tables, write locations, page 0 the null page):
only the pool's geometry and the kernels differ, and the kernels come with the IR's MLA
ops. Prefill's and decode's attention are both captured: on CUDA each row attends in the
absorbed form (``triton_mla``), reading nothing on the host and needing no tile plan. A
float8 pool is refused: the latent has no scales.
"""

import torch

from tokenspeed.backends.kernels import kv_fp8
from tokenspeed.backends.paged import PagedAttentionBackend
from tokenspeed.backends.pool_geometry import PoolGeometry
from tokenspeed.backends.support import CudaGraphSupport

LATENT_PARTS = 1


class MlaAttentionBackend(PagedAttentionBackend):
    cuda_graph_support = CudaGraphSupport(decode_graph=True, prefill_graph=True, prefill_attention=True)

    def check_pool(self, geometry: PoolGeometry, pool: torch.Tensor) -> None:
        if geometry.parts != LATENT_PARTS or geometry.num_kv_heads != 1:
            raise ValueError(f"the MLA backend reads one latent row per token (parts 1, heads 1); this cache "
                             f"group has {geometry.parts} parts of {geometry.num_kv_heads} heads")
        if kv_fp8.is_fp8(pool.dtype):
            raise ValueError("an MLA cache cannot be float8: latents are stored without scales "
                             "(kv_cache_dtype='auto' keeps the model's dtype)")
        super().check_pool(geometry, pool)


def backend_for(model_config) -> PagedAttentionBackend:
    """The leaf a model's caches need: latent rows (``cache_row`` of one part) or keys and values."""
    parts, _, _ = model_config.cache_row
    return MlaAttentionBackend() if parts == LATENT_PARTS else PagedAttentionBackend()
