"""Which graphs a backend tree can be captured in.

Each backend class declares ``cuda_graph_support``; the tree's support is the AND over
every node, resolved once at startup, and every class that turns a capability off is
logged by name. A capture that fails after support was declared is fatal.
"""

import logging

import attrs

log = logging.getLogger("tokenspeed.backends")


@attrs.frozen
class CudaGraphSupport:
    """``prefill_attention``: prefill attention is captured in its stage's graph (its
    kernels take a tile plan padded to the bucket); else it runs eagerly between graphs.
    A backend opts in: only a plan whose shapes the bucket fixes may be captured."""
    decode_graph: bool = True
    prefill_graph: bool = True
    prefill_attention: bool = False

    def __and__(self, other: "CudaGraphSupport") -> "CudaGraphSupport":
        return CudaGraphSupport(**{f.name: getattr(self, f.name) and getattr(other, f.name)
                                   for f in attrs.fields(CudaGraphSupport)})


def walk(backend):
    yield backend
    for child in backend.child_backends():
        yield from walk(child)


def resolve_cuda_graph_support(root) -> CudaGraphSupport:
    support = CudaGraphSupport(True, True, True)
    for node in walk(root):
        declared = type(node).cuda_graph_support
        for field in attrs.fields(CudaGraphSupport):
            if not getattr(declared, field.name):
                log.warning("%s does not support %s: it runs eagerly", type(node).__name__, field.name)
        support = support & declared
    return support
