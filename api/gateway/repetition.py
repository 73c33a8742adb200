"""vLLM's `repetition_detection`: a request ends, finish reason "repetition", at the first output
token where its output ends in a run of `min_count` copies of one n-gram of `min_pattern_size`
to `max_pattern_size` tokens, once `min_tokens` are out (vLLM's rule, checked after each token).

Checked here, on the tokens the gateway receives, rather than in an engine: it reads the output
alone, so a request that migrated or failed over stops where an unmigrated one does, on either
engine, and nothing needs pinning. The last of max_tokens ends the request for that reason, as
vLLM checks it first.

An n-gram of L tokens repeated c times ends at a token exactly when the last (c - 1) L tokens
each equal the token L before them, so a watch keeps, per length, how many tokens in a row do:
O(lengths) per token, in the gateway's event loop. Hence the bound on `max_pattern_size`
(MAX_PATTERN_SIZE; vLLM has none): a hallucinated loop is far shorter.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PATTERN_SIZE = 1024


@dataclass(frozen=True)
class RepetitionDetection:
    max_pattern_size: int
    min_pattern_size: int
    min_count: int

    def watch(self) -> "RepetitionWatch":
        return RepetitionWatch(self)


class RepetitionWatch:
    """One output's tokens, fed one by one, and whether each ends a repetition."""

    def __init__(self, rule: RepetitionDetection) -> None:
        self._low = max(rule.min_pattern_size, 1)
        self._high = rule.max_pattern_size
        self._count = rule.min_count
        self._tokens: list[int] = []
        # _runs[L]: tokens in a row, up to the last, equal to the token L before each.
        self._runs = [0] * (self._high + 1)

    def add(self, token: int) -> bool:
        """Take the output's next token; whether the output now ends in a repetition."""
        tokens, runs, count = self._tokens, self._runs, self._count
        tokens.append(token)
        n = len(tokens)
        found = False
        for length in range(self._low, min(self._high, n - 1) + 1):
            runs[length] = runs[length] + 1 if tokens[-1 - length] == token else 0
            found = found or (length * count <= n and runs[length] >= (count - 1) * length)
        return found
