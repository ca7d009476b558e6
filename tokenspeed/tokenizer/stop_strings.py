"""``StopStrings``: cut a request's text at the first stop string, across token boundaries.

A stop string can arrive in pieces ("<|e", "nd|>"), so text that could still be the
start of one is held back until the next piece decides it; the held text is released
the moment it can no longer begin a stop string.

The first stop is the one that completes first (the earliest end); when several end at
the same character, the longest wins. That is the only definition a stream can apply
without waiting for text that may never come, and applying the same rule to a whole
text gives the same cut.

Streaming caller (one matcher per request)::

    stops = StopStrings(["\\n\\nUser:", "</answer>"])
    for token_id in generated:
        check = stops.feed(detokenizer.push(token_id))
        send(check.text)
        if check.stopped:
            finish(reason="stop")       # the stop string and what follows are never sent
            break
    else:                               # generation ended (EOS, length): nothing is pending
        check = stops.feed(detokenizer.flush())
        send(check.text + ("" if check.stopped else stops.flush()))

Non-streaming caller: the same loop, appending each ``check.text`` to the output instead
of sending it, so generation still stops at the stop string; the joined text is what the
streaming caller sends. With a finished text in hand, ``stops.feed(text)`` then
``stops.flush()`` (when not stopped) gives the same cut.
"""

from collections.abc import Iterable

import attrs


@attrs.frozen
class StopCheck:
    """What ``feed`` decided: ``text`` may be emitted now; ``stopped``: a stop string was
    hit, ``stop`` names it."""

    text: str
    stopped: bool
    stop: str | None = None


def _first_stop(text: str, stops: tuple[str, ...], after: int = 0) -> tuple[int, str] | None:
    """Where the first stop string in ``text`` ending past its first ``after`` characters
    starts (earliest end, then longest), and which it is; None if there is none."""
    found = [(start + len(stop), -len(stop), start, stop) for stop in stops
             if (start := text.find(stop, max(after - len(stop) + 1, 0))) >= 0]
    return min(found)[2:] if found else None


def _held_length(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest tail of ``text`` that begins some stop string (0: none)."""
    return max((n for stop in stops for n in range(min(len(stop) - 1, len(text)), 0, -1)
                if text.endswith(stop[:n])), default=0)


class StopStrings:
    """A per-request matcher fed the detokenized deltas in order; ``include_stop``: the
    text found ends with the stop string (vLLM's ``include_stop_str_in_output``)."""

    def __init__(self, stops: Iterable[str], include_stop: bool = False):
        self._stops = tuple(dict.fromkeys(stops))
        self._include_stop = include_stop   # the text found ends after the stop, not before
        if "" in self._stops:
            raise ValueError("an empty stop string would stop before any text")
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, delta: str, match: bool = True) -> StopCheck:
        """The text that is safe to emit after ``delta``; after a stop, every feed is empty.
        ``match`` False: ``delta`` may not complete a stop string (it comes before
        ``min_tokens`` are reached), but its tail is held as any other, since a stop string
        that begins in it and completes in a later delta still counts (as vLLM matches it)."""
        if self._stopped:
            return StopCheck("", True)
        held = len(self._held)   # text fed before: a stop string ending in it was not matched
        text, self._held = self._held + delta, ""
        first = _first_stop(text, self._stops, after=held) if match else None
        if first is not None:
            self._stopped = True
            end = first[0] + len(first[1]) if self._include_stop else first[0]
            return StopCheck(text[:end], True, first[1])
        keep = _held_length(text, self._stops)
        self._held = text[len(text) - keep:]
        return StopCheck(text[:len(text) - keep], False)

    def flush(self) -> str:
        """Release the held tail when no more text will come (it can no longer complete a stop)."""
        held, self._held = ("" if self._stopped else self._held), ""
        return held
