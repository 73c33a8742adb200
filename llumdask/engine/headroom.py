"""High-priority headroom from a latency profile, the paper's way (section 4.4.1).

The headroom is what keeps an instance that holds high-priority work at near-ideal decode speed:
the paper profiles decode latency against the batched tokens and keeps the load of such an
instance below the point where a step grows past near-ideal. Here the decode curve is the
profile's: a batch of `sequence_tokens`-long sequences holding x tokens in all decodes in

    step(x) = decode.base_s + decode.per_seq_s * x / sequence_tokens + decode.per_context_token_s * x

A lone sequence's step is step(sequence_tokens). The near-ideal load x* is the largest x whose
step is within `tolerance` of the lone sequence's, and the headroom is capacity - x*: the virtual
usage that, added to an instance holding high-priority requests, leaves x* of real load on it
once dispatch and migration have balanced the cluster. (The load itself is not the headroom: a
headroom of x* would let the instance fill to capacity - x*.)

`ceiling` is the most the profile allows a high-priority request to gain: a full instance's step
over a lone sequence's. Decode latency cannot improve by more, whatever the policy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping

from llumdask.engine.latency import LatencyProfile

DEFAULT_TOLERANCE = 0.1
DEFAULT_SEQUENCE_TOKENS = 512


@dataclass(frozen=True)
class Headroom:
    """A derived headroom and what it was derived from."""

    tokens: int
    near_ideal_tokens: int
    tolerance: float
    sequence_tokens: int
    ceiling: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "headroom") -> "Headroom":
        try:
            return cls(int(data["tokens"]), int(data["near_ideal_tokens"]), float(data["tolerance"]),
                       int(data["sequence_tokens"]), float(data["ceiling"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: expected tokens, near_ideal_tokens, tolerance, sequence_tokens, ceiling ({exc!r})") from None


def with_headroom(profile: LatencyProfile) -> LatencyProfile:
    """The profile carrying the headroom it derives with the default tolerance and sequence length."""
    return replace(profile, headroom=derive_headroom(profile).to_dict())


def decode_step(profile: LatencyProfile, batched_tokens: float, sequence_tokens: int) -> float:
    """Seconds per decode step with `batched_tokens` in the batch, as sequences of `sequence_tokens`."""
    d = profile.decode
    return d.base_s + d.per_seq_s * batched_tokens / sequence_tokens + d.per_context_token_s * batched_tokens


def derive_headroom(
    profile: LatencyProfile, *, tolerance: float = DEFAULT_TOLERANCE, sequence_tokens: int = DEFAULT_SEQUENCE_TOKENS
) -> Headroom:
    """The headroom that keeps a high-priority instance within `tolerance` of a lone sequence's step."""
    if not 0 < tolerance:
        raise ValueError(f"tolerance must be > 0 (a fraction of the lone sequence's step), got {tolerance!r}")
    capacity = profile.capacity_tokens
    if not 1 <= sequence_tokens <= capacity:
        raise ValueError(f"sequence_tokens must be in [1, {capacity}] (the profile's capacity), got {sequence_tokens!r}")
    d = profile.decode
    lone = decode_step(profile, sequence_tokens, sequence_tokens)
    slope = d.per_seq_s / sequence_tokens + d.per_context_token_s
    if slope == 0:
        near_ideal = capacity
    else:
        near_ideal = int(min(capacity, max(sequence_tokens, ((1 + tolerance) * lone - d.base_s) / slope)))
    return Headroom(
        tokens=capacity - near_ideal,
        near_ideal_tokens=near_ideal,
        tolerance=tolerance,
        sequence_tokens=sequence_tokens,
        ceiling=decode_step(profile, capacity, sequence_tokens) / lone,
    )
