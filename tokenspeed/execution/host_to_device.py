"""Host values onto the device without the host waiting for the GPU. A copy from pageable
memory to a GPU first waits for every kernel queued before it: a prefill step's sampling
settings so copied held the engine's thread until the step's whole forward had run, with
nothing of the next step prepared meanwhile. From pinned memory the copy is queued and the
host moves on (PyTorch's pinned-memory cache keeps the bytes until the copy has read them)."""

import torch


def to_device_async(host: torch.Tensor, device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``, its copy queued behind the work in flight."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def values_on(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A list of numbers as a ``dtype`` tensor on ``device``, as ``to_device_async``."""
    return to_device_async(torch.tensor(values, dtype=dtype), device)
