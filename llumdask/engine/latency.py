"""Latency model of one model instance, with coefficients from a profile file.

A step's modelled time is the sum of its parts:

    prefill(lengths) = a + b * sum(lengths) + c * sum(length^2)          (0 when nothing prefills)
    decode(batch, context_tokens) = d + e * batch + f * context_tokens    (0 when nothing decodes)

`a`/`d` are the fixed cost of a forward pass, `b`/`e` the weight FLOPs per token, `c` the
quadratic attention of a prompt, `f` reading the KV cache of every context token. A chunk of a
chunked prefill, `new` tokens after `computed` ones already in the cache, costs b * new +
c * ((computed + new)^2 - computed^2): its tokens attend to the whole prefix, so the chunks of
one prompt add up to the prompt prefilled at once. A step that
prefills and decodes runs them in one forward pass, so it pays the fixed cost once: the larger
of `a` and `d` (measured on vLLM: a mixed step of the CPU engine matches prefill + decode -
min(a, d) within a few percent, and overshoots by min(a, d) without it). Profiles are
JSON files: the built-in ones in `profiles/` derive their coefficients from published hardware
figures (the "derivation" text says which, and what is assumed); a user adds one fitted to their
own measurements by passing its path.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

PROFILE_DIR = Path(__file__).with_name("profiles")

_PREFILL_KEYS = ("base_s", "per_token_s", "per_token_squared_s")
_DECODE_KEYS = ("base_s", "per_seq_s", "per_context_token_s")
_TOP_KEYS = ("name", "capacity_tokens", "block_size", "model_kv_bytes_per_token", "prefill", "decode", "derivation")
# Optional: the high-priority headroom derived from this profile (`llumdask.engine.headroom`).
_OPTIONAL_KEYS = ("headroom",)


@dataclass(frozen=True)
class PrefillCost:
    base_s: float
    per_token_s: float
    per_token_squared_s: float


@dataclass(frozen=True)
class DecodeCost:
    base_s: float
    per_seq_s: float
    per_context_token_s: float


@dataclass(frozen=True)
class LatencyProfile:
    """One model on one kind of instance: KV capacity, KV size, and step-time coefficients."""

    name: str
    # KV cache capacity of one instance, in tokens (the engine's block count is this // block size).
    capacity_tokens: int
    # The block size the capacity was stated for.
    block_size: int
    # Bytes of KV cache per token of the real model (what a migration of the real model moves).
    model_kv_bytes_per_token: int
    prefill: PrefillCost
    decode: DecodeCost
    derivation: str
    # `Headroom.to_dict()` as `llumdask profile headroom --write` stored it, or None.
    headroom: Mapping[str, Any] | None = None

    @property
    def headroom_tokens(self) -> int | None:
        """The high-priority headroom this profile carries, in tokens (None: none derived)."""
        return None if self.headroom is None else int(self.headroom["tokens"])

    def prefill_time(self, lengths: Iterable[int]) -> float:
        """Seconds to prefill these prompts together in one step."""
        return self.chunk_time((0, n) for n in lengths)

    def chunk_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        """Seconds to prefill these (computed, new) chunks together in one step."""
        total = squares = 0
        for computed, new in chunks:
            total += new
            end = computed + new
            squares += end * end - computed * computed
        if total == 0:
            return 0.0
        p = self.prefill
        return p.base_s + p.per_token_s * total + p.per_token_squared_s * squares

    def decode_time(self, batch: int, context_tokens: int) -> float:
        """Seconds for one decode token of each of `batch` sequences holding `context_tokens` in all."""
        if batch == 0:
            return 0.0
        d = self.decode
        return d.base_s + d.per_seq_s * batch + d.per_context_token_s * context_tokens

    def solo_latency(self, prompt_tokens: int, output_tokens: int) -> float:
        """Seconds from arrival to the last token of a request alone on an idle instance: its prefill
        (which yields the first token), then one lone decode step per further token, the k-th of
        them over prompt + k tokens. No placement can serve it faster."""
        decodes = max(output_tokens - 1, 0)
        d = self.decode
        context = decodes * (2 * prompt_tokens + decodes + 1) / 2  # prompt + 1 ... prompt + decodes
        return self.prefill_time([prompt_tokens]) + decodes * (d.base_s + d.per_seq_s) + d.per_context_token_s * context

    def step_time(self, prefill_chunks: Iterable[tuple[int, int]], batch: int, context_tokens: int) -> float:
        """A step of prefill chunks (computed, new) plus one decode token per decoding sequence: one
        forward pass, so a step with both pays the smaller fixed cost only as part of the larger."""
        prefill, decode = self.chunk_time(prefill_chunks), self.decode_time(batch, context_tokens)
        if prefill and decode:
            return prefill + decode - min(self.prefill.base_s, self.decode.base_s)
        return prefill + decode

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "profile") -> "LatencyProfile":
        """Validate and build; every error names the source and the offending key."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{source}: a latency profile must be a JSON object")
        missing = [k for k in _TOP_KEYS if k not in data]
        unknown = sorted(set(data) - set(_TOP_KEYS) - set(_OPTIONAL_KEYS))
        if missing or unknown:
            raise ValueError(f"{source}: missing keys {missing}, unknown keys {unknown}; expected {list(_TOP_KEYS)}")
        name = data["name"]
        if not isinstance(name, str) or not name:
            raise ValueError(f"{source}: 'name' must be a non-empty string")
        block_size = _positive_int(data, "block_size", source)
        capacity = _positive_int(data, "capacity_tokens", source)
        if capacity < block_size:
            raise ValueError(f"{source}: 'capacity_tokens' ({capacity}) is smaller than one block ({block_size})")
        derivation = data["derivation"]
        if isinstance(derivation, list) and all(isinstance(line, str) for line in derivation):
            derivation = "\n".join(derivation)
        if not isinstance(derivation, str) or not derivation.strip():
            raise ValueError(f"{source}: 'derivation' must say where the numbers come from (a string or list of lines)")
        return cls(
            name=name,
            capacity_tokens=capacity,
            block_size=block_size,
            model_kv_bytes_per_token=_positive_int(data, "model_kv_bytes_per_token", source),
            prefill=PrefillCost(**_coefficients(data, "prefill", _PREFILL_KEYS, source)),
            decode=DecodeCost(**_coefficients(data, "decode", _DECODE_KEYS, source)),
            derivation=derivation,
            headroom=_headroom(data.get("headroom"), capacity, source),
        )


