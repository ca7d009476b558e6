"""A completion's text as it grows: detokenized token by token, cut at a stop string.

Stop strings may span tokens, so text that could still begin one is held back; the
token that completes a stop string is the completion's last (the engine is told to
finish it). Before ``min_tokens`` tokens exist no stop string is matched.
"""

from tokenspeed.tokenizer import IncrementalDetokenizer, StopStrings


class TextStream:
    def __init__(self, tokenizer, params):
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.stops = StopStrings(params.stop)
        self.text = ""
        self.read = 0                    # characters of text a streaming reader has taken
        self.seen = 0                    # tokens of the completion read so far
        self.stop_string: str | None = None
        self.closed = False              # the completion ended and all its text is out

    def update(self, output: list[int], finished: bool) -> str:
        """Read the tokens added to ``output`` since the last call; returns the new text.
        After a stop string, ``stop_string`` names it and ``seen`` counts the tokens kept."""
        delta = []
        while self.seen < len(output) and self.stop_string is None:
            self.seen += 1
            delta.append(self._push(self.detokenizer.push(output[self.seen - 1])))
        if finished and self.stop_string is None and not self.closed:
            delta.append(self._push(self.detokenizer.flush()) + self.stops.flush())
        self.closed = finished or self.stop_string is not None
        new = "".join(delta)
        self.text += new
        return new

    @property
    def kept_tokens(self) -> int | None:
        """How many tokens the completion keeps: up to the one that completed its stop
        string (later ones were generated before the stop was seen), else all."""
        return self.seen if self.stop_string is not None else None

    def take_unread(self) -> str:
        new, self.read = self.text[self.read:], len(self.text)
        return new

    def _push(self, piece: str) -> str:
        if not self.params.stop or self.seen < self.params.min_tokens:
            return piece
        check = self.stops.feed(piece)
        self.stop_string = check.stop
        return check.text
