"""Slots of the recurrent state pools: one for each request a hybrid model runs.

A gated-DeltaNet layer keeps a fixed-size state per request (its convolution's last
inputs and its recurrence's matrix) instead of pages that grow with the sequence. A
request takes a slot when it is scheduled and gives it back when it finishes, is aborted
or is preempted (it then recomputes its state from its tokens). Slot 0 is the null slot
(``NULL_SLOT``) that padding rows use, as page 0 is for pages: never handed out.
"""

from tokenspeed.backends.metadata import NULL_SLOT
from tokenspeed.errors import InternalError


class OutOfSlots(RuntimeError):
    """Raised before any slot changes hands: the allocator's state is as it was."""


class StateSlots:
    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"num_slots={num_slots}: need at least 2 (slot 0 is the null slot)")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, NULL_SLOT, -1))   # the lowest slot first
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfSlots(f"all {self.num_slots - 1} state slots are held: a hybrid model runs at most "
                             f"that many requests at once")
        slot = self._free.pop()
        self._held.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._held:
            raise InternalError(f"state slot {slot} is not held")
        self._held.remove(slot)
        self._free.append(slot)

    def held(self) -> frozenset[int]:
        return frozenset(self._held)
