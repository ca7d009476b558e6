"""Registers each backend's kernels as the implementations of the IR's ops, per device
type: the torch reference on the CPU, Triton (and cuBLAS) on CUDA. The IR declares the
ops and owns no kernel; an op on a device with nothing registered is an error."""

import functools

import torch
from torch import fx

from tokenspeed.backends.kernels import cuda, reference
from tokenspeed.errors import InternalError
from tokenspeed.ir.ops import OP_NAMES
from tokenspeed.ir.program import copy_graph

KERNELS_BY_DEVICE = {"cpu": reference, "cuda": cuda}


def register_kernels() -> None:
    for device, module in KERNELS_BY_DEVICE.items():
        for name in OP_NAMES:
            torch.library.register_kernel(f"tokenspeed::{name}", device, getattr(module, name))


def direct_calls(gm: fx.GraphModule, device_type: str) -> fx.GraphModule:
    """A copy of ``gm`` whose IR ops call ``device_type``'s kernels directly, for segments
    run eagerly. Through the dispatcher a custom op's call passes the Python wrappers of
    ``torch.library`` (dynamo guard, aliasing check) before its kernel: ~30 us a call
    (CPU), for each attention of every prefill step. Captured graphs hold only kernels,
    so only eager runs pay it. The kernels are the ones the dispatcher would pick. Each
    weight is read as an attribute of the copy itself (``_flat_attr``)."""
    kernels, direct = KERNELS_BY_DEVICE[device_type], copy_graph(gm, lazy=False)
    for node in direct.graph.nodes:
        name = _op_name(node)
        if name is not None:
            node.target = getattr(kernels, name)
        elif node.op == "get_attr" and "." in node.target:
            node.target = _flat_attr(direct, node.target)
    direct.recompile()
    return direct


def _flat_attr(gm: fx.GraphModule, target: str) -> str:
    """The name under which ``gm`` itself holds the tensor at ``target`` (a dotted path):
    a step then reads it with one lookup, not one per module on its path (six for a
    layer's projection, some 1,100 lookups a decode step of the default model)."""
    flat = "direct_" + target.replace(".", "_")
    tensor = functools.reduce(getattr, target.split("."), gm)
    if hasattr(gm, flat):   # a tensor read at several places
        if getattr(gm, flat) is not tensor:
            raise InternalError(f"{flat} (for {target}) is already another attribute of the segment")
    elif isinstance(tensor, torch.nn.Parameter):
        gm.register_parameter(flat, tensor)
    else:
        gm.register_buffer(flat, tensor, persistent=False)
    return flat


def _op_name(node: fx.Node) -> str | None:
    """The IR op ``node`` calls (``tokenspeed::name``, overload or packet), if any."""
    if node.op != "call_function" or not isinstance(node.target, (torch._ops.OpOverload,
                                                                  torch._ops.OpOverloadPacket)):
        return None
    namespace, name, *_ = str(node.target).split(".")
    return name if namespace == "tokenspeed" and name in OP_NAMES else None
