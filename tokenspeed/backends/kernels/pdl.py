"""Programmatic dependent launch (PDL, Hopper and later): overlap a kernel's start with
the end of the kernel before it.

A decode step is a chain of a few hundred short kernels, and each boundary costs a launch
plus a round trip to memory before the next kernel's first bytes arrive. Launched with PDL,
kernel n+1 is scheduled as soon as every program of kernel n has started; its programs
may read what no kernel of the step writes (weights, the step's metadata, copied in before
its first kernel, and cache entries of earlier steps) and then ``wait`` for kernel n to
finish and flush its writes. The chain is sound only if every program of every PDL kernel calls
``wait`` before it reads an activation or writes anything: kernel n+1's wait covers
kernel n alone, and n's completion implies n-1's only because n waited too. A program
that does neither (a decode split with no keys) may end without waiting, as long as some
program of its kernel waits.

``TOKENSPEED_PDL=0`` turns it off (for measuring what it buys, or for debugging).
"""

import functools
import os

import torch
import triton
import triton.language as tl


def enabled(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get("TOKENSPEED_PDL", "1") == "0":
        return False
    return _major_capability(torch.cuda.current_device() if device.index is None else device.index) >= 9


@functools.cache
def _major_capability(index: int) -> int:
    """Asked at every launch: the property query took ~25 us a call (H200 host, profiled),
    twice per layer of every eager prefill step. A device's capability never changes."""
    return torch.cuda.get_device_capability(index)[0]


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch: the kernel's ``USE_PDL`` flag and, when on,
    the launch attribute that lets it start early."""
    return {"USE_PDL": True, "launch_pdl": True} if enabled(device) else {"USE_PDL": False}


@triton.jit
def start(USE_PDL: tl.constexpr):
    """Let the next kernel be scheduled now; it still waits for this one to finish."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait(USE_PDL: tl.constexpr):
    """Block until the previous kernel has finished and its writes are visible."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
