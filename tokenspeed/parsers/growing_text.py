"""Two rules every streamed parse keeps: text that may be the start of a tag waits, and
what was shown is never taken back."""

from tokenspeed.errors import InternalError


def held_tail(text: str, marker: str) -> int:
    """How many of text's last characters may be the start of ``marker`` (and so wait)."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:n])), 0)


def grown(what: str, before: str, now: str) -> str:
    """What ``now`` adds to ``before``, which it must extend (a parser fault otherwise)."""
    if not now.startswith(before):
        raise InternalError(f"a parser took back {what}: {before!r} became {now!r}")
    return now[len(before):]
