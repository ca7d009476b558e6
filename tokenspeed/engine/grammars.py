"""Grammars against the model's vocabulary, for the engine's constrained requests.

``ts.LLM`` has the tokenizer and hands the engine a ``Grammars`` over it (the engine never
imports the tokenizer). llguidance's view of the vocabulary (``guidance_tokenizer``) walks
every token: it is built at the first constrained request, so a model that never sees one
never pays for it. The model's vocabulary (its logits' width) may be wider than the
tokenizer's: the ids past it are empty tokens, which no mask allows.
"""

from tokenspeed.structured import GrammarMatcher, StructuredOutputs, compile_grammar, guidance_tokenizer


class Grammars:
    def __init__(self, tokenizer, vocab_size: int):
        """``tokenizer``: the model's (``structured.vocabulary.Tokenizer``); ``vocab_size``:
        the model's logits' width."""
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._guide = None

    @property
    def guide(self):
        """llguidance's tokenizer, built once."""
        if self._guide is None:
            self._guide = guidance_tokenizer(self.tokenizer, self.vocab_size)
        return self._guide

    def matchers(self, spec: StructuredOutputs, n: int) -> list[GrammarMatcher]:
        """``n`` matchers of ``spec``'s grammar, compiled once (a bad one refused, naming it)."""
        grammar = compile_grammar(spec, self.guide)
        return [GrammarMatcher(grammar, self.guide) for _ in range(n)]
