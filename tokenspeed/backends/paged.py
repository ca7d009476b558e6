"""The paged-attention backend: full-attention MHA/GQA over one cache group, every layer.

A backend owns the pure metadata functions its kernels read and declares which graphs it
can be captured in; ``child_backends`` lets a tree of them (one leaf per cache group,
under a router) answer for its support as one.
"""

from tokenspeed.backends import metadata
from tokenspeed.backends.support import CudaGraphSupport, resolve_cuda_graph_support


class PagedAttentionBackend:
    cuda_graph_support = CudaGraphSupport(decode_graph=True, prefill_graph=True)
    refresh_decode = staticmethod(metadata.refresh_decode)
    plan_extend = staticmethod(metadata.plan_extend)

    def child_backends(self):
        return ()

    def graph_support(self) -> CudaGraphSupport:
        return resolve_cuda_graph_support(self)
