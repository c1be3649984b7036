"""Argument types shared by the commands.

Primitives:
- ``int_at_least(low)``: an argparse type accepting integers no smaller than ``low``; anything
  else is a usage error that names the rule.
"""

from __future__ import annotations

import argparse
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
