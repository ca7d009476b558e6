"""The token column: each running request's newest sampled token, on the device.

With overlap a step is launched before the host has read the tokens of the step before
it. A launch whose rows take those tokens as inputs (a chained decode step, a chained
extend batch's one-token rows) reads them from the column, as mini-sglang's overlap loop
reads its token pool: every running request holds a seat (taken as it starts running,
returned as it finishes or is preempted), every launch that samples writes each sampled
row's token into its request's seat, and a fed row reads its request's seat. Launches
run in order on one stream, so a fed row reads what the launch before it wrote. The
host's records never hold a token it has not read: ``Request.num_unread`` counts them.

Seat 0 (``NULL_SEAT``) is no request's: padding rows and rows whose tokens no launch
reads on the device write there, as padding rows write into the null page.
"""

import attrs
import torch

from tokenspeed.errors import InternalError

NULL_SEAT = 0


class Seats:
    """The host's record of which seats are free: seats 1..``capacity`` (one per request
    that may run at once)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free = list(range(capacity, 0, -1))   # popped from the end: lowest first

    def take(self) -> int:
        if not self._free:
            raise InternalError(f"a request starts running with all {self.capacity} seats taken")
        return self._free.pop()

    def give_back(self, seat: int) -> None:
        self._free.append(seat)

    @property
    def num_free(self) -> int:
        return len(self._free)


@attrs.frozen
class FedRows:
    """A launch's token rows whose inputs are unread tokens: row ``rows[i]`` reads the
    column at ``seats[i]``, its request's seat. A decode step is fed whole or not at all."""
    rows: tuple[int, ...]
    seats: tuple[int, ...]


def token_column(max_num_seqs: int, device) -> torch.Tensor:
    """The column of a model's runners: a seat for each of ``max_num_seqs`` requests and
    the null seat."""
    return torch.zeros(max_num_seqs + 1, dtype=torch.int64, device=device)
