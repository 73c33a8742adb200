"""Named scheduling setups compared in benchmarks: the paper's baselines, Llumnix, and 2026 peers.

A preset is only a view of the configuration (dispatch policy, migration on/off, priorities
on/off, holding on/off), so every preset runs the same production code paths. The routers place
every request at once, as their published rules do; only Llumnix's setups hold requests at the
scheduler past capacity (`dispatch.hold-freeness`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llumdask.config import LlumdaskConfig
from llumdask.request import Priority


@dataclass(frozen=True)
class Preset:
    name: str
    # A dispatch policy of the configuration; None: the simulator's clairvoyant oracle (`oracle`).
    dispatch: str | None
    migration: bool
    priorities: bool
    description: str
    prefix_aware: bool = True
    holds: bool = False

    @property
    def clairvoyant(self) -> bool:
        return self.dispatch is None

    def apply(self, config: LlumdaskConfig) -> LlumdaskConfig:
        headroom = dict(config.headroom_tokens) if self.priorities else {p: 0 for p in Priority}
        dispatch = config.dispatch if self.dispatch is None else replace(config.dispatch, policy=self.dispatch)
        return replace(
            config,
            headroom_tokens=headroom,
            dispatch=replace(dispatch, prefix_aware=self.prefix_aware,
                             hold_freeness=dispatch.hold_freeness if self.holds else None),
            migration=replace(config.migration, enabled=self.migration),
        )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("round_robin", "round_robin", False, False, "round-robin dispatch, no migration"),
        Preset("infaas", "infaas", False, False, "INFaaS++: least memory load counting queued demand, no migration"),
        Preset("lmetric", "lmetric", False, False, "LMetric: pending prefill tokens x batch size, no migration"),
        Preset("power_of_two", "power_of_two", False, False, "two random choices, freer wins, no migration"),
        Preset("prefix_affinity", "prefix_affinity", False, False, "longest cached prefix, ties by load, no migration"),
        Preset("dynamo_kv", "dynamo_kv", False, False,
               "NVIDIA Dynamo's KV router: least uncached prefill blocks + active blocks, no migration"),
        Preset("sglang_cache_aware", "sglang_cache_aware", False, False,
               "SGLang's cache-aware router: best prefix match over 30% unless load is imbalanced, no migration"),
        Preset("priority_pools", "priority_pools", False, False,
               "instances kept for high-priority requests (dispatch.priority-pool-instances), the freest of its pool, no migration"),
        Preset("llumnix_no_prefix", "llumnix", True, True, "Llumnix with prefix-aware dispatch off", prefix_aware=False,
               holds=True),
        Preset("llumnix_base", "llumnix", True, False, "Llumnix without priorities (no headroom)", holds=True),
        Preset("llumnix_no_migration", "llumnix", False, True,
               "Llumnix's dispatch, headroom and holding without migration: what migration adds", holds=True),
        Preset("llumnix", "llumnix", True, True,
               "Llumnix: freeness dispatch, live migration, priority headroom, holding past capacity", holds=True),
        Preset("oracle", None, False, False,
               "simulator only: knows every output length, places where projected peak usage is lowest; no migration"),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(PRESETS)}") from None
