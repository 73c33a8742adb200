"""How llumlets reach each other. The core only sends; delivery is the transport's business.

`InProcessTransport` delivers in FIFO order per (sender, receiver) pair, and lets tests drop
peers and reorder delivery between pairs. The Dask transport (plugins/) implements the same
`send` over one dedicated comm per migration.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Protocol

from llumdask.protocol import MigrationMessage


class Transport(Protocol):
    def send(self, sender: str, receiver: str, message: MigrationMessage) -> None:
        """Queue `message` for `receiver`; never blocks, never raises for a dead peer."""


Handler = Callable[[str, MigrationMessage], None]


class InProcessTransport:
    """Per-pair FIFO queues between in-process llumlets; delivery is explicit and observable."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}
        self._queues: dict[tuple[str, str], deque[MigrationMessage]] = {}
        self.dead: set[str] = set()
        self.sent: int = 0

    def register(self, instance_id: str, handler: Handler) -> None:
        self._handlers[instance_id] = handler

    def unregister(self, instance_id: str) -> None:
        self._handlers.pop(instance_id, None)

    def send(self, sender: str, receiver: str, message: MigrationMessage) -> None:
        self.sent += 1
        self._queues.setdefault((sender, receiver), deque()).append(message)

    def pending_pairs(self) -> list[tuple[str, str]]:
        return [pair for pair, q in self._queues.items() if q]

    def deliver_one(self, pair: tuple[str, str]) -> bool:
        """Deliver the oldest message of one sender->receiver pair; messages to or from dead peers vanish."""
        queue = self._queues.get(pair)
        if not queue:
            return False
        message = queue.popleft()
        sender, receiver = pair
        handler = self._handlers.get(receiver)
        if handler is not None and sender not in self.dead and receiver not in self.dead:
            handler(sender, message)
        return True

    def deliver_round(self) -> int:
        """Deliver what is queued now, one message per pair; replies they trigger wait for the next round."""
        return sum(self.deliver_one(pair) for pair in self.pending_pairs())

    def deliver_all(self, limit: int = 100_000) -> int:
        """Deliver until quiet (handlers may send more); returns how many were delivered."""
        delivered = 0
        while delivered < limit:
            if not self.pending_pairs():
                return delivered
            delivered += self.deliver_round()
        raise RuntimeError(f"transport did not go quiet after {limit} messages")
