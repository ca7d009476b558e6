"""What ``ts.LLM`` does differently for a model with recurrent layers (``config.hybrid``).

Its state pools get a slot per sequence and the null slot before tracing, since the
traced graphs read the pools by address; with prefix caching, as many slots again for
state checkpoints (``scheduling/state_checkpoints.py``): each running request's mark, and
the kept states of requests that ended while seats are free. On a GPU the pools are checked
against ``gpu_memory_utilization`` before they are allocated (the KV pool is sized from what
is left). Speculative decoding is refused: a rejected draft's recurrence would have to be
rolled back.
"""

import torch

from tokenspeed.execution.token_column import NULL_SEAT
from tokenspeed.scheduling.state_checkpoints import StateCheckpoints


def state_checkpoints(config, max_num_seqs: int, prefix_caching: bool) -> StateCheckpoints | None:
    """The checkpoint slots past the seats, one per sequence, where prefix caching needs them."""
    if config.hybrid is None or not prefix_caching:
        return None
    return StateCheckpoints(first_slot=NULL_SEAT + 1 + max_num_seqs, count=max_num_seqs)


def prepare_states(model, max_num_seqs: int, checkpoints: StateCheckpoints | None, utilization: float) -> None:
    """Size ``model``'s state pools: slots 1..``max_num_seqs`` are the requests' seats, the
    checkpoints' slots follow. On a GPU they must fit in the share ``utilization`` leaves."""
    if model.config.hybrid is not None:
        pools = model.model.state_pools
        slots = NULL_SEAT + 1 + max_num_seqs + (0 if checkpoints is None else checkpoints.count)
        check_states_fit(pools.conv.device, slots, pools.slot_bytes, max_num_seqs, utilization,
                         checkpoints is not None)
        pools.allocate(slots)


def check_states_fit(device, slots: int, slot_bytes: int, max_num_seqs: int, utilization: float,
                     checkpoints: bool) -> None:
    """A ValueError naming ``max_num_seqs`` where the pools would not fit in
    ``gpu_memory_utilization`` of the device beside what it already holds (the weights),
    rather than the allocator's out-of-memory error."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    held, need = total - free, slots * slot_bytes
    budget = int(total * utilization) - held
    if need > budget:
        kept = ", as many prefix-caching checkpoints" if checkpoints else ""
        raise ValueError(f"max_num_seqs={max_num_seqs}: the recurrent states take {slot_bytes / 2 ** 20:.1f} MiB "
                         f"a sequence, {need / 2 ** 30:.2f} GiB for {slots} slots (a seat a sequence{kept} and "
                         f"the null slot), more than the {max(budget, 0) / 2 ** 30:.2f} GiB that "
                         f"gpu_memory_utilization={utilization} leaves beside the {held / 2 ** 30:.2f} GiB the "
                         f"device holds; lower max_num_seqs"
                         f"{' or turn prefix caching off (enable_prefix_caching=False)' if checkpoints else ''}")


def checked_speculative(config, speculative) -> None:
    if config.hybrid is not None and speculative is not None:
        raise ValueError(f"speculative={speculative!r}: {config.architecture} has recurrent layers, whose "
                         f"state is not rolled back for rejected drafts; speculative decoding is not supported")
