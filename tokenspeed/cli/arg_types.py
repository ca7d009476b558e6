"""Argument types that refuse a bad value while the command line is read, before a model
loads, in argparse's one line (``argument --input-len: must be >= 1, got -4``)."""

import argparse
import os
from pathlib import Path


def at_least(minimum: int, maximum: int | None = None):
    """An integer no smaller than ``minimum`` (and, where given, no larger than ``maximum``)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value
    parse.__name__ = f"integer >= {minimum}" if maximum is None else f"integer in [{minimum}, {maximum}]"
    return parse


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def non_blank(text: str) -> str:
    """Text with something in it: ``--api-key "$KEY"`` with KEY unset must not start an open
    server, nor an empty model name a server no client can name."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must not be blank, got {text!r}")
    return text


def file_to_write(text: str) -> str:
    """A file path in a folder this process may write: a run's figures are not lost to a
    typo at its end."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder: name a file in it")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: the folder {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: the folder {path.parent} is not writable")
    return text
