"""The backend tree: a runner-facing router over kernel-facing paged-attention leaves.

Leaves own the metadata functions their kernels read; the router exposes them to the
runtime and answers for the tree's graph support.
"""

from tokenspeed.backends import metadata
from tokenspeed.backends.support import CudaGraphSupport, resolve_cuda_graph_support


class PagedAttentionBackend:
    """Full-attention paged MHA/GQA: one cache group, every layer."""
    cuda_graph_support = CudaGraphSupport(decode_graph=True, prefill_graph=True)
    refresh_decode = staticmethod(metadata.refresh_decode)
    plan_extend = staticmethod(metadata.plan_extend)

    def child_backends(self):
        return ()


class CacheGroupRouter:
    """Routes the runner's calls to its leaves; today one leaf per model."""
    cuda_graph_support = CudaGraphSupport(decode_graph=True, prefill_graph=True)

    def __init__(self, leaves=None):
        self.leaves = tuple(leaves) if leaves else (PagedAttentionBackend(),)

    def child_backends(self):
        return self.leaves

    @property
    def leaf(self):
        return self.leaves[0]

    def graph_support(self) -> CudaGraphSupport:
        return resolve_cuda_graph_support(self)
