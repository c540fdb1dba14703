"""argparse value types the command-line tools share (`topkd`, `topkd demo`)."""

from __future__ import annotations

import argparse
import math


def int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def float_in(name: str, low: float, high: float | None, low_open: bool = True):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        above = value > low if low_open else value >= low
        if not math.isfinite(value) or not above or (high is not None and value > high):
            bound = (f"{'(' if low_open else '['}{low}, {high}]" if high is not None
                     else f"{'>' if low_open else '>='} {low}")
            raise argparse.ArgumentTypeError(f"{name} must be in {bound}, got {text}")
        return value

    parse.__name__ = "float"
    return parse
