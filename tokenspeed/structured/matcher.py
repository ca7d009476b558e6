"""``GrammarMatcher``: where one request stands in its grammar, token by token.

The engine feeds it every token the request keeps and asks it for the next step's mask
row. A speculative step checks its drafts first (``valid_prefix``), feeds the ones it
keeps, and ``rollback`` undoes tokens fed past a point. Once the grammar is complete
(``finished``) the mask allows only EOS; ``can_stop`` says EOS is allowed already.

A matcher made from a grammar compiles it and starts a lexer of its own, whose states
(a DFA built lazily, as bytes arrive) every mask and token walks through. ``copy`` makes
one in a few microseconds instead of the compile's milliseconds, and the copy shares the
lexer: states one request built serve the next, which made masks about three times
cheaper and tokens' acceptance twice (a JSON schema at batch 32, on the CPU). llguidance
locks a shared lexer for a whole mask, so rows of one lexer are computed one after
another (``MaskFiller``); ``lexer`` names it.
"""

import llguidance
import torch

from tokenspeed.errors import InternalError, RefusedRequest
from tokenspeed.structured.bitmask import check_host_bitmask
from tokenspeed.structured.grammar import Grammar, error_line


class Lexer:
    """What matchers sharing one llguidance lexer have in common (compared by identity)."""


class GrammarMatcher:
    """One request's llguidance matcher. Not thread-safe: one thread (the engine's) feeds
    it and fills its masks."""

    def __init__(self, grammar: Grammar, tokenizer: llguidance.LLTokenizer):
        self.grammar = grammar
        self.matcher = llguidance.LLMatcher(tokenizer, grammar.text, log_level=0)
        self.eos_token_ids = frozenset(tokenizer.eos_tokens)
        self.lexer = Lexer()
        if self.matcher.is_error():
            spec = grammar.spec
            raise RefusedRequest(f"structured_outputs.{spec.kind}: {self.matcher.get_error()}",
                                 field=f"structured_outputs.{spec.kind}",
                                 value=getattr(spec, spec.kind), limit=None)

    def copy(self) -> "GrammarMatcher":
        """A matcher where this one stands (a kept, unused one: the grammar's start), sharing
        its lexer; the two then move independently."""
        twin = object.__new__(GrammarMatcher)
        twin.grammar, twin.eos_token_ids, twin.lexer = self.grammar, self.eos_token_ids, self.lexer
        twin.matcher = self.matcher.deep_copy()
        return twin

    def accept(self, token: int) -> None:
        """Feeds a token the request keeps. The mask allowed it, so a refusal means the mask
        allowed nothing (the grammar and ``allowed_token_ids`` share no token) or the grammar
        passed one of llguidance's limits (a rule of thousands of alternatives, a grammar no text ends):
        the request's own constraints, refused for it alone (``ConstrainedSteps._accept``)."""
        if not self.matcher.consume_token(token):
            raise RefusedRequest(f"structured_outputs: the request's constraints left no token to sample "
                                 f"(llguidance: {error_line(self.matcher)}): a grammar past llguidance's "
                                 f"limits, or one that shares no token with allowed_token_ids",
                                 field="structured_outputs", value=token, limit=None)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (a speculative draft) the grammar takes from here, in order;
        nothing is fed. EOS counts where the text before it is complete (llguidance's own
        count stops at EOS once the grammar has finished)."""
        taken = self.matcher.validate_tokens(tokens)
        if taken < len(tokens) and tokens[taken] in self.eos_token_ids and self._complete_after(tokens[:taken]):
            taken += 1
        return taken

    def _complete_after(self, tokens: list[int]) -> bool:
        if not self.matcher.consume_tokens(tokens):
            raise InternalError(f"the grammar refused tokens {tokens} it had validated: {self.matcher.get_error()}")
        complete = self.can_stop
        self.rollback(len(tokens))
        return complete

    def rollback(self, num_tokens: int) -> None:
        if not self.matcher.rollback(num_tokens):
            raise InternalError(f"could not roll the grammar back {num_tokens} tokens: "
                                f"{self.matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar takes nothing more: only EOS may follow."""
        return self.matcher.is_stopped()

    @property
    def can_stop(self) -> bool:
        """The text so far is a complete match: EOS is allowed now."""
        return self.matcher.is_accepting()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the next token's mask into row ``row`` of a host ``[rows, words]`` bitmask."""
        check_host_bitmask(bitmask)
        words = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())
