"""Messages of the live-migration handshake (paper section 4.2, Figure 7).

Source -> destination: PreAlloc (before each stage), StageData (a fused block buffer; the last
one also carries the request state), Abort. Destination -> source: PreAllocReply (ACK or
refusal), StageAck, Committed, Abort. Every message names its migration, so one comm per
migration keeps stages ordered and a late message of a dead migration is simply dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from llumdask.engine.base import MigrationState
from llumdask.request import Priority


@dataclass(frozen=True)
class PreAlloc:
    migration_id: str
    source: str
    destination: str
    request_id: str
    stage: int
    num_blocks: int
    # First PreAlloc only: the migrant's tokens of whole computed blocks, so that the
    # destination reuses the blocks of them it caches (`Engine.reserve_cached`) instead of copies.
    prefix_tokens: tuple[int, ...] = ()
    # And the migrant's cache salt: only blocks cached under the same salt are reused.
    cache_salt: str | None = None
    # A waiting migrant (its one PreAlloc reserves room for its whole computation): its place in
    # a queue (`Request.queue_key`); the destination takes it only ahead of its own queue.
    queue_key: tuple[int, float, str] | None = None
    # The migrant's execution priority: a high-priority one is let in where its blocks are free,
    # as dispatch places a high-priority request without holding it for room.
    execution_priority: Priority = Priority.NORMAL


@dataclass(frozen=True)
class PreAllocReply:
    migration_id: str
    stage: int
    accepted: bool
    reason: str = ""
    # The migrant's leading blocks the destination holds already: the source skips them.
    reused_blocks: int = 0


@dataclass(frozen=True)
class StageData:
    migration_id: str
    stage: int
    start_block: int
    end_block: int
    payload: Any
    # Only on the last stage: the paused request's continuation.
    state: MigrationState | None = None

    @property
    def last(self) -> bool:
        return self.state is not None


@dataclass(frozen=True)
class StageAck:
    migration_id: str
    stage: int


@dataclass(frozen=True)
class Committed:
    migration_id: str
    request_id: str
    # Seconds the destination took over the request: the last stage imported and the request
    # resumed, on the destination's own clock (the source's part of the downtime is its own).
    taken_over: float = 0.0


@dataclass(frozen=True)
class Abort:
    migration_id: str
    reason: str


MigrationMessage = Union[PreAlloc, PreAllocReply, StageData, StageAck, Committed, Abort]
