"""Copies of the tiny model with a different tokenizer, for tests that need tokens it lacks."""

from __future__ import annotations

import shutil
from pathlib import Path

THINKING = ("<think>", "</think>")


def with_thinking_tokens(model: Path, target: Path) -> Path:
    """`model` copied to `target` with <think> and </think> added to its tokenizer (ids 512 and 513
    on the tiny model: past its weights, so only for tests that never run them on an engine)."""
    from tokenizers import AddedToken, Tokenizer

    shutil.copytree(model, target)
    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINKING])
    tokenizer.save(str(target / "tokenizer.json"))
    return target
