"""The two kinds of failure a caller must tell apart: a request this engine refuses (bad
input: the CLI prints one line, the server answers 400 naming the field) and an internal
fault (a broken invariant: it keeps its traceback, since the fix is in the code, not in
the input). Imports nothing of the package, so that every layer may raise them; and the
hint such a message gives for a misspelt name (``did_you_mean``)."""

import difflib
from collections.abc import Iterable


class RefusedRequest(ValueError):
    """A request this engine cannot serve. ``field``: what is at fault, ``"prompt"`` or a
    ``SamplingParams`` field, so that a server names its own field without reading the
    message; ``value``: the bad value found there; ``limit``: the bound it breaks, or None
    where the refusal is not a bound (stop strings without a tokenizer)."""

    def __init__(self, message: str, *, field: str, value: object, limit: object):
        super().__init__(message)
        self.field, self.value, self.limit = field, value, limit

    def __reduce__(self):
        """Pickled with its fields (an engine process may send it): the default passes
        ``args`` alone to a constructor whose fields are keyword-only."""
        return _refused, (str(self), self.field, self.value, self.limit)


def _refused(message: str, field: str, value: object, limit: object) -> RefusedRequest:
    return RefusedRequest(message, field=field, value=value, limit=limit)


class InternalError(RuntimeError):
    """An invariant of the engine broke: a fault in tokenspeed, not in what it was given.
    Distinct from ``ValueError`` so that no handler of bad input swallows it."""


def did_you_mean(name: str, names: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the known name ``name`` stands for: one it begins (a
    shortened name), else its closest spelling; empty where none is close."""
    names = tuple(names)
    close = [n for n in names if n.startswith(name)] or difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
