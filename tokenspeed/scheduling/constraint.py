"""What masks one request's tokens: its grammar's matcher (``structured_outputs``), its
``allowed_token_ids`` as a packed mask row, its ``logit_bias``.

The matcher follows the tokens the host reads (``accept``), so its mask is the next
token's once every token of the request is read; a step whose rows' masks wait for the
step before it is launched in two stages (``engine.constrained_steps``).
"""

import attrs
import torch

from tokenspeed.structured import GrammarMatcher, MaskRow, TokenBias


@attrs.define(eq=False)
class Constraint:
    matcher: GrammarMatcher | None
    allowed: torch.Tensor | None = None    # ``TokenBias.allowed_words``: the packed row
    bias: TokenBias | None = None          # kept only when it has a ``logit_bias``

    def accept(self, token: int) -> None:
        """A token the request keeps (its mask allowed it)."""
        if self.matcher is not None:
            self.matcher.accept(token)

    def release(self) -> None:
        """The request has ended: its matcher goes, so that its schema's lexer counts it idle
        (``engine.grammars``) while the request itself is still held (its answer unread)."""
        self.matcher = None

    @property
    def finished(self) -> bool:
        """The grammar is complete and takes nothing more: the request stops (as vLLM stops it)."""
        return self.matcher is not None and self.matcher.finished

    @property
    def masks(self) -> bool:
        return self.matcher is not None or self.allowed is not None

    def mask_row(self, row: int, drafts: tuple[int, ...] = ()) -> MaskRow:
        """Its mask at ``row`` of a step's bitmask (with ``drafts``: the rows after it, the
        masks after each draft token)."""
        return MaskRow(self.matcher, row, self.allowed, drafts)

    def valid_drafts(self, drafts: tuple[int, ...]) -> tuple[int, ...]:
        """The drafts the grammar takes from here, cut before an end of sequence (the
        window's rows after each draft are masked by the grammar's state after it, and no
        state follows an end)."""
        if self.matcher is None:
            return drafts
        kept = drafts[:self.matcher.valid_prefix(list(drafts))]
        ends = [i for i, t in enumerate(kept) if t in self.matcher.eos_token_ids]
        return kept[:ends[0]] if ends else kept
