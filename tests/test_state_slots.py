"""The state slots of hybrid models: slot 0 is never handed out, no slot is held twice,
every slot returns, and running out changes nothing."""

import pytest
from hypothesis import given, settings, strategies as st

from tokenspeed.backends.metadata import NULL_SLOT
from tokenspeed.errors import InternalError
from tokenspeed.scheduling.state_slots import OutOfSlots, StateSlots


@settings(max_examples=60, deadline=None, derandomize=True)
@given(num_slots=st.integers(2, 9), actions=st.lists(st.tuples(st.booleans(), st.integers(0, 20)), max_size=60))
def test_no_slot_is_held_twice_and_every_slot_returns(num_slots, actions):
    slots, holders = StateSlots(num_slots), []
    for take, pick in actions:
        if take and slots.num_free:
            slot = slots.allocate()
            assert slot != NULL_SLOT and slot not in holders and 0 < slot < num_slots
            holders.append(slot)
        elif holders:
            slots.free(holders.pop(pick % len(holders)))
        assert slots.held() == frozenset(holders) and slots.num_free == num_slots - 1 - len(holders)
    for slot in holders:
        slots.free(slot)
    assert slots.num_free == num_slots - 1 and not slots.held()


def test_running_out_names_the_limit_and_changes_nothing():
    slots = StateSlots(3)
    taken = [slots.allocate(), slots.allocate()]
    with pytest.raises(OutOfSlots, match="all 2 state slots are held"):
        slots.allocate()
    assert slots.held() == frozenset(taken) and slots.num_free == 0


def test_freeing_a_slot_not_held_is_an_internal_error():
    slots = StateSlots(4)
    with pytest.raises(InternalError, match="state slot 2 is not held"):
        slots.free(2)
    with pytest.raises(ValueError, match="num_slots=1"):
        StateSlots(1)
