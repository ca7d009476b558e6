"""What a captured CUDA graph launches, read from the graph itself: the driver lists its
nodes and their kinds, so the count is the replay's, not a model of it.

A profile of an eager step counts kernels too (``Compiled.kernels_per_step``), but costs a
step under the profiler; the graph's own count costs a walk over its nodes at capture."""

import ctypes

KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL


class UncountedGraph(RuntimeError):
    """The driver could not list a graph's nodes: the count is missing, the graph is fine."""


def kernel_nodes(graph: int) -> int:
    """The kernel nodes of the ``cudaGraph_t`` at address ``graph`` (a ``CUgraph``: the
    runtime's and the driver's handles are one). Memset and memcpy nodes are not kernels
    and are not counted; the graphs captured here hold no child graphs."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")    # loaded by torch already: dlopen returns it
    except OSError as exc:
        raise UncountedGraph(f"the CUDA driver library did not load: {exc}") from exc
    handle, count = ctypes.c_void_p(graph), ctypes.c_size_t(0)
    _checked(driver.cuGraphGetNodes(handle, None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    _checked(driver.cuGraphGetNodes(handle, nodes, ctypes.byref(count)), "cuGraphGetNodes")
    kind = ctypes.c_int(-1)
    kernels = 0
    for node in nodes:
        _checked(driver.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
        kernels += kind.value == KERNEL_NODE
    return kernels


def _checked(result: int, call: str) -> None:
    if result != 0:
        raise UncountedGraph(f"{call} returned CUDA driver error {result}")
