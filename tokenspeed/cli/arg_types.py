"""Argument types that refuse a bad value while the command line is read, before a model
loads, in argparse's one line (``argument --input-len: must be >= 1, got -4``)."""

import argparse
from pathlib import Path


def at_least(minimum: int):
    """An integer no smaller than ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    parse.__name__ = f"integer >= {minimum}"
    return parse


def file_to_write(text: str) -> str:
    """A file path whose folder exists: a run's figures are not lost to a typo at its end."""
    folder = Path(text).expanduser().parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: the folder {folder} does not exist")
    return text
