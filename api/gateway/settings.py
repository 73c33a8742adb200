"""The gateway's own settings: limits and API keys.

They live in dask.config under ``llumdask-gateway`` (kebab-case keys, like every Dask setting),
so a user YAML file or ``DASK_LLUMDASK_GATEWAY__API_KEYS`` sets them; `llumdask serve` options
override them. Validated on construction: a bad value fails at startup naming its key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import dask.config

SECTION = "llumdask-gateway"


@dataclass(frozen=True)
class GatewaySettings:
    # Bearer keys accepted on /v1/*; empty = no authentication.
    api_keys: tuple[str, ...] = ()
    # Requests generating at once on this gateway; one more gets 429.
    max_in_flight: int = 256
    # Seconds a 429 asks the client to wait (retry-after).
    retry_after: float = 1.0
    # Largest request body accepted, in bytes; larger gets 413.
    max_body_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        keys = (self.api_keys,) if isinstance(self.api_keys, str) else tuple(self.api_keys)
        if any(not isinstance(k, str) or not k.strip() for k in keys):
            raise ValueError(f"{SECTION}.api-keys must be non-empty strings")
        object.__setattr__(self, "api_keys", tuple(k.strip() for k in keys))
        for name in ("max_in_flight", "max_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{SECTION}.{_kebab(name)} must be an integer >= 1, got {value!r}")
        retry = self.retry_after
        if not isinstance(retry, (int, float)) or isinstance(retry, bool) or not math.isfinite(retry) or retry <= 0:
            raise ValueError(f"{SECTION}.retry-after must be a number of seconds > 0, got {self.retry_after!r}")

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any]) -> "GatewaySettings":
        """From a kebab-case (or snake_case) mapping; unknown keys are an error naming them."""
        known = {_kebab(f.name): f.name for f in fields(cls)}
        values = {}
        for key, value in section.items():
            name = known.get(_kebab(str(key)))
            if name is None:
                raise ValueError(f"{SECTION}.{key} is not a known key; known: {', '.join(known)}")
            values[name] = value
        return cls(**values)

    @classmethod
    def from_dask(cls, **overrides: Any) -> "GatewaySettings":
        """dask.config's ``llumdask-gateway`` section, with keyword overrides (None = not given) on top."""
        section = dict(dask.config.get(SECTION, default={}) or {})
        section.update({_kebab(k): v for k, v in overrides.items() if v is not None})
        return cls.from_mapping(section)


def _kebab(name: str) -> str:
    return name.replace("_", "-")
