"""The control plane's vocabulary: every op between requesters, the scheduler plugin and the
llumlets, how a handler refuses, and the states an instance shows.

Each name is spelled once, here; handlers are installed and called through these members, so a
renamed or misspelled op fails where it is used instead of reaching a peer that does not know it
(an RPC to a missing handler answers None; a stream op without one disconnects the sender).
Every op carries the `llumnix_` prefix, which keeps them apart from Dask's own handlers.

Replies travel as msgpack-native dicts (scheduler comms do not deserialize): a handler answers
`reply(SomeReply(...))`, and `call` gives the caller the same dataclass back (`REPLIES` names each
op's). The tables the notebook and dashboards show (status rows, migration events) stay dicts of
rows. A handler that refuses answers `refusal(exc)`, and `call` raises the same exception class
again on the caller's side, so callers catch exceptions instead of reading reason fields; a call
nothing answers raises `NoLlumdaskScheduler`.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from llumdask.global_scheduler import ClusterOverloaded, NoInstanceAvailable, UnknownInstance


class NoLlumdaskScheduler(RuntimeError):
    """Nothing answers the op there: the llumdask plugins are not installed (yet)."""


class RequestRejected(RuntimeError):
    """An instance refused a request (it can never fit, or it is malformed)."""


class MigrationNotStarted(RuntimeError):
    """An operator migration was refused; the message says why."""


class MigrationPinned(MigrationNotStarted):
    """Refused because the request is pinned: its sampling options cannot move exactly."""


# Every refusal a handler may answer, by the name it travels under.
REFUSALS: dict[str, type[Exception]] = {
    "no-instance": NoInstanceAvailable,
    "overloaded": ClusterOverloaded,
    "unknown-instance": UnknownInstance,
    "rejected": RequestRejected,
    "migration-pinned": MigrationPinned,  # before its base class: the first match names it
    "migration-not-started": MigrationNotStarted,
}


def refusal(exc: Exception) -> dict[str, Any]:
    """The reply that makes `call` raise `exc`'s class with its message on the caller's side (and
    its retry_after, where it has one)."""
    kind = next(name for name, cls in REFUSALS.items() if isinstance(exc, cls))
    reply: dict[str, Any] = {"error": kind, "message": str(exc)}
    if getattr(exc, "retry_after", None) is not None:
        reply["retry_after"] = exc.retry_after
    return reply


class Op(enum.StrEnum):
    # RPCs the scheduler plugin answers (requesters, clients, llumlets, the adaptive deployment).
    REGISTER = "llumnix_register"
    READY = "llumnix_ready"
    UNREGISTER = "llumnix_unregister"
    DISPATCH = "llumnix_dispatch"
    WITHDRAW = "llumnix_withdraw"
    STATUS = "llumnix_status"
    MEMBERS = "llumnix_members"
    MIGRATIONS = "llumnix_migrations"
    DRAIN = "llumnix_drain"
    MIGRATE = "llumnix_migrate"
    ADAPTIVE_TARGET = "llumnix_adaptive_target"
    # Stream ops from llumlets to the scheduler plugin.
    LOAD = "llumnix_load"
    EVENT = "llumnix_event"
    # RPCs a llumlet's worker answers (requesters, the scheduler plugin).
    ADD = "llumnix_add"
    ABORT = "llumnix_abort"
    MIGRATE_OUT = "llumnix_migrate_out"
    WORKER_STATUS = "llumnix_worker_status"
    WHERE = "llumnix_where"
    # One-way migration messages between llumlets (plugins/transport.py).
    MIGRATION = "llumnix_migration"
    # Stream ops from the scheduler plugin to llumlets.
    MIGRATE_TO = "llumnix_migrate_to"
    SET_TERMINATING = "llumnix_set_terminating"
    PEER_LOST = "llumnix_peer_lost"
    # The token channel, instance -> requester (plugins/streams.py): a connection's first frame
    # proves it may write there, the others carry tokens.
    TOKENS_HELLO = "llumnix_tokens_hello"
    TOKENS = "llumnix_tokens"


# The stream ops a llumlet receives from the scheduler plugin.
SCHEDULER_TO_WORKER = (Op.MIGRATE_TO, Op.SET_TERMINATING, Op.PEER_LOST)


@dataclass(frozen=True)
class Registered:
    registered: bool


@dataclass(frozen=True)
class Ready:
    ready: bool


@dataclass(frozen=True)
class Removed:
    removed: bool


@dataclass(frozen=True)
class Placed:
    """The instance a request goes to; None while the scheduler holds it for room
    (`dispatch.hold-freeness`): the requester asks again with the same id and keeps its place.
    `no_instance`: held while no instance at all may take a request (the requester bounds that
    wait as it bounds any placement's)."""

    instance: str | None
    no_instance: bool = False


@dataclass(frozen=True)
class Withdrawn:
    """Whether a held request, or a placement its requester never got (made since it last asked,
    or answered lately), was forgotten (False: nothing of it was waiting here, it was answered
    long ago, or its placement's instance is gone)."""

    withdrawn: bool


@dataclass(frozen=True)
class Members:
    """Every instance and the placeable ones, or None for both when the caller's epoch is current;
    and the instances' KV block size, which a requester cuts prompts by for their block hashes."""

    epoch: str
    alive: tuple[str, ...] | None
    placeable: tuple[str, ...] | None
    block_size: int | None = None


@dataclass(frozen=True)
class Draining:
    draining: bool


@dataclass(frozen=True)
class MigrationStarted:
    migration_id: str


@dataclass(frozen=True)
class AdaptiveTarget:
    """Workers to keep, and the names of those that may close (drained)."""

    target: int
    drained: tuple[str, ...]


@dataclass(frozen=True)
class Accepted:
    accepted: bool


@dataclass(frozen=True)
class Aborted:
    aborted: bool


@dataclass(frozen=True)
class Whereabouts:
    """Of the requests asked about: those here (queued, running, or arriving by migration), those
    that moved on by migration (request id -> destination), and those this instance does not have
    (finished, or ended here unseen: dropped when their requester was unreachable)."""

    here: tuple[str, ...]
    moved: dict[str, str]
    gone: tuple[str, ...]


# Each op's reply type; ops not named answer a table (status rows, migration events).
REPLIES: dict[Op, type] = {
    Op.REGISTER: Registered, Op.READY: Ready, Op.UNREGISTER: Removed, Op.DISPATCH: Placed, Op.WITHDRAW: Withdrawn,
    Op.MEMBERS: Members,
    Op.DRAIN: Draining, Op.MIGRATE: MigrationStarted, Op.MIGRATE_OUT: MigrationStarted,
    Op.ADAPTIVE_TARGET: AdaptiveTarget, Op.ADD: Accepted, Op.ABORT: Aborted, Op.WHERE: Whereabouts,
}


def reply(value: Any) -> dict[str, Any]:
    """A reply dataclass as it travels."""
    return dataclasses.asdict(value)


async def call(target: Any, op: Op, **kwargs: Any) -> Any:
    """`op` on a Dask rpc (`worker.scheduler`, `client.scheduler`, `rpc(address)`): its reply
    (the op's `REPLIES` dataclass, else the table as sent), or the handler's refusal raised again."""
    answer = await getattr(target, op.value)(**kwargs)
    if answer is None:
        raise NoLlumdaskScheduler(f"nothing answers {op.value}: the llumdask plugins are not installed there "
                                  "(start the cluster with llumdask.clusters, or register LlumnixSchedulerPlugin "
                                  "and LlumletWorkerPlugin)")
    if isinstance(answer, dict) and "error" in answer:
        fields = {"retry_after": answer["retry_after"]} if "retry_after" in answer else {}
        raise REFUSALS[answer["error"]](answer["message"], **fields)
    kind = REPLIES.get(op)
    if kind is None:
        return answer
    return kind(**{k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in answer.items()})


class InstanceState(enum.StrEnum):
    """An instance's role as the scheduler plugin shows it (status rows, the dashboard)."""

    STARTING = "starting"  # registered, its llumlet not ready yet: never dispatched to
    NORMAL = "normal"
    SOURCE = "source"  # paired as a migration source in the latest round
    DESTINATION = "destination"  # paired as a migration destination in the latest round
    TERMINATING = "terminating"  # draining by migration before it leaves
