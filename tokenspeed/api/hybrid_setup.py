"""What ``ts.LLM`` does differently for a model with recurrent layers (``config.hybrid``).

Its state pools get a slot per sequence and the null slot before tracing, since the
traced graphs read the pools by address; with prefix caching, as many slots again for
state checkpoints (``scheduling/state_checkpoints.py``): each running request's mark, and
the kept states of requests that ended while seats are free. Speculative decoding is
refused: a rejected draft's recurrence would have to be rolled back.
"""

from tokenspeed.execution.token_column import NULL_SEAT
from tokenspeed.scheduling.state_checkpoints import StateCheckpoints


def state_checkpoints(config, max_num_seqs: int, prefix_caching: bool) -> StateCheckpoints | None:
    """The checkpoint slots past the seats, one per sequence, where prefix caching needs them."""
    if config.hybrid is None or not prefix_caching:
        return None
    return StateCheckpoints(first_slot=NULL_SEAT + 1 + max_num_seqs, count=max_num_seqs)


def prepare_states(model, max_num_seqs: int, checkpoints: StateCheckpoints | None) -> None:
    """Size ``model``'s state pools: slots 1..``max_num_seqs`` are the requests' seats, the
    checkpoints' slots follow."""
    if model.config.hybrid is not None:
        kept = 0 if checkpoints is None else checkpoints.count
        model.model.state_pools.allocate(NULL_SEAT + 1 + max_num_seqs + kept)


def checked_speculative(config, speculative) -> None:
    if config.hybrid is not None and speculative is not None:
        raise ValueError(f"speculative={speculative!r}: {config.architecture} has recurrent layers, whose "
                         f"state is not rolled back for rejected drafts; speculative decoding is not supported")
