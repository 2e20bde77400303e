"""argparse types for the command lines (benchmarks, zoo build): a bad count is refused by the parser, with its
name, instead of slicing from the end or failing deep inside a stage."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """A count of at least 1: 0 or fewer ran nothing and then failed on an empty median."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    """A count where 0 means 'all' or 'none': a negative one sliced that many from the end."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value
