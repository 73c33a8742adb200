"""Migration pairing (paper section 4.4.3): move load from the least free to the freest instances.

Each round the sources are the instances below the low freeness threshold (terminating ones,
F = -inf, first), the destinations those above the high threshold; the least free source is
paired with the freest destination, and so on. The thresholds are apart (low < high), so an
instance is never both, and each appears at most once per round. A destination also needs room
for its own queue (a dispatch freeness of at least `dispatch.hold-freeness`, where set): read off
the reports, this approximates the rule its llumlet refuses a normal-priority migrant by (which counts the
migrant's blocks, and neither headroom nor dispatches still on their way), so that pairing does
not offer a destination likely to refuse the next source again round after round while one with
room waits; the llumlet's check stays the one that decides. Which request moves is the source
llumlet's choice, not the scheduler's. What the two instances cache plays no part: a
migration leaves the migrant's blocks cached on both, so an affinity by common cache would send
a source's next migrants after its last one rather than to the freest (measured in
benchmarks/README.md, "Migration pairing by shared prefix, withdrawn").
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Iterable, Protocol

from llumdask.config import MigrationConfig
from llumdask.load import InstanceLoad


@dataclass(frozen=True)
class MigrationPair:
    """Ask `source`'s llumlet to migrate one request to `destination`."""

    source: str
    destination: str
    # The source hands over the head of its waiting queue first (`_pair` says when).
    take_waiting: bool = False


class PairingView(Protocol):
    """What pairing reads about one ready instance."""

    instance_id: str
    load: InstanceLoad
    terminating: bool
    freeness: float
    dispatch_freeness: float
    key: tuple[float, str]


def pair_migrations(
    instances: Iterable[PairingView], config: MigrationConfig, queue_room: float | None = None
) -> list[MigrationPair]:
    """This round's pairs; none when migration is disabled.

    A source needs a request it can give away (a waiting one, or a running one that is not
    pinned) and fewer than `max_concurrent` migrations out; a destination fewer than
    `max_concurrent` in, both as of its last report, and a dispatch freeness of at least
    `queue_room` where that is set.
    """
    if not config.enabled:
        return []
    limit = config.max_concurrent
    sources: list[PairingView] = []
    destinations: list[PairingView] = []
    for view in instances:
        load = view.load
        if view.terminating or view.freeness < config.low_threshold:
            if (load.num_running > load.num_pinned or load.num_waiting) and load.num_migrating_out < limit:
                sources.append(view)
        elif (view.freeness > config.high_threshold and load.num_migrating_in < limit
              and (queue_room is None or view.dispatch_freeness >= queue_room)):
            destinations.append(view)
    by_key = attrgetter("key")
    sources.sort(key=by_key)
    destinations.sort(key=by_key, reverse=True)
    return [_pair(s, d, config) for s, d in zip(sources, destinations)]


def _pair(source: PairingView, destination: PairingView, config: MigrationConfig) -> MigrationPair:
    """Where the destination queues nothing (a request handed over starts there at once, and no
    earlier request there makes it refuse), a terminating source hands over its queue first
    (nothing of it should start where it is), and with `hand_over_waiting` any source does."""
    take = bool(source.load.num_waiting) and not destination.load.num_waiting
    return MigrationPair(source.instance_id, destination.instance_id,
                         take_waiting=take and (source.terminating or config.hand_over_waiting))
