"""What a worker's engine thread does for its llumlet, with no I/O of its own.

The host (`plugins/worker.py`) owns the thread, the comms and the handlers; this driver owns
what happens between engine steps: stepping, when held tokens go (the output cadence), which
requester each request's tokens go to (the route table, handed over with a migration), and when
a load report is due. Whatever leaves the process goes through the senders it is given, so a
test drives it step by step with plain callables and a fake llumlet.

Routes: a request's route (its requester's listener address) arrives with the request, travels
to a migration's destination in the context of each `PreAlloc`, and becomes the destination's
when it answers `Committed`; the source forgets it at COMMIT.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Callable, Sequence

from llumdask.engine.base import TokenOutput
from llumdask.llumlet import Llumlet, MigrationEvent, MigrationEventKind
from llumdask.plugins.control import Whereabouts
from llumdask.plugins.streams import TokenOutbox
from llumdask.protocol import Abort, Committed, MigrationMessage, PreAlloc, PreAllocReply
from llumdask.request import FinishReason, Request

logger = logging.getLogger(__name__)

# Requests that left by migration whose destination an instance remembers: a requester asks about
# a stalled stream within seconds, and an instance sends hundreds of requests away in that time.
MOVED_MEMORY = 4096
# Hand-overs aborted here that an instance remembers, in case their add comes after the abort: the
# two travel on different connections, and a requester aborts a hand-over within its RPC timeout.
ABORTED_HAND_OVERS = 4096
# A load report that says nothing new (an idle instance, or one whose queues stand still) goes out
# this often, not every report interval: a report that differs goes out at its interval. Idle
# instances so cost the scheduler one report a second each, not twenty.
REPORT_KEEPALIVE = 1.0


class Routes:
    """Request id -> requester address, for requests this instance owns or is receiving.

    Incoming migrations keep their route aside until the destination commits, and are swept if
    their migration silently expires.
    """

    def __init__(self, expiry: float) -> None:
        self.owned: dict[str, str] = {}
        self._incoming: dict[str, tuple[str, str, float]] = {}
        self._expiry = expiry

    def add_incoming(self, migration_id: str, request_id: str, reply_to: str, now: float) -> None:
        self._incoming[migration_id] = (request_id, reply_to, now)

    def receiving(self, request_id: str) -> bool:
        return any(entry[0] == request_id for entry in self._incoming.values())

    def commit_incoming(self, migration_id: str) -> str | None:
        """The incoming request is this instance's now: its route (None if unknown or expired)."""
        entry = self._incoming.pop(migration_id, None)
        if entry is None:
            return None
        self.owned[entry[0]] = entry[1]
        return entry[1]

    def drop_incoming(self, migration_id: str) -> None:
        self._incoming.pop(migration_id, None)

    def sweep(self, now: float, is_known: Callable[[str], bool]) -> None:
        for migration_id, (_, _, since) in list(self._incoming.items()):
            if now - since > self._expiry:
                del self._incoming[migration_id]
        for request_id in [r for r in self.owned if not is_known(r)]:
            del self.owned[request_id]

    def __len__(self) -> int:
        return len(self.owned) + len(self._incoming)


