"""Argument types shared by the commands.

Primitives:
- ``int_at_least(low)``: an argparse type accepting integers no smaller than ``low``; anything
  else is a usage error that names the rule.
- ``float_above(low, high=None)``: a finite number greater than ``low`` (and at most ``high``); ``open_fraction``: a number
  strictly between 0 and 1 (a rate, a confidence).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than ``low``, else a usage error that says so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def float_above(low: float, high: float | None = None) -> Callable[[str], float]:
    """An argparse type: a finite number greater than ``low`` and, with ``high``, at most
    ``high``; else a usage error that says so."""

    def parse(text: str) -> float:
        value = _number(text)
        if value <= low:
            raise argparse.ArgumentTypeError(f"must be greater than {low:g}, got {text}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high:g}, got {text}")
        return value

    parse.__name__ = f"number > {low:g}" + (f" and <= {high:g}" if high is not None else "")
    return parse


def open_fraction(text: str) -> float:
    """An argparse type: a number strictly between 0 and 1."""
    value = _number(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (exclusive), got {text}")
    return value
