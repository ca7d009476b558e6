"""Reasoning in ``<think>...</think>``, split from the answer (``reasoning_content``).

Two habits, one parser: ``qwen3`` replies think only when they open with ``<think>``
(Qwen3 writes the tag itself; with ``enable_thinking: false`` its template closes an
empty thought in the prompt and the reply is all answer); ``deepseek_r1`` replies start
inside the thought, since the template opened it in the prompt (a ``<think>`` the model
writes anyway is dropped). The thought ends at ``</think>``, and the answer starts after
the whitespace that follows; a reply cut off before ``</think>`` is all thought.

Where the chat prompt itself ends on a tag, the tag says where the reply starts
(``after``): a prompt ending in ``</think>`` closed the thought (DeepSeek-V3.1's template
with thinking off, as its ``deepseek_r1`` default reads it), so the reply is answer; one
ending in ``<think>`` opened it, so the reply is thought until ``</think>``.

A stream is the differences between scans of the growing reply, as for tool calls: a
tag's first characters wait until the next piece shows whether they are the tag.
"""

import attrs

from tokenspeed.parsers.records import DeltaMessage
from tokenspeed.parsers.growing_text import grown, held_tail

OPEN, CLOSE = "<think>", "</think>"


@attrs.frozen
class ReasoningScan:
    reasoning: str
    content: str


@attrs.frozen
class ThinkParser:
    """``starts_in_reasoning``: a reply is thought until ``</think>`` even without ``<think>``."""

    name: str
    starts_in_reasoning: bool

    def scan(self, text: str, final: bool) -> ReasoningScan:
        if not final and text and OPEN.startswith(text) and text != OPEN:
            return ReasoningScan("", "")
        opened = text.startswith(OPEN)
        if not (opened or self.starts_in_reasoning):
            return ReasoningScan("", text)
        body = text[len(OPEN):] if opened else text
        end = body.find(CLOSE)
        if end >= 0:
            return ReasoningScan(body[:end], body[end + len(CLOSE):].lstrip())
        return ReasoningScan(body if final else body[:len(body) - held_tail(body, CLOSE)], "")

    def after(self, prompt: str | None) -> "ThinkParser":
        """This parser for a reply to ``prompt`` (a chat prompt's text; None: unknown):
        one that starts in the thought where the prompt's last tag opened it, outside it
        where that tag closed it (before: a ``deepseek_r1`` reply to a prompt that closed the
        thought was taken whole for thought, and its answer came back as no content)."""
        tail = (prompt or "").rstrip()
        if tail.endswith(CLOSE) or tail.endswith(OPEN):
            return attrs.evolve(self, starts_in_reasoning=tail.endswith(OPEN))
        return self

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole reply, None for an empty part."""
        scan = self.scan(text, True)
        return scan.reasoning or None, scan.content or None

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self)


class ReasoningStream:
    """``feed`` each new piece of text, ``finish`` at the end: the deltas to send. A tool
    parser's stream takes the content pieces (``DeltaMessage.content``) as its input."""

    def __init__(self, parser: ThinkParser):
        self._parser, self._text = parser, ""
        self._shown = ReasoningScan("", "")

    def feed(self, piece: str) -> list[DeltaMessage]:
        self._text += piece
        return self._diff(self._parser.scan(self._text, False))

    def finish(self) -> list[DeltaMessage]:
        return self._diff(self._parser.scan(self._text, True))

    def _diff(self, scan: ReasoningScan) -> list[DeltaMessage]:
        reasoning = grown("the reasoning", self._shown.reasoning, scan.reasoning)
        content = grown("the content", self._shown.content, scan.content)
        self._shown = scan
        if not (reasoning or content):
            return []
        return [DeltaMessage(content=content or None, reasoning_content=reasoning or None)]
