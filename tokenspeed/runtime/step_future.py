"""A step's sampled tokens on their way to the host: read them when they are needed,
so the host can prepare the next step meanwhile."""

from typing import NamedTuple

import torch

from tokenspeed.runtime.host_to_device import values_on
from tokenspeed.runtime.sampler import LogprobTensors


class FedTokens(NamedTuple):
    """Input tokens a step takes on the device: ``tokens[i]`` is the input of its token row
    ``rows[i]`` (rows of requests whose token the step before it samples)."""
    rows: tuple[int, ...]
    tokens: torch.Tensor


class StepFuture:
    """Tokens in a host buffer an asynchronous copy fills (``event`` marks its end), and
    the log-probabilities of the rows that asked for them."""

    def __init__(self, host: torch.Tensor, event, sampling, logprobs: LogprobTensors | None,
                 device: torch.Tensor):
        self.host, self.event, self.sampling, self.logprob_tensors = host, event, sampling, logprobs
        self.device = device

    def on_device(self, rows: list[int] | None = None) -> torch.Tensor:
        """The tokens where the step wrote them (only ``rows``, in that order, if given): the
        inputs of a step chained to this one, before the host has seen them."""
        if rows is None:
            return self.device
        return self.device[device_index(rows, self.device.device)]

    def tokens(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()

    def logprobs(self) -> list:
        """Per row: a ``TokenLogprobs``, or None for rows that did not ask."""
        if self.logprob_tensors is None:
            return [None] * len(self.sampling)
        return self.logprob_tensors.to_host(self.sampling, self.tokens())


def device_index(rows, device: torch.device) -> torch.Tensor:
    """``rows`` as an index tensor on ``device``, copied without waiting for the step in flight."""
    return values_on(rows, torch.int64, device)


def recorded_event(device: torch.device):
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event
