"""What ``ts.LLM`` does differently for a model with recurrent layers (``config.hybrid``).

Its state pools get a slot per sequence and the null slot before tracing, since the
traced graphs read the pools by address. Speculative decoding is refused: a rejected
draft's recurrence would have to be rolled back, and no state checkpoints exist. Prefix
caching is turned off, with a log line: a cached prompt's pages would skip its recurrent
layers, whose state at the prefix's end is not kept.
"""

import logging

from tokenspeed.execution.token_column import NULL_SEAT

log = logging.getLogger(__name__)


def prepare_states(model, max_num_seqs: int) -> None:
    """Size ``model``'s state pools: slots 1..``max_num_seqs`` are the requests' seats."""
    if model.config.hybrid is not None:
        model.model.state_pools.allocate(NULL_SEAT + 1 + max_num_seqs)


def checked_speculative(config, speculative) -> None:
    if config.hybrid is not None and speculative is not None:
        raise ValueError(f"speculative={speculative!r}: {config.architecture} has recurrent layers, whose "
                         f"state is not rolled back for rejected drafts; speculative decoding is not supported")


def prefix_caching_for(config, enable_prefix_caching: bool) -> bool:
    if config.hybrid is not None and enable_prefix_caching:
        log.warning("%s: prefix caching is off (its recurrent layers' states are not kept with cached "
                    "prompts)", config.architecture)
        return False
    return enable_prefix_caching
