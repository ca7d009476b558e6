"""Grammars against the model's vocabulary, for the engine's constrained requests.

``ts.LLM`` has the tokenizer and hands the engine a ``Grammars`` over it (the engine never
imports the tokenizer). llguidance's view of the vocabulary (``guidance_tokenizer``) walks
every token: it is built at the first constrained request, so a model that never sees one
never pays for it. The model's vocabulary (its logits' width) may be wider than the
tokenizer's: the ids past it are empty tokens, which no mask allows.
"""

import threading

from tokenspeed.structured import Grammar, GrammarMatcher, StructuredOutputs, compile_grammar, guidance_tokenizer

KEPT_GRAMMARS = 64


class Grammars:
    def __init__(self, tokenizer, vocab_size: int):
        """``tokenizer``: the model's (``structured.vocabulary.Tokenizer``); ``vocab_size``:
        the model's logits' width."""
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._guide = None
        self._lock = threading.Lock()   # callers check requests on their own threads
        self._kept: dict[StructuredOutputs, Grammar] = {}   # in use order, the newest last

    @property
    def guide(self):
        """llguidance's tokenizer, built once."""
        with self._lock:
            if self._guide is None:
                self._guide = guidance_tokenizer(self.tokenizer, self.vocab_size)
            return self._guide

    def matchers(self, spec: StructuredOutputs, n: int) -> list[GrammarMatcher]:
        """``n`` matchers of ``spec``'s grammar (a bad one refused, naming it)."""
        grammar = self._compiled(spec)
        return [GrammarMatcher(grammar, self.guide) for _ in range(n)]

    def check(self, spec: StructuredOutputs) -> None:
        """Refuse ``spec`` now if it does not compile (compiled, it is kept for its requests)."""
        self._compiled(spec)

    def _compiled(self, spec: StructuredOutputs) -> Grammar:
        """``spec`` compiled, the last ``KEPT_GRAMMARS`` kept: a pipeline sends one schema with
        every request, and the engine's thread compiles while every request waits."""
        guide = self.guide
        with self._lock:
            grammar = self._kept.pop(spec, None)
        grammar = grammar or compile_grammar(spec, guide)
        with self._lock:
            self._kept[spec] = grammar
            if len(self._kept) > KEPT_GRAMMARS:
                del self._kept[next(iter(self._kept))]
        return grammar
