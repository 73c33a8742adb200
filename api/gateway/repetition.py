"""vLLM's `repetition_detection`: a request ends, finish reason "repetition", at the first output
token where its output ends in a run of `min_count` copies of one n-gram of `min_pattern_size`
to `max_pattern_size` tokens, once `min_tokens` are out (vLLM's rule, checked after each token).

Checked here, on the tokens the gateway receives, rather than in an engine: it reads the output
alone, so a request that migrated or failed over stops where an unmigrated one does, on either
engine, and nothing needs pinning. A token that ends the request anyway (a stop token, the last
of max_tokens) ends it for that reason, as vLLM checks those first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RepetitionDetection:
    max_pattern_size: int
    min_pattern_size: int
    min_count: int

    def first(self, tokens: Sequence[int], start: int, min_tokens: int = 0) -> int | None:
        """The first index i >= start at which tokens[: i + 1] ends in a repetition (and i + 1 >=
        min_tokens); None if there is none."""
        for end in range(max(start, min_tokens - 1, 0) + 1, len(tokens) + 1):
            if self._ends_repeating(tokens, end):
                return end - 1
        return None

    def _ends_repeating(self, tokens: Sequence[int], end: int) -> bool:
        for length in range(max(self.min_pattern_size, 1), self.max_pattern_size + 1):
            if length * self.min_count > end:
                return False
            pattern = tokens[end - length:end]
            if all(tokens[end - length * (k + 1):end - length * k] == pattern for k in range(1, self.min_count)):
                return True
        return False
