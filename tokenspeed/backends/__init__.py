"""Backends: metadata functions, graph support, and the kernels behind the IR's ops
(registered here, at import, for every device type a backend serves)."""

from tokenspeed.backends.kernels.registry import register_kernels

register_kernels()