def available_profiles() -> list[str]:
    """Names of the built-in profiles."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str | os.PathLike[str]) -> LatencyProfile:
    """A built-in profile by name (e.g. "llama-7b-a10"), or a JSON file by path."""
    text = os.fspath(name_or_path)
    path = Path(text)
    if not (path.suffix == ".json" or os.sep in text or "/" in text):
        path = PROFILE_DIR / f"{text}.json"
        if not path.is_file():
            raise ValueError(
                f"unknown latency profile {text!r}; built-in profiles: {', '.join(available_profiles())} "
                "(or pass the path of a JSON profile file)"
            )
    if not path.is_file():
        raise ValueError(f"latency profile file {str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"latency profile {str(path)!r} is not valid JSON: {exc}") from None
    return LatencyProfile.from_dict(data, source=f"latency profile {str(path)!r}")


def _positive_int(data: Mapping[str, Any], key: str, source: str) -> int:
    value = data[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{source}: {key!r} must be a positive integer, got {value!r}")
    return value


def _coefficients(data: Mapping[str, Any], section: str, keys: tuple[str, ...], source: str) -> dict[str, float]:
    values = data[section]
    if not isinstance(values, Mapping) or set(values) != set(keys):
        raise ValueError(f"{source}: {section!r} must be an object with exactly the keys {list(keys)}")
    for key in keys:
        v = values[key]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{source}: '{section}.{key}' must be a finite number >= 0 seconds, got {v!r}")
    return {key: float(values[key]) for key in keys}


def _headroom(value: Any, capacity: int, source: str) -> Mapping[str, Any] | None:
    if value is None:
        return None
    tokens = value.get("tokens") if isinstance(value, Mapping) else None
    if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 <= tokens <= capacity:
        raise ValueError(f"{source}: 'headroom.tokens' must be an integer in [0, {capacity}], got {tokens!r}")
    return dict(value)
