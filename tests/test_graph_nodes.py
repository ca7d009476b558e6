"""The kernel count of a captured CUDA graph, read from the driver's list of its nodes: the
walk over a stand-in driver (the real one is read on the GPU, ``test_gpu``)."""

import pytest

from tokenspeed.execution import graph_nodes
from tokenspeed.execution.graph_nodes import UncountedGraph, kernel_nodes

KERNEL, MEMCPY, MEMSET = 0, 1, 2   # CUgraphNodeType


class StandInDriver:
    """``cuGraphGetNodes`` and ``cuGraphNodeGetType`` over a graph of nodes of ``kinds``."""

    def __init__(self, kinds, error_at=None):
        self.kinds, self.error_at = kinds, error_at

    def cuGraphGetNodes(self, graph, nodes, count):
        assert graph.value == 0x1234
        if nodes is not None:
            for i in range(count._obj.value):
                nodes[i] = 0x100 + i
        count._obj.value = len(self.kinds)
        return 0

    def cuGraphNodeGetType(self, node, kind):
        index = node.value - 0x100
        if index == self.error_at:
            return 400   # CUDA_ERROR_INVALID_HANDLE
        kind._obj.value = self.kinds[index]
        return 0


def test_only_kernel_nodes_are_counted(monkeypatch):
    driver = StandInDriver([KERNEL, MEMCPY, KERNEL, MEMSET, KERNEL])
    monkeypatch.setattr(graph_nodes.ctypes, "CDLL", lambda name: driver)
    assert kernel_nodes(0x1234) == 3


def test_an_empty_graph_has_no_kernels(monkeypatch):
    monkeypatch.setattr(graph_nodes.ctypes, "CDLL", lambda name: StandInDriver([]))
    assert kernel_nodes(0x1234) == 0


def test_a_driver_error_is_named_not_counted_as_zero(monkeypatch):
    monkeypatch.setattr(graph_nodes.ctypes, "CDLL", lambda name: StandInDriver([KERNEL, KERNEL], error_at=1))
    with pytest.raises(UncountedGraph, match="cuGraphNodeGetType returned CUDA driver error 400"):
        kernel_nodes(0x1234)


def test_a_missing_driver_library_is_named(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(graph_nodes.ctypes, "CDLL", missing)
    with pytest.raises(UncountedGraph, match="libcuda.so.1: cannot open"):
        kernel_nodes(0x1234)
