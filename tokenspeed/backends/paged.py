"""The paged-attention backend: MHA/GQA attention over the paged KV pool for every layer
and every cache group (full or sliding-window: a layer reads its group's block tables).

A backend owns the pure metadata functions its kernels read and declares which graphs it
can be captured in. A backend made of others lists them in ``child_backends``, so that the
tree answers for its graph support and judges the pool as one (``support.walk``); this
one is a leaf.
"""

import torch

from tokenspeed.backends import metadata
from tokenspeed.backends.pool_geometry import PoolGeometry
from tokenspeed.backends.support import CudaGraphSupport, resolve_cuda_graph_support


class PagedAttentionBackend:
    cuda_graph_support = CudaGraphSupport(decode_graph=True, prefill_graph=True, prefill_attention=True)
    refresh_decode = staticmethod(metadata.refresh_decode)
    plan_extend = staticmethod(metadata.plan_extend)

    def child_backends(self):
        return ()

    def check_pool(self, geometry: PoolGeometry, pool: torch.Tensor) -> None:
        """Refuse a pool this leaf's kernels would misread: only its page count may differ
        from ``geometry``, and it needs the null page and one more."""
        found = PoolGeometry.of(pool)
        wrong = geometry.differences(found)
        if wrong:
            raise ValueError(f"the KV pool does not fit this cache group: {'; '.join(wrong)}")
        if not pool.is_contiguous():
            raise ValueError("the KV pool must be contiguous: the kernels address its pages as flat slots")
        if pool.shape[2] < 2:
            raise ValueError(f"a KV pool needs at least 2 pages (page 0 is the null page); got {pool.shape[2]}")

    def graph_support(self) -> CudaGraphSupport:
        return resolve_cuda_graph_support(self)
