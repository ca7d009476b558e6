"""Graph capture and replay: CUDA graphs on the GPU, a stand-in with the same address
discipline on the CPU.

Both record, at capture, the address, shape, stride and dtype of every tensor the graph
reads through its slots and of the parameters and buffers it reads (the pointer guard).
The CPU stand-in re-checks them on every replay and re-runs the recorded function into
the captured output tensors; CUDA replays re-check when ``TOKENSPEED_GRAPH_DEBUG=1``.
Captures happen at startup only: once the capturer is sealed, a capture is an error.
"""

import os
from collections.abc import Callable

import attrs
import torch

from tokenspeed.execution.graph_nodes import UncountedGraph, kernel_nodes

DEBUG_ENV = "TOKENSPEED_GRAPH_DEBUG"


class GraphCaptureError(RuntimeError):
    """A capture failed after the backend declared support: fatal, never an eager fallback."""


class LateCaptureError(RuntimeError):
    """A capture was attempted after startup."""


class MovedTensorError(RuntimeError):
    """A tensor a captured graph reads is no longer where the graph expects it."""


@attrs.frozen
class TensorAddress:
    ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorAddress":
        return cls(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


class PointerGuard:
    """Addresses recorded at capture, compared against what the slots reach now."""

    def __init__(self, graph_name: str, reach: Callable[[], dict[str, torch.Tensor]]):
        self.graph_name, self.reach = graph_name, reach
        self.recorded = {n: TensorAddress.of(t) for n, t in reach().items()}

    def check(self) -> None:
        now = self.reach()
        for name, before in self.recorded.items():
            after = TensorAddress.of(now[name]) if now.get(name) is not None else None
            if after != before:
                raise MovedTensorError(f"graph {self.graph_name}: tensor {name!r} moved since capture "
                                       f"(captured {before}, now {after})")


class RecordedGraph:
    """CPU stand-in: replay re-runs the recorded function into the captured outputs."""
    kernels, uncounted = None, "the CPU stand-in launches no device kernels"

    def __init__(self, fn: Callable):
        self.fn = fn
        self.outputs = fn()

    def replay(self):
        _copy_into(self.outputs, self.fn())
        return self.outputs


class CudaGraph:
    """A captured graph; with ``count_kernels``, the kernels it launches (``kernels``: its
    nodes counted before it is instantiated, so the graph is kept until then; None with
    ``uncounted`` saying why when the driver could not list them: a missing diagnostic
    does not stop an engine)."""

    def __init__(self, fn: Callable, pool, count_kernels: bool = False):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up: autotuning and lazy allocations happen outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph(keep_graph=count_kernels)
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn()
        self.kernels, self.uncounted = None, "not asked for"
        if count_kernels:
            try:
                self.kernels, self.uncounted = kernel_nodes(self.graph.raw_cuda_graph()), None
            except UncountedGraph as exc:
                self.uncounted = str(exc)
            self.graph.instantiate()

    def replay(self):
        self.graph.replay()
        return self.outputs


def state_tensors(*modules: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and buffers a graph reads by address, named for the guard.

    A module shared between engines must keep them in place: a replaced buffer leaves
    every graph captured over it reading freed memory."""
    named = {}
    for module in modules:
        named.update({f"state.{n}": t for n, t in module.named_parameters()})
        named.update({f"state.{n}": t for n, t in module.named_buffers()})
    return named


def _copy_into(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


class Captured:
    """One captured graph with its pointer guard."""

    def __init__(self, name: str, graph, guard: PointerGuard, check_every_replay: bool):
        self.name, self.graph, self.guard = name, graph, guard
        self.check_every_replay = check_every_replay

    @property
    def outputs(self):
        return self.graph.outputs

    @property
    def kernels(self) -> int | None:
        """Kernels a replay launches; None where they were not counted (``uncounted``: why)."""
        return self.graph.kernels

    @property
    def uncounted(self) -> str | None:
        return self.graph.uncounted

    def replay(self):
        if self.check_every_replay:
            self.guard.check()
        return self.graph.replay()


class GraphCapturer:
    """Captures graphs for one device into one shared memory pool until sealed."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.is_cuda else None
        self.sealed = False
        self.count = 0

    def capture(self, name: str, fn: Callable, reach: Callable[[], dict[str, torch.Tensor]],
                count_kernels: bool = False) -> Captured:
        """``count_kernels``: a CUDA graph's kernel nodes are counted (``Captured.kernels``)."""
        if self.sealed:
            raise LateCaptureError(f"capture of {name} requested after startup: graphs are captured "
                                   "at startup only")
        try:
            graph = CudaGraph(fn, self.pool, count_kernels) if self.is_cuda else RecordedGraph(fn)
        except Exception as exc:  # noqa: BLE001 - re-raised as fatal with the graph's name
            raise GraphCaptureError(f"capture of {name} failed: {exc}") from exc
        self.count += 1
        check = not self.is_cuda or os.environ.get(DEBUG_ENV) == "1"
        return Captured(name, graph, PointerGuard(name, reach), check)

    def seal(self) -> None:
        self.sealed = True
