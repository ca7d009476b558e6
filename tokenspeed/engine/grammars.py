"""Grammars against the model's vocabulary, for the engine's constrained requests.

``ts.LLM`` has the tokenizer and hands the engine a ``Grammars`` over it (the engine never
imports the tokenizer). llguidance's view of the vocabulary (``guidance_tokenizer``) walks
every token: it is built at the first constrained request, so a model that never sees one
never pays for it. The model's vocabulary (its logits' width) may be wider than the
tokenizer's: the ids past it are empty tokens, which no mask allows.

A schema's requests get copies of one kept matcher (``GrammarMatcher.copy``): no compile on
the engine's thread, and one lexer whose states every request of the schema reuses. The
lexer only grows, so after ``COPIES_PER_LEXER`` requests the next ones start a fresh one.
"""

import threading

import attrs

from tokenspeed.structured import Grammar, GrammarMatcher, StructuredOutputs, compile_grammar, guidance_tokenizer

KEPT_GRAMMARS = 64
COPIES_PER_LEXER = 256


@attrs.define(eq=False)
class KeptGrammar:
    """A compiled grammar and the unused matcher its requests copy (made at the first)."""
    grammar: Grammar
    origin: GrammarMatcher | None = None
    copies: int = 0

    def matchers(self, guide, n: int) -> list[GrammarMatcher]:
        """``n`` copies of the kept matcher, a fresh one (and lexer) made when the last has
        served ``COPIES_PER_LEXER``: a lexer's states are never dropped, so one shared for
        the engine's life would grow towards llguidance's limit on them."""
        if self.origin is None or self.copies >= COPIES_PER_LEXER:
            self.origin, self.copies = GrammarMatcher(self.grammar, guide), 0
        self.copies += n
        return [self.origin.copy() for _ in range(n)]


class Grammars:
    def __init__(self, tokenizer, vocab_size: int):
        """``tokenizer``: the model's (``structured.vocabulary.Tokenizer``); ``vocab_size``:
        the model's logits' width."""
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._guide = None
        self._lock = threading.Lock()   # callers check requests on their own threads
        self._kept: dict[StructuredOutputs, KeptGrammar] = {}   # in use order, the newest last

    @property
    def guide(self):
        """llguidance's tokenizer, built once."""
        with self._lock:
            if self._guide is None:
                self._guide = guidance_tokenizer(self.tokenizer, self.vocab_size)
            return self._guide

    def matchers(self, spec: StructuredOutputs, n: int) -> list[GrammarMatcher]:
        """``n`` matchers of ``spec``'s grammar (a bad one refused, naming it)."""
        kept, guide = self._compiled(spec), self.guide
        with self._lock:
            return kept.matchers(guide, n)

    def check(self, spec: StructuredOutputs) -> None:
        """Refuse ``spec`` now if it does not compile (compiled, it is kept for its requests)."""
        self._compiled(spec)

    def _compiled(self, spec: StructuredOutputs) -> KeptGrammar:
        """``spec`` compiled, the last ``KEPT_GRAMMARS`` kept: a pipeline sends one schema with
        every request, and the engine's thread compiles while every request waits."""
        guide = self.guide
        with self._lock:
            kept = self._kept.pop(spec, None)
        kept = kept or KeptGrammar(compile_grammar(spec, guide))
        with self._lock:
            self._kept[spec] = kept
            if len(self._kept) > KEPT_GRAMMARS:
                del self._kept[next(iter(self._kept))]
        return kept
