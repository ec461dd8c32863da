"""Command-line pieces the benchmark scripts in experiments/ share: a parser whose errors are one
line, and the type of a comma-separated list of positive integers (grid axes)."""

from __future__ import annotations

import argparse
import sys


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr, exit code 2 (no usage block)."""

    def error(self, message: str):  # noqa: D102
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def int_list(text: str) -> list[int]:
    """'1,8,64' -> [1, 8, 64]; anything but positive integers is an argparse error naming the text."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be > 0")
    return values
