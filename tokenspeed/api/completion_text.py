"""One completion's answer as the engine's tokens arrive: its text, detokenized token by
token and cut at a stop string, the tokens (and log-probabilities) it keeps, and its
final ``finish_reason``, decided here and nowhere else.

Stop strings may span tokens, so text that could still begin one is held back. The token
that completes a stop string is the completion's last: the answer is final at that point,
the tokens the engine made after it are dropped, and its owner tells the engine to
finish it. As in vLLM, a stop string is matched only where a token after the first
``min_tokens`` completes it (it may begin earlier: that text is held back as usual). The
token that ended the answer in the engine (end-of-sequence, or one of ``stop_token_ids``)
is kept as a token, but its text is not the answer's (as vLLM's): a reply whose special
tokens are kept for a tool parser never ends in ``<|im_end|>``.
``include_stop_str_in_output`` keeps both the stop string and that token's text.
"""

from tokenspeed.api.messages import TokenDelta
from tokenspeed.api.text_updates import CompletionDelta
from tokenspeed.execution.outputs import CompletionOutput
from tokenspeed.tokenizer import IncrementalDetokenizer, StopStrings


class CompletionText:
    """``tokenizer`` None: token ids only (no text, and no stop strings to match).
    ``at_end``: the text is read only once the answer is final and holds no stop string to
    look for (``PromptOutput.at_end``), so it is decoded then, at once
    (``IncrementalDetokenizer``'s ``deferred``)."""

    def __init__(self, tokenizer, params, index: int, at_end: bool = False):
        self.params, self.index = params, index
        self.detokenizer = None if tokenizer is None else \
            IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens,
                                   deferred=at_end)
        self.stops = StopStrings(params.stop, include_stop=params.include_stop_str_in_output)
        self._pieces: list[str] = []      # its text, as it came (joined when read)
        self._read = 0                    # pieces a streaming reader has taken
        self.token_ids: list[int] = []    # those it keeps
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def feed(self, delta: TokenDelta) -> CompletionDelta | None:
        """What the answer gained from the engine's ``delta``: text, the tokens kept, and
        the finish once final; None when nothing (as for every delta after the end)."""
        if self.finish_reason is not None:
            return None
        shown = len(delta.token_ids) - self._ending_token_hidden(delta)
        kept, stop, text = self._read_tokens(delta.token_ids[:shown], delta.finish_reason is not None)
        kept = len(delta.token_ids) if stop is None else kept   # the ending token, hidden or not
        self._decide_finish(delta, kept, stop)
        if not (text or kept or self.finish_reason):
            return None
        token_ids, logprobs = delta.token_ids[:kept], delta.logprobs[:kept]
        self._pieces.append(text)
        self.token_ids += token_ids
        self.logprobs += logprobs
        return CompletionDelta(self.index, text, token_ids, logprobs, self.finish_reason, self.stop_reason)

    def take_unread(self) -> str:
        new, self._read = "".join(self._pieces[self._read:]), len(self._pieces)
        return new

    def _ending_token_hidden(self, delta: TokenDelta) -> int:
        """1 when the delta's last token is the stop token that ended the answer and its
        text is left out; else 0."""
        ended_by_token = delta.stop_token is not None and delta.token_ids[-1:] == (delta.stop_token,)
        return int(ended_by_token and not self.params.include_stop_str_in_output)

    def _decide_finish(self, delta: TokenDelta, kept: int, stop: str | None) -> None:
        """A stop string ends the answer, unless the engine's token stop ended it at the same
        token (with ``include_stop_str_in_output`` the stop token's text is matched too: the
        engine's reason stands). The stop reason is a stop token's id, and None for an
        end-of-sequence token not among ``stop_token_ids``."""
        if stop is not None and not (delta.finish_reason == "stop" and kept == len(delta.token_ids)):
            self.finish_reason, self.stop_reason = "stop", stop
        elif delta.finish_reason is not None:
            token = delta.stop_token
            self.finish_reason = delta.finish_reason
            self.stop_reason = token if token in self.params.stop_token_ids else None

    def output(self) -> CompletionOutput:
        """The whole answer (its text None without a tokenizer)."""
        logprobs = tuple(self.logprobs) if self.params.logprobs is not None else None
        return CompletionOutput(self.index, tuple(self.token_ids), self.finish_reason,
                                None if self.detokenizer is None else self.text, self.stop_reason, logprobs)

    def _read_tokens(self, token_ids: tuple[int, ...], ended: bool) -> tuple[int, str | None, str]:
        """Detokenize ``token_ids`` up to a stop string (all of the held text too, once
        ``ended``): how many tokens it keeps, the stop string found, and the text."""
        if self.detokenizer is None:
            return len(token_ids), None, ""
        if not self.params.stop:   # every token kept: one pass, no matching (most requests)
            text = "".join(map(self.detokenizer.push, token_ids))
            return len(token_ids), None, text + self.detokenizer.flush() if ended else text
        pieces, stop, seen = [], None, len(self.token_ids)
        for token_id in token_ids:
            seen += 1
            piece, stop = self._push(self.detokenizer.push(token_id), seen)
            pieces.append(piece)
            if stop is not None:
                return seen - len(self.token_ids), stop, "".join(pieces)
        if ended:
            piece, stop = self._push(self.detokenizer.flush(), seen)
            pieces.append(piece + self.stops.flush())   # nothing held after a stop
        return len(token_ids), stop, "".join(pieces)

    def _push(self, piece: str, seen: int) -> tuple[str, str | None]:
        """The text of ``piece`` (the text of token ``seen``, counted from 1) that may go
        out, and the stop string it completes: none within the first ``min_tokens``."""
        if not self.params.stop:
            return piece, None
        check = self.stops.feed(piece, match=seen > self.params.min_tokens)
        return check.text, check.stop
