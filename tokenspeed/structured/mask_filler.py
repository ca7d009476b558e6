"""Masks for a batch, filled on the engine's thread while the device runs the step's forward.

llguidance computes every row's mask in native code, without the GIL: rows of different
lexers in parallel (``LLExecutor``), rows whose matchers share one (``GrammarMatcher.copy``)
one after another, as the lexer's lock would serialise them anyway; a schema's requests are
spread over up to two lexers a thread for that (``engine.grammars``). The engine calls
``fill`` between launching a step's forward and its draw (``ConstrainedSteps``), so the
fill overlaps the forward. Not in a worker thread: a fill there waits for the GIL at each
row's return while the engine's thread runs Python (docs/PERFORMANCE.md, the thirty-fifth
and forty-seventh sessions).

A row is a ``MaskRow``: a matcher (or none, for a row with ``allowed_token_ids`` alone),
the row it fills, the tokens allowed besides (``allowed``: a packed row ANDed in) and,
for a speculative step, its draft tokens: the rows after ``row`` then get the masks
after each draft token (as far as the grammar takes them). Rows not named are all ones.

The host's own writes (the rows llguidance leaves set to all ones, ``allowed`` ANDed in)
go through numpy on the calling thread, never a torch op: a torch op over a batch's
bitmask (32 rows of a 49k vocabulary is past its grain) runs on torch's intra-op threads,
which then spin for a while on every core, just as llguidance's workers start; on a busy
two-core host that made a 32-row fill up to four times slower.
"""

from collections.abc import Sequence

import attrs
import llguidance
import numpy as np
import torch

from tokenspeed.cores import allowed_cpus
from tokenspeed.structured.bitmask import ALL_ALLOWED, check_host_bitmask
from tokenspeed.structured.matcher import GrammarMatcher

MAX_THREADS = 8


@attrs.frozen(eq=False)   # rows are never compared (a tensor has no truth value)
class MaskRow:
    matcher: GrammarMatcher | None
    row: int
    allowed: torch.Tensor | None = None
    drafts: tuple[int, ...] = ()


def _check_rows(rows: Sequence[MaskRow], size: int) -> None:
    """llguidance checks a row's first index only; its draft rows follow it unchecked."""
    for r in rows:
        if r.row < 0 or r.row + len(r.drafts) >= size:
            raise ValueError(f"mask row {r.row} with {len(r.drafts)} draft rows after it is outside "
                             f"a bitmask of {size} rows")


def _not_computed(rows: Sequence[MaskRow], size: int) -> list[int]:
    """The rows llguidance does not overwrite whole: those without a grammar, and a
    speculative row's window (its masks stop where the grammar stops taking the drafts).
    Usually none: then no numpy call at all (a step's host time at batch 1 is tens of us)."""
    computed = {r.row for r in rows if r.matcher is not None and not r.drafts}
    return [] if len(computed) == size else [row for row in range(size) if row not in computed]


def _batches(rows: Sequence[MaskRow]) -> list[list[MaskRow]]:
    """The calls to llguidance: with one lexer among the rows, a row at a time (llguidance
    computes a lone row on the calling thread; its workers would only queue on the lexer's
    lock); with several, one call, the rows sorted by lexer (the workers take runs of the list)."""
    if len({id(r.matcher.lexer) for r in rows}) <= 1:
        return [[r] for r in rows]
    return [sorted(rows, key=lambda r: id(r.matcher.lexer))]


def default_threads() -> int:
    """Half the CPUs this process may use, at most ``MAX_THREADS``: llguidance's own
    default (80% of the machine's cores, up to 32) leaves little to the engine's thread,
    torch's pool and a server's threads on the same cores, and its idle workers spin before
    they sleep. Only rows of different lexers are computed in parallel (``_batches``), so a
    schema keeps two lexers a thread where there are several (``engine.grammars``)."""
    return max(1, min(MAX_THREADS, allowed_cpus() // 2))


class MaskFiller:
    """Fills host bitmasks for batches; ``threads``: llguidance's workers (``default_threads``)."""

    def __init__(self, threads: int | None = None):
        self._executor = llguidance.LLExecutor(threads or default_threads())

    def fill(self, rows: Sequence[MaskRow], bitmask: torch.Tensor) -> torch.Tensor:
        """Writes the batch's masks into ``bitmask [rows, words]`` (host int32) and returns it."""
        check_host_bitmask(bitmask)
        _check_rows(rows, bitmask.shape[0])
        words = bitmask.numpy()
        unset = _not_computed(rows, len(words))
        if unset:
            words[unset] = ALL_ALLOWED
        where = (bitmask.data_ptr(), bitmask.shape[1] * bitmask.element_size(), bitmask.shape[0])
        for batch in _batches([r for r in rows if r.matcher is not None]):
            plain = [(r.matcher.matcher, r.row) for r in batch if not r.drafts]
            drafted = [(r.matcher.matcher, r.row, list(r.drafts)) for r in batch if r.drafts]
            if plain:
                self._executor.unsafe_compute_mask_ptr(plain, *where)
            if drafted:
                self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, *where)
        for r in rows:
            if r.allowed is not None:
                window = words[r.row: r.row + len(r.drafts) + 1]
                np.bitwise_and(window, r.allowed.numpy(), out=window)
        return bitmask
