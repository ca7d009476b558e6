"""A step's sampled tokens on their way to the host: read them when they are needed,
so the host can prepare the next step meanwhile."""

import torch

from tokenspeed.execution.host_to_device import values_on
from tokenspeed.execution.sampler import LogprobTensors


class StepFuture:
    """Tokens in a host buffer an asynchronous copy fills (``event`` marks its end), and
    the log-probabilities of the rows that asked for them."""

    def __init__(self, host: torch.Tensor, event, sampling, logprobs: LogprobTensors | None):
        self.host, self.event, self.sampling, self.logprob_tensors = host, event, sampling, logprobs

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
