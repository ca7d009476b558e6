"""Grammars against the model's vocabulary, for the engine's constrained requests.

``ts.LLM`` has the tokenizer and hands the engine a ``Grammars`` over it (the engine never
imports the tokenizer). llguidance's view of the vocabulary (``guidance_tokenizer``) walks
every token: it is built at the first constrained request, so a model that never sees one
never pays for it. The model's vocabulary (its logits' width) may be wider than the
tokenizer's: the ids past it are empty tokens, which no mask allows.

A schema's requests get copies of kept matchers (``GrammarMatcher.copy``): no compile on the
engine's thread once they are made, and lexers whose states the schema's requests reuse. A
lexer computes one mask at a time, so a schema keeps up to ``LEXERS_PER_THREAD`` per
mask-filling thread (``default_threads``) and gives each request the least busy: a batch's
rows of one schema then fill in parallel, and requests one at a time all use the first
lexer, whose states are warm. Two a thread rather than one: a row inside a bounded string
(a schema's ``maxLength``) walks the whole vocabulary (0.2-0.6 ms), and the rows sharing its
lexer wait for it; 32 rows over 16 lexers filled in 0.37-0.40 ms a step against 0.42-0.45
over 8, on 8 threads of an H100's host (docs/PERFORMANCE.md, fifty-third session). A lexer
only grows, so after ``COPIES_PER_LEXER`` requests it is replaced.
"""

import threading
import weakref

import attrs

from tokenspeed.structured import Grammar, GrammarMatcher, StructuredOutputs, compile_grammar, guidance_tokenizer
from tokenspeed.structured.mask_filler import default_threads

KEPT_GRAMMARS = 64
COPIES_PER_LEXER = 256
LEXERS_PER_THREAD = 2


def default_lexers() -> int:
    """``LEXERS_PER_THREAD`` a mask-filling thread; one where a single thread fills the
    masks (its rows are computed one after another whatever their lexers)."""
    threads = default_threads()
    return 1 if threads == 1 else LEXERS_PER_THREAD * threads


@attrs.define(eq=False)
class KeptLexer:
    """An unused matcher whose lexer its copies share; how many it has made, and those in use."""
    origin: GrammarMatcher
    copies: int = 0
    live: weakref.WeakSet = attrs.Factory(weakref.WeakSet)

    def copy(self) -> GrammarMatcher:
        matcher = self.origin.copy()
        self.copies += 1
        self.live.add(matcher)
        return matcher


@attrs.define(eq=False)
class KeptGrammar:
    """A compiled grammar and its lexers (``lexers`` at most, each made when the others are busy)."""
    grammar: Grammar
    lexers: int
    kept: list[KeptLexer] = attrs.Factory(list)

    def matchers(self, guide, n: int) -> list[GrammarMatcher]:
        """``n`` matchers, each a copy from the least busy lexer (the first of those: the
        most used, whose states are the most complete; a lexer builds them as it goes)."""
        return [self._least_busy(guide).copy() for _ in range(n)]

    def _least_busy(self, guide) -> KeptLexer:
        """A new lexer while every one is busy and there are fewer than ``lexers``; a fresh
        one for a lexer that has made ``COPIES_PER_LEXER`` copies: a lexer's states are never
        dropped, so one shared for the engine's life would grow towards llguidance's limit."""
        least = min(self.kept, key=lambda lexer: len(lexer.live), default=None)
        if least is None or (least.live and len(self.kept) < self.lexers):
            self.kept.append(KeptLexer(GrammarMatcher(self.grammar, guide)))
            return self.kept[-1]
        if least.copies >= COPIES_PER_LEXER:
            i = self.kept.index(least)
            self.kept[i] = KeptLexer(GrammarMatcher(self.grammar, guide))
            return self.kept[i]
        return least


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, lexers: int | None = None):
        """``tokenizer``: the model's (``structured.vocabulary.Tokenizer``); ``vocab_size``:
        the model's logits' width; ``lexers``: a schema's at most (``default_lexers``)."""
        if lexers is not None and lexers < 1:
            raise ValueError(f"lexers={lexers}: a schema needs at least one lexer")
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.lexers = default_lexers() if lexers is None else lexers
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
            if kept is not None:
                self._kept[spec] = kept   # the newest last
                return kept
        compiled = KeptGrammar(compile_grammar(spec, guide), self.lexers)   # outside the lock: milliseconds
        with self._lock:
            kept = self._kept.setdefault(spec, compiled)   # another thread's, if it compiled it first
            if len(self._kept) > KEPT_GRAMMARS:
                del self._kept[next(iter(self._kept))]
        return kept