class LlumletDriver:
    """One llumlet's engine-thread work; every method runs on that one thread.

    Senders: `push_tokens` takes the tokens due (requester address, output) pairs; `send_load` a
    load report (once `reporting` is on); `publish_event` each migration event. `calls_waiting`
    says whether calls are queued for the thread (held tokens go before they run). `clock` is the
    wall clock of route ages, `timer` the monotonic one of the report cadence.
    """

    def __init__(
        self,
        *,
        stream_interval: float,
        report_interval: float,
        route_expiry: float,
        push_tokens: Callable[[list[tuple[str, TokenOutput]]], None],
        send_load: Callable[[dict], None],
        publish_event: Callable[[MigrationEvent], None],
        calls_waiting: Callable[[], bool],
        max_failed_steps: int = 3,
        on_broken: Callable[[int], None] = lambda failures: None,
        clock: Callable[[], float] = time.time,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        self.routes = Routes(route_expiry)
        # Where requests that left by migration went (the latest MOVED_MEMORY), for `whereabouts`.
        self._moved: OrderedDict[str, str] = OrderedDict()
        self._aborted_hand_overs: OrderedDict[str, None] = OrderedDict()
        self.llumlet: Llumlet | None = None
        # Off until the instance is registered: handshakes still expire, but no report is sent.
        self.reporting = False
        self._outbox = TokenOutbox(stream_interval)
        self._report_interval = report_interval
        self._next_report = float("-inf")
        # The last report sent, and when an unchanged one is due all the same.
        self._last_sent: dict | None = None
        self._keepalive_due = float("-inf")
        self._push_tokens = push_tokens
        self._send_load = send_load
        self._publish_event = publish_event
        self._calls_waiting = calls_waiting
        # Steps failed in a row; at `max_failed_steps` the engine counts as broken (`on_broken`).
        self._failed_steps = 0
        self._max_failed_steps = max_failed_steps
        self._on_broken = on_broken
        self._clock = clock
        self._timer = timer

    def attach(self, llumlet: Llumlet) -> None:
        self.llumlet = llumlet

    def _llumlet(self) -> Llumlet:
        if self.llumlet is None:
            raise RuntimeError("no llumlet is attached yet")
        return self.llumlet

    # ------------------------------------------------------------------ stepping
    def step_once(self) -> bool:
        """One step; True while stepping again at once makes progress.

        A step that scheduled nothing (work waits for blocks a migration or a finishing request
        will free) is not progress: the thread then sleeps until a call wakes it, or for at most
        a report interval (the thread's idle wait), so that reports go on while idle.
        """
        llumlet = self.llumlet
        if llumlet is None:
            return False
        progress = False
        if llumlet.engine.has_work():
            try:
                result = llumlet.step()
            except BaseException:
                self._failed_steps += 1
                self._end_requests_after_a_failed_step()
                self._hand_off(force=True)  # what the failed step produced still goes, and the ends
                if self._failed_steps >= self._max_failed_steps:
                    self._on_broken(self._failed_steps)
                raise
            self._failed_steps = 0
            progress = result.batch_size > 0 and llumlet.engine.has_work()
        # Nothing is held while the thread sleeps, nor while it runs calls (a KV stage's import
        # may take longer than the stream interval).
        self._hand_off(force=not progress or self._calls_waiting())
        return progress

    def _end_requests_after_a_failed_step(self) -> None:
        """A step that raised may have left the engine unable to go on (a vLLM engine core that
        failed does not recover): every request someone waits on here ends now, as aborted with
        the tokens it has, so that no client waits for tokens that will never come. Not
        resubmitted elsewhere: the request may be what broke the engine."""
        llumlet = self._llumlet()
        for request_id, reply_to in list(self.routes.owned.items()):
            request = llumlet.engine.get_request(request_id)
            delivered = request.num_output_tokens if request is not None else 0
            try:
                llumlet.abort_request(request_id)
            except Exception:
                logger.exception("aborting %s after a failed step failed as well", request_id)
            del self.routes.owned[request_id]
            self._outbox.add(reply_to, TokenOutput(request_id, delivered, (), True, FinishReason.ABORT))

    def _hand_off(self, force: bool) -> None:
        """Send every request's tokens due (TokenOutbox), and the load report when one is due."""
        due = self._outbox.take(force)
        if due:
            self._push_tokens(due)
        now = self._timer()
        if now >= self._next_report:
            self._next_report = now + self._report_interval
            load = self.report_once()
            if self.reporting and (now >= self._keepalive_due or not _says_nothing_new(load, self._last_sent)):
                self._send_load(load)
                self._last_sent = load
                self._keepalive_due = now + REPORT_KEEPALIVE

    def report_once(self) -> dict:
        """Expire handshakes and routes; the load report, with the prefix-cache changes since the
        last one under "prefix" where the engine reports them."""
        llumlet = self._llumlet()
        llumlet.tick()
        self.routes.sweep(self._clock(), lambda r: llumlet.engine.get_request(r) is not None)
        report = llumlet.load_report().to_dict()
        prefix = llumlet.prefix_events()
        if prefix:
            report["prefix"] = prefix.to_dict()
        return report

    # ------------------------------------------------------------------ requests
    def add(self, requests: Sequence[Request], reply_to: str, resubmission: bool = False,
            hand_over: str | None = None) -> None:
        """Requests handed over together, all or none: if the engine refuses one (ValueError), those
        added before it are aborted. A resubmission of a request this instance runs already goes
        on here (it moved here while its requester took its source for dead, e.g. the source died
        once it had handed the request over; or an earlier hand-over whose answer was lost came
        through): only its route is renewed. Any other request id it knows is an error. A
        hand-over its requester aborted already (`hand_over`, the id of this hand-over; the abort
        came first) is received and refused: nobody would read it."""
        llumlet = self._llumlet()
        if hand_over is not None and hand_over in self._aborted_hand_overs:
            llumlet.received_unadded(len(requests))
            raise ValueError(f"hand-over {hand_over} was aborted before it arrived")
        added: list[str] = []
        for index, request in enumerate(requests):
            try:
                if resubmission and llumlet.engine.get_request(request.request_id) is not None:
                    llumlet.received_unadded(1)
                else:
                    llumlet.add_request(request)
                    added.append(request.request_id)
            except ValueError:
                for request_id in added:
                    self.abort(request_id)
                llumlet.received_unadded(len(requests) - index - 1)
                raise
            self.routes.owned[request.request_id] = reply_to

    def received_unread(self, count: int) -> None:
        """Requests handed over that could not be read (malformed): received, never added."""
        self._llumlet().received_unadded(count)

    def abort(self, request_id: str, hand_over: str | None = None) -> bool:
        """Abort a request here; whether this instance knew it. `hand_over`: the hand-over that
        brought it, whose add may come only after this abort (it is refused then)."""
        if hand_over is not None:
            self._aborted_hand_overs[hand_over] = None
            self._aborted_hand_overs.move_to_end(hand_over)
            if len(self._aborted_hand_overs) > ABORTED_HAND_OVERS:
                self._aborted_hand_overs.popitem(last=False)
        llumlet = self._llumlet()
        known = llumlet.engine.get_request(request_id) is not None
        llumlet.abort_request(request_id)
        self.routes.owned.pop(request_id, None)
        return known

    def drop_requests_of(self, reply_to: str) -> None:
        """A requester is unreachable: nobody reads its requests' tokens, so they end."""
        llumlet = self._llumlet()
        for request_id in [r for r, a in self.routes.owned.items() if a == reply_to]:
            del self.routes.owned[request_id]
            llumlet.abort_request(request_id)

    # ------------------------------------------------------------------ callbacks from the llumlet
    def on_tokens(self, output: TokenOutput) -> None:
        routes = self.routes.owned
        reply_to = routes.pop(output.request_id, None) if output.finished else routes.get(output.request_id)
        if reply_to is None:
            logger.debug("tokens of %s have nowhere to go", output.request_id)
            return
        self._outbox.add(reply_to, output)

    def on_event(self, event: MigrationEvent) -> None:
        if event.kind is MigrationEventKind.COMMITTED:
            self.routes.owned.pop(event.request_id, None)
            self._moved[event.request_id] = event.destination
            self._moved.move_to_end(event.request_id)
            if len(self._moved) > MOVED_MEMORY:
                self._moved.popitem(last=False)
        self._publish_event(event)

    def whereabouts(self, request_ids: list[str]) -> Whereabouts:
        """Which of `request_ids` are here, moved on (and where), or gone (see `Whereabouts`)."""
        llumlet = self._llumlet()
        here, moved, gone = [], {}, []
        for request_id in request_ids:
            if llumlet.engine.get_request(request_id) is not None or self.routes.receiving(request_id):
                here.append(request_id)
            elif request_id in self._moved:
                moved[request_id] = self._moved[request_id]
            else:
                gone.append(request_id)
        return Whereabouts(tuple(here), moved, tuple(gone))

    # ------------------------------------------------------------------ migration messages
    def annotate(self, message: MigrationMessage) -> dict | None:
        """As the llumlet sends: attach the route to PreAlloc, track incoming routes' fate."""
        if isinstance(message, PreAlloc):
            reply_to = self.routes.owned.get(message.request_id)
            return {"reply_to": reply_to} if reply_to else None
        if isinstance(message, Committed):
            reply_to = self.routes.commit_incoming(message.migration_id)
            request = self._llumlet().engine.get_request(message.request_id) if reply_to else None
            if request is not None:
                # The requester learns the new owner now, not from its first token: should this
                # instance die before sending one, the requester's liveness check sees it. Sent
                # before the commit leaves (the source may go on the commit's arrival).
                self._outbox.add(reply_to, TokenOutput(message.request_id, request.num_output_tokens, ()))
                self._push_tokens(self._outbox.take(force=True))
        elif isinstance(message, Abort) or (isinstance(message, PreAllocReply) and not message.accepted):
            self.routes.drop_incoming(message.migration_id)
        return None

    def deliver(self, sender: str, message: MigrationMessage, context: dict | None) -> None:
        """A message from a peer, with the route a `PreAlloc` carries."""
        if isinstance(message, PreAlloc) and context and context.get("reply_to"):
            self.routes.add_incoming(message.migration_id, message.request_id, context["reply_to"], self._clock())
        elif isinstance(message, Abort):
            self.routes.drop_incoming(message.migration_id)
        self._llumlet().on_message(sender, message)


def _says_nothing_new(report: dict, last: dict | None) -> bool:
    """The same load as the last report sent (its time aside), and no prefix-cache changes (those
    are drained into each report, so one that carries any always goes)."""
    return (last is not None and "prefix" not in report and report.keys() == last.keys()
            and all(value == last[key] for key, value in report.items() if key != "timestamp"))
