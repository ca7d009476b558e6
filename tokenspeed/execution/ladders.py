"""Bucket ladders: the sizes graphs are captured at. A ladder is a performance subset,
never a capacity limit: sizes above its top run eagerly."""

import bisect
import numbers

MAX_DECODE_LADDER = 256
MAX_NUM_SEQS = 65536   # requests a step may run: their seats' buffers (a block-table row each) are sized up front
# drafts a verify step may take a request: its window of num_tokens + 1 rows is buffered for
# every seat (10^9 drafts ran numpy out of memory at load); past a few, drafts are rarely all kept
MAX_DRAFT_TOKENS = 128
TOKEN_STEPS = ((256, 16), (512, 32), (1024, 64), (2048, 128))


def as_sizes(sizes):
    """A ladder option as a tuple, where it is a list of anything (``given_ladder`` checks
    the sizes); else as it is, for the check to name."""
    return tuple(sizes) if hasattr(sizes, "__iter__") and not isinstance(sizes, (str, bytes)) else sizes


def given_ladder(name: str, sizes) -> tuple[int, ...]:
    if not isinstance(sizes, tuple | list) or not all(is_integer(s) for s in sizes):
        raise TypeError(f"{name}={sizes!r}: must be a list of integers >= 1")
    ladder = tuple(sorted(set(int(s) for s in sizes)))
    if not ladder or ladder[0] < 1:
        raise ValueError(f"{name}={sizes!r}: need at least one size, every size >= 1")
    return ladder


def is_integer(value) -> bool:
    """An integer of any kind (Python's, numpy's), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def decode_ladder(max_num_seqs: int, capture_sizes=None) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 8 up to min(max_num_seqs, 256); ``capture_sizes`` overrides."""
    if capture_sizes is not None:
        return given_ladder("capture_sizes", capture_sizes)
    top = min(max_num_seqs, MAX_DECODE_LADDER)
    return _capped([1, 2, 4, 8] + list(range(16, MAX_DECODE_LADDER + 1, 8)), top)


def token_buckets(max_num_batched_tokens: int, buckets=None) -> tuple[int, ...]:
    """16..256 by 16, 288..512 by 32, 576..1024 by 64, 1152..2048 by 128; top =
    min(max_num_batched_tokens, 2048)."""
    if buckets is not None:
        return given_ladder("token_buckets", buckets)
    sizes, start = [], 0
    for end, step in TOKEN_STEPS:
        sizes.extend(range(start + step, end + 1, step))
        start = end
    return _capped(sizes, min(max_num_batched_tokens, TOKEN_STEPS[-1][0]))


def view_buckets(top: int) -> tuple[int, ...]:
    """Each rung at most 1.5x the one below (so padding stays under 1.5x), up to ``top``."""
    sizes = [1]
    while sizes[-1] < top:
        sizes.append(max(sizes[-1] + 1, sizes[-1] * 3 // 2))
    return _capped(sizes, top)


def bucket_for(ladder: tuple[int, ...], size: int) -> int | None:
    """The smallest rung >= size, or None when size is above the ladder."""
    i = bisect.bisect_left(ladder, size)
    return ladder[i] if i < len(ladder) else None


def _capped(sizes, top: int) -> tuple[int, ...]:
    kept = [s for s in sizes if s < top]
    return tuple(kept + [top]) if top >= 1 else ()
