"""Argument checks the commands share: a number parsed and checked as argparse reads it, and an
output directory checked before any work, so a bad value is a usage error naming its option
(exit 2), never a traceback, a silently odd run or results lost after it."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
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


def check_out_dir(parser: argparse.ArgumentParser, out: Path) -> None:
    """Check --out before any work, so a path that cannot take the results fails now, not after the
    run. Nothing is created: the results' writer makes the directory, so a run refused for another
    option leaves none behind."""
    target = out.absolute()
    try:
        nearest = next(path for path in (target, *target.parents) if path.exists() or path.is_symlink())
    except OSError as exc:  # a directory on the way that cannot be read
        parser.error(f"--out {out}: {exc.strerror or exc}")
    if nearest.is_symlink() and not nearest.exists():
        parser.error(f"--out {out}: {nearest} is a symbolic link that leads nowhere")
    if not nearest.is_dir():
        parser.error(f"--out {out} exists and is not a directory" if nearest == target
                     else f"--out {out}: {nearest} is not a directory")
    if not os.access(nearest, os.W_OK | os.X_OK):
        parser.error(f"--out {out} is not writable" if nearest == target else f"--out {out}: {nearest} is not writable")
