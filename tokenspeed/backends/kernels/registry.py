"""Registers each backend's kernels as the implementations of the IR's ops, per device
type: the torch reference on the CPU, Triton (and cuBLAS) on CUDA. The IR declares the
ops and owns no kernel; an op on a device with nothing registered is an error."""

import torch

from tokenspeed.backends.kernels import cuda, reference
from tokenspeed.ir.ops import OP_NAMES

KERNELS_BY_DEVICE = {"cpu": reference, "cuda": cuda}


def register_kernels() -> None:
    for device, module in KERNELS_BY_DEVICE.items():
        for name in OP_NAMES:
            torch.library.register_kernel(f"tokenspeed::{name}", device, getattr(module, name))
