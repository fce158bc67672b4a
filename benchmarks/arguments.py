"""argparse types for the benchmarks' numbers: a value out of range is argparse's one ``error:`` line, exit status 2,
before any work (before: a count of 0 or a word ran into a traceback, or a hang, or a run that failed later)."""

from __future__ import annotations

import argparse
from typing import Callable, Sequence


def number(least: float, kind: type = int) -> Callable[[str], float]:
    """A type for ``kind`` values of at least ``least`` (NaN is none)."""
    what = "a whole number" if kind is int else "a number"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text} is not {what}") from None
        if not value >= least:
            raise argparse.ArgumentTypeError(f"{text} must be {what} >= {least:g}")
        return value

    return parse


def numbers(least: float, kind: type = int) -> Callable[[str], str]:
    """A type for a comma-separated list of such values (``16,64,256``), kept as given: the reports quote it."""
    one = number(least, kind)

    def parse(text: str) -> str:
        values = [one(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError("give at least one value")
        return text

    return parse


def names(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """A type for a comma-separated list of some of ``allowed`` (``by-hand,torchrun``), as a list."""

    def parse(text: str) -> list[str]:
        chosen = [name.strip() for name in text.split(",") if name.strip()]
        if not chosen or any(name not in allowed for name in chosen):
            raise argparse.ArgumentTypeError(f"{text!r}: name {', '.join(allowed)} or several, comma-separated")
        return chosen

    return parse
