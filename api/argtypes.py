"""Argument types the commands share: a number parsed and checked as argparse reads it, so a bad
value is a usage error naming its option (exit 2), never a traceback or a silently odd run."""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable


def checked(kind: Callable[[str], Any], accept: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse type: `kind(text)` if `accept` holds for it. `accept` states what passes
    (`0 < v < math.inf`): NaN fails every comparison, so a check for what fails (`v <= 0`) lets it in."""

    def parse(text: str) -> Any:
        value = kind(text)
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse's "invalid float value: ..."
    return parse


def _bound(kind: Callable[[str], Any], bound: str) -> str:
    return f"a finite number {bound}" if kind is float else bound


def positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    return checked(kind, lambda v: 0 < v < math.inf, _bound(kind, "> 0"))


def non_negative(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    return checked(kind, lambda v: 0 <= v < math.inf, _bound(kind, ">= 0"))
