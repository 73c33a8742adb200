"""The requester's side of serving (notebook client, gateway): placement, token streams, recovery.

Placement: the scheduler's `llumnix_dispatch` names an instance (a few numbers go to the
scheduler, never the prompt), then the request goes straight to that instance's worker; the
choices of one completion go together (`submit_together`: one dispatch, one hand-over to one
instance, where they share the prompt's KV). Past capacity the scheduler may hold a request
for room (`dispatch.hold-freeness`): it answers "held" and the requester asks again, for as long as
it is held. If the scheduler does not answer within `dispatch_timeout`, the requester enters bypass mode for
`bypass_period`: it hands requests to known instances itself, in turn (no migration, no load
balance beyond rotation), and tries the scheduler again afterwards, or as soon as no known
instance is left (they died with a killed scheduler). Transient failures (no
instance ready yet, an instance that just died) are retried until `placement_timeout`; a
hand-over left unanswered may still come through, so the request is aborted there first, and
placed again as admitted (it had its turn). A caller cancelled meanwhile (a gateway's client
gone) leaves nothing behind: its held request is withdrawn, its hand-over aborted. (An add and
its abort travel on two connections and may arrive in either order: the abort names the hand-over,
and an instance refuses a hand-over aborted before it arrived.)

Recovery: the requester keeps every open request (prompt, sampling, tokens received so far).
When the instance holding one is gone from the scheduler's instance table (checked every
`liveness_interval`, and when that instance's token connection closes at once and then every
`SUSPECT_RECHECK` until its next regular check), it resubmits prompt + tokens so far
elsewhere; the new instance recomputes them and continues, and the stream goes on
with the next sequence number. A request that cannot go on from its tokens (a structured output,
whose grammar would start over) fails with that reason instead of going on wrong. A scheduler
restart looks the same: the old instances are not in the new scheduler's table, so their
requests are resubmitted to the new ones. A live instance may also end a request without a word
reaching here (it drops the requests of a requester it could not reach for a while); a stream
with no new token for `stall_timeout` is therefore asked after at its instance (`llumnix_where`),
followed where it moved, and resubmitted the same way where it is gone.

Everything here runs on the Dask client's event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from distributed import Client
from distributed.utils import get_ip

from llumdask.config import RequesterConfig, load_config
from llumdask.global_scheduler import ClusterOverloaded, NoInstanceAvailable
from llumdask.plugins.control import NoLlumdaskScheduler, Op, RequestRejected, call
from llumdask.plugins.streams import TokenBatch, TokenListener, TokenStream, without_key
from llumdask.plugins.wire import request_to_msg
from llumdask.prefix import dispatch_keys
from llumdask.request import FinishReason, Request, RequestStatus

logger = logging.getLogger(__name__)

# Seconds between checks of a holder whose token connection closed, until its next regular check.
SUSPECT_RECHECK = 0.1


@dataclass
class _Open:
    """An open request: everything needed to resubmit it elsewhere."""

    request: Request
    stream: TokenStream
    # The instance the request was last handed to; the stream's owner once tokens come from elsewhere.
    instance: str
    recovering: bool = False
    # The stream's length when it last grew (or its instance was last asked about it), and when.
    seen_index: int = 0
    seen_at: float = field(default_factory=time.monotonic)

    @property
    def holder(self) -> str:
        return self.stream.sequence.owner or self.instance


class Requester:
    """Submits requests, receives their tokens, and resubmits those whose instance died."""

    def __init__(self, client: Client, config: RequesterConfig | None = None, block_size: int | None = None) -> None:
        """`config`: the ``llumdask.requester`` settings; `block_size`: the instances' KV block size,
        which a prompt's block hashes are cut by (both dask.config's when None; the block size
        then follows the scheduler's from the first membership poll on)."""
        self._config = config if config is not None else load_config().requester
        self._block_size = block_size if block_size is not None else load_config().block_size
        self._client = client
        self._listener: TokenListener | None = None
        # Concurrent first submissions would each start a listener, open their streams on their
        # own and name the last one as the route: the tokens of the others would go nowhere.
        self._listener_lock = asyncio.Lock()
        self._open: dict[str, _Open] = {}
        self._watchdog: asyncio.Task | None = None
        # Resubmissions under way, and what undoes a placement step given up on (the withdrawal of a
        # held request at the scheduler, None here, the abort of a hand-over left unanswered or of
        # a request its caller left at its instance), by request id and where: closing cancels the
        # first and lets the second finish; the request's next step there waits for it.
        self._resubmissions: set[asyncio.Task] = set()
        self._undoing: dict[tuple[str, str | None], asyncio.Task] = {}
        self._attempts = itertools.count()  # numbers the scheduler's dispatches
        self._check_now = asyncio.Event()
        # Holders whose token connection closed, each asked about again every `SUSPECT_RECHECK`
        # until this monotonic time (its next regular check).
        self._suspects: dict[str, float] = {}
        self._bypass_until = 0.0
        # Instances last seen in the scheduler's table (for bypass mode), in rotation order.
        self._known: list[str] = []
        self._rotation = itertools.count()
        # The scheduler's membership epoch of `_alive` (every instance it knows) and `_known`.
        self._epoch: str | None = None
        self._alive: set[str] = set()
        self.resubmissions = 0
        self.bypassed = 0

    # ------------------------------------------------------------------ requests
    async def submit(self, request: Request) -> TokenStream:
        """Place a request and return its token stream (open until it finishes or is forgotten)."""
        return (await self.submit_together([request]))[0]

    async def submit_together(self, requests: Sequence[Request]) -> list[TokenStream]:
        """Place requests that share a prompt (the choices of one completion) on one instance with
        one dispatch and one hand-over (they enter the engine between the same two steps, as
        vLLM's server adds a parent request's n choices at once) and share the prompt's KV
        through the prefix cache. All or none: the instance takes them all or refuses them all."""
        listener = await self._ensure_listener()
        streams = [listener.open(r.request_id) for r in requests]
        try:
            instance = await self._place(requests)
        except BaseException:
            for request in requests:
                listener.close_stream(request.request_id)
            raise
        for request, stream in zip(requests, streams):
            self._open[request.request_id] = _Open(request, stream, instance)
        return streams

    def holder(self, request_id: str) -> str | None:
        """The instance believed to hold an open request now."""
        entry = self._open.get(request_id)
        return None if entry is None else entry.holder

    def forget(self, request_id: str) -> None:
        self._open.pop(request_id, None)
        if self._listener is not None:
            self._listener.close_stream(request_id)

    async def abort(self, request_id: str) -> None:
        """Best effort: drop an open request here and on the instance holding it."""
        holder = self.holder(request_id)
        self.forget(request_id)
        if holder is not None:
            await self._abort_on(holder, request_id)

    def abort_soon(self, request_id: str) -> None:
        """`abort` without waiting for the instance's answer: for a caller that is going (cancelled,
        timed out), which an instance that died must not hold up for `rpc_timeout`; closing
        waits for it."""
        holder = self.holder(request_id)
        self.forget(request_id)
        if holder is not None:
            self._undo_soon(request_id, holder, self._abort_on(holder, request_id))

    async def _abort_on(self, instance: str, request_id: str, hand_over: str | None = None) -> None:
        """`hand_over`: the hand-over given up on, whose add the instance refuses should it come later."""
        try:
            await asyncio.wait_for(call(self._client.rpc(instance), Op.ABORT, request_id=request_id, hand_over=hand_over),
                                   self._config.rpc_timeout)
        except Exception as exc:  # best effort: an instance gone or going drops it anyway
            logger.info("could not abort %s on %s: %s", request_id, instance, exc)

    async def status(self) -> dict:
        """The scheduler's `llumnix_status` (the whole instance table and the migration counts)."""
        return await asyncio.wait_for(call(self._client.scheduler, Op.STATUS), self._config.rpc_timeout)

    async def members(self) -> set[str]:
        """The instances the scheduler knows, asked as "anything new since the last answer?"; also
        keeps the placeable ones for bypass mode."""
        reply = await asyncio.wait_for(call(self._client.scheduler, Op.MEMBERS, epoch=self._epoch), self._config.rpc_timeout)
        if reply.alive is not None:
            self._epoch, self._alive, self._known = reply.epoch, set(reply.alive), list(reply.placeable)
        if reply.block_size:
            self._block_size = reply.block_size  # the cluster's, over this process's configuration
        return self._alive

    @property
    def token_address(self) -> str | None:
        """Where instances send this requester's tokens (tls:// under the cluster's TLS), without
        the listener's key; None before the first request."""
        return None if self._listener is None else without_key(self._listener.address)

    async def close(self) -> None:
        if self._watchdog is not None:  # first: it starts resubmissions
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
            self._watchdog = None
        for task in self._resubmissions:
            task.cancel()
        await asyncio.gather(*self._resubmissions, return_exceptions=True)
        while self._undoing:  # including those started meanwhile
            await asyncio.gather(*self._undoing.values(), return_exceptions=True)
        if self._listener is not None:
            await self._listener.close()
            self._listener = None
        self._open.clear()

    # ------------------------------------------------------------------ placement
    async def _place(self, requests: Sequence[Request], *, admitted: bool = False) -> str:
        """Choose one instance for requests sharing a prompt and hand them over in one call (all or
        none): the instance that took them; after a transient failure they are placed again until
        `placement_timeout`. A refusal for load (ClusterOverloaded) is not retried: the caller
        answers it; `admitted` requests (resubmissions, and requests the scheduler placed once
        whose hand-over failed: they had their turn) are never refused for load nor held again."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.placement_timeout
        resubmission = admitted  # an instance may hold them already: moved there, or a hand-over came through
        while True:
            try:
                instance, attempt = await self._choose(requests[0], admitted, len(requests))
                admitted = admitted or attempt is not None
                try:
                    await self._hand_over(requests, instance, resubmission)
                finally:
                    resubmission = True
                return instance
            except (OSError, asyncio.TimeoutError, NoInstanceAvailable) as exc:
                if loop.time() > deadline:
                    raise NoInstanceAvailable(
                        f"request {requests[0].request_id} not placed within {self._config.placement_timeout} s: {exc}"
                    ) from exc
                logger.debug("placing %s failed (%s); retrying", requests[0].request_id, exc)
                await asyncio.sleep(0.2)

    async def _choose(self, request: Request, admitted: bool, count: int) -> tuple[str, int | None]:
        """The instance for `request` and the `count` - 1 others placed with it (its prompt's), and
        the number of the scheduler's dispatch that chose it (None: bypass mode chose it)."""
        loop = asyncio.get_running_loop()
        # With no instance left to bypass to (they died with a killed scheduler), only the
        # scheduler can place it: ask it again rather than wait out the bypass period.
        if loop.time() >= self._bypass_until or not self._known:
            attempt = next(self._attempts)
            try:
                return await self._dispatch(request, admitted, count, attempt), attempt
            except (OSError, asyncio.TimeoutError):
                logger.warning("the scheduler does not answer: dispatching directly for %s s", self._config.bypass_period)
                self._bypass_until = loop.time() + self._config.bypass_period
        if not self._known:
            raise NoInstanceAvailable("the scheduler does not answer and no instance is known")
        self.bypassed += 1
        return self._known[next(self._rotation) % len(self._known)], None

    async def _dispatch(self, request: Request, admitted: bool, count: int, attempt: int) -> str:
        """The scheduler's placement. Each answer comes within `dispatch_timeout` or the scheduler
        counts as silent; one that holds the request for room is asked again (it keeps its place
        in the scheduler's queue) for as long as it holds it, like a queue on an instance, but
        held with no instance to go to no longer than `placement_timeout`, as a request that
        finds none is placed. A held request given up on (that, silence, a cancelled caller) is
        withdrawn, so that it takes no room later, and so is a placement whose answer did not
        come. `attempt` names this dispatch, so that its withdrawal forgets nothing of another."""
        # The scheduler sees block hashes, never tokens: enough to find a cached prefix.
        hashes = dispatch_keys(request.prompt_token_ids + request.output_token_ids, self._block_size,
                               request.cache_salt)
        loop = asyncio.get_running_loop()
        await self._undone([request], None)  # an earlier attempt's withdrawal goes first, or it would take this one's place
        refused = False  # the scheduler refused it outright: it holds nothing to withdraw
        alone_since: float | None = None  # held with no instance to go to, since
        try:
            while True:
                try:
                    reply = await asyncio.wait_for(call(
                        self._client.scheduler, Op.DISPATCH,
                        request_id=request.request_id,
                        num_prompt_tokens=request.num_tokens,
                        max_tokens=request.remaining_tokens,
                        execution_priority=int(request.execution_priority),
                        admitted=admitted,
                        count=count,
                        block_hashes=hashes,
                        answer_within=self._config.dispatch_timeout,
                        attempt=attempt,
                    ), self._config.dispatch_timeout)
                except (NoInstanceAvailable, ClusterOverloaded):
                    refused = True
                    raise
                if reply.instance is not None:
                    return reply.instance
                if not reply.no_instance:
                    alone_since = None
                elif alone_since is None:
                    alone_since = loop.time()
                elif loop.time() - alone_since > self._config.placement_timeout:
                    raise NoInstanceAvailable(f"request {request.request_id} held with no instance to go to for "
                                              f"{self._config.placement_timeout} s")
        except BaseException:
            if not refused:  # any ask may have left it held
                self._undo_soon(request.request_id, None, self._withdraw(request.request_id, attempt))
            raise

    def _undo_soon(self, request_id: str, where: str | None, work: Coroutine[Any, Any, None]) -> None:
        """Undo a placement step given up on, at the scheduler (`where` None) or an instance, by
        `work`, without waiting for the answer; the request's next step there waits for it (`_undone`)."""
        key = (request_id, where)
        task = self._undoing[key] = asyncio.ensure_future(work)

        def done(_: asyncio.Task) -> None:
            if self._undoing.get(key) is task:
                del self._undoing[key]

        task.add_done_callback(done)

    async def _undone(self, requests: Sequence[Request], where: str | None) -> None:
        """Once what undoes the requests' earlier steps at `where` (None: the scheduler) is done."""
        earlier = {task for r in requests if (task := self._undoing.get((r.request_id, where))) is not None}
        if earlier:
            await asyncio.wait(earlier)

    async def _withdraw(self, request_id: str, attempt: int) -> None:
        try:
            await asyncio.wait_for(call(self._client.scheduler, Op.WITHDRAW, request_id=request_id, attempt=attempt),
                                   self._config.dispatch_timeout)
        except Exception as exc:  # the scheduler forgets it anyway once its lease runs out
            logger.debug("withdrawing held request %s failed: %s", request_id, exc)

    async def _hand_over(self, requests: Sequence[Request], instance: str, resubmission: bool) -> None:
        """In one call, all or none (the instance adds them between the same two steps).
        `resubmission`: the instance may hold a request already (it moved there, or an earlier
        hand-over there came through after all), and then keeps it running. A hand-over without
        an answer (timed out, the connection lost, the caller cancelled) may have added them all
        the same: they are aborted there, naming the hand-over (its add, should it arrive after
        the abort on its own connection, is refused), so that none runs unseen beside its
        placement elsewhere. (Given up on before the call, while it waits for such an abort, its
        placement's charge there stays until the scheduler's pending expiry: withdrawing it
        would take the earlier hand-over's entry, of the same request there, too.)"""
        await self._undone(requests, instance)  # an earlier hand-over's abort there goes first, or it would end this one
        hand_over = uuid.uuid4().hex
        try:
            await asyncio.wait_for(
                call(self._client.rpc(instance), Op.ADD, requests=[request_to_msg(r) for r in requests],
                     reply_to=self._listener.address, resubmission=resubmission, hand_over=hand_over),
                self._config.rpc_timeout,
            )
        except NoLlumdaskScheduler:
            raise RequestRejected(f"{instance} runs no llumlet (its worker plugin is gone)") from None
        except RequestRejected:
            raise  # refused, all of them: nothing of them runs there
        except BaseException as exc:
            for request in requests:
                self._undo_soon(request.request_id, instance, self._abort_on(instance, request.request_id, hand_over))
            if isinstance(exc, (OSError, asyncio.TimeoutError)) and instance in self._known:
                self._known.remove(instance)
                self._epoch = None  # the next poll brings the lists again, whatever the epoch
            raise

    # ------------------------------------------------------------------ recovery
    async def _ensure_listener(self) -> TokenListener:
        async with self._listener_lock:
            if self._listener is None:
                host = self._config.listen_host or _host_reaching(self._client.scheduler.address)
                # Under the cluster's TLS, instances reach this listener with their worker certificates.
                tls = self._client.security.get_listen_args("client").get("ssl_context")
                self._listener = await TokenListener(f"tcp://{host}:0", on_sender_closed=self._on_sender_closed,
                                                     ssl_context=tls).start()
                self._watchdog = asyncio.ensure_future(self._watch())
                try:
                    await self.members()  # know some instances in case the scheduler stops answering
                except (OSError, asyncio.TimeoutError, NoLlumdaskScheduler):
                    pass
        return self._listener

    def _on_sender_closed(self, instance: str) -> None:
        """An owner's token connection closed: if it held open requests, check at once whether it
        died. It may well have (with a killed scheduler, all its instances go): bypass mode leaves
        it out until the scheduler's next answer lists it again."""
        if instance in self._known:
            self._known.remove(instance)
            self._epoch = None
        if any(entry.holder == instance for entry in self._open.values()):
            self._suspects[instance] = time.monotonic() + self._config.liveness_interval
            self._check_now.set()

    async def _watch(self) -> None:
        """While requests are open, check every `liveness_interval` that their instances live, and
        every `SUSPECT_RECHECK` while a holder's token connection closed lately: a SIGKILL closes
        it at once, and the scheduler may drop the instance from its table a moment later."""
        while True:
            interval = SUSPECT_RECHECK if self._suspects else self._config.liveness_interval
            try:
                await asyncio.wait_for(self._check_now.wait(), interval)
            except asyncio.TimeoutError:
                pass
            self._check_now.clear()
            now = time.monotonic()
            self._suspects = {instance: until for instance, until in self._suspects.items() if until > now}
            if self._open:
                await self._recover_lost()
                await self._ask_about_stalled()

    async def _recover_lost(self) -> None:
        try:
            alive = await self.members()
        except (OSError, asyncio.TimeoutError, NoLlumdaskScheduler):
            return  # no instance table to go by: an unanswered check proves no death
        for instance in self._suspects.keys() - alive:
            del self._suspects[instance]  # dead: its requests go elsewhere now
        for entry in list(self._open.values()):
            if not entry.recovering and not entry.stream.sequence.done and entry.holder not in alive:
                entry.recovering = True
                _keep_until_done(self._resubmissions, self._resubmit(entry))

    async def _ask_about_stalled(self) -> None:
        """Open requests without a new token for `stall_timeout`: ask their instance whether it
        still has them. One it moved is followed there; one it does not have (it ended the request
        without a word reaching here: dropped as its requester seemed unreachable, or the last
        tokens were lost) is resubmitted with the tokens received, as after an instance death."""
        now = time.monotonic()
        stalled: dict[str, list[_Open]] = {}
        for entry in self._open.values():
            index = entry.stream.sequence.next_index
            if index != entry.seen_index:
                entry.seen_index, entry.seen_at = index, now
            elif not entry.recovering and not entry.stream.sequence.done \
                    and now - entry.seen_at >= self._config.stall_timeout:
                stalled.setdefault(entry.holder, []).append(entry)
        for holder, entries in stalled.items():
            try:
                found = await asyncio.wait_for(
                    call(self._client.rpc(holder), Op.WHERE, request_ids=[e.request.request_id for e in entries]),
                    self._config.rpc_timeout)
            except (OSError, asyncio.TimeoutError, NoLlumdaskScheduler):
                continue  # whether it died is the liveness check's to say
            for entry in entries:
                request_id = entry.request.request_id
                entry.seen_at = now  # ask again after another stall_timeout
                if entry.recovering or entry.stream.sequence.next_index != entry.seen_index:
                    continue  # tokens came meanwhile
                if request_id in found.moved:
                    entry.instance = entry.stream.sequence.owner = found.moved[request_id]
                elif request_id in found.gone:
                    logger.info("request %s is no longer on %s, which ended it unseen: resubmitting", request_id,
                                holder)
                    entry.recovering = True
                    _keep_until_done(self._resubmissions, self._resubmit(entry))

    async def _resubmit(self, entry: _Open) -> None:
        """Hand prompt + tokens so far to another instance; it recomputes them and goes on."""
        original = entry.request
        sequence = entry.stream.sequence
        # Everything the request came with (its cache salt too), and the tokens delivered so far.
        request = dataclasses.replace(original, output_token_ids=sequence.delivered, status=RequestStatus.WAITING,
                                      finish_reason=None)
        reason = _finished_by(request)
        try:
            if reason is None and request.output_token_ids and (breaks := request.sampling.resume_breaks):
                self._fail(entry, RuntimeError(
                    f"request {request.request_id}: its instance died after {len(request.output_token_ids)} tokens, "
                    f"and it cannot go on elsewhere: {breaks}; send it again"))
                return
            if reason is not None:
                # Only the final message was lost: the tokens say the request is complete.
                entry.stream.push(TokenBatch(request.request_id, len(request.output_token_ids), (),
                                             entry.holder, finished=True, finish_reason=reason))
                return
            try:
                instance = await self._place([request], admitted=True)
            except RuntimeError as exc:  # not placed in time, refused, no llumdask scheduler
                self._fail(entry, exc)
                return
            if self._open.get(request.request_id) is not entry:  # aborted meanwhile: it must not run on
                self._undo_soon(request.request_id, instance, self._abort_on(instance, request.request_id))
                return
            entry.instance = instance
            sequence.owner = None
            self.resubmissions += 1
            logger.info("request %s resubmitted to %s after %d tokens", request.request_id, instance,
                        len(request.output_token_ids))
        finally:
            entry.recovering = False

    def _fail(self, entry: _Open, exc: Exception) -> None:
        """End an open request with `exc` for its reader; it is no longer open (never resubmitted)."""
        entry.stream.fail(exc)
        if self._open.get(entry.request.request_id) is entry:
            del self._open[entry.request.request_id]


def _keep_until_done(tasks: set[asyncio.Task], work: Coroutine[Any, Any, None]) -> None:
    """Run `work` in the background, kept in `tasks` until it is done (for close to find)."""
    task = asyncio.ensure_future(work)
    tasks.add(task)
    task.add_done_callback(tasks.discard)


def _finished_by(request: Request) -> FinishReason | None:
    """Whether the tokens a request already has complete it (its last message may be lost)."""
    output = request.output_token_ids
    if output and output[-1] in request.sampling.stop_token_ids:
        return FinishReason.STOP
    if request.remaining_tokens <= 0:
        return FinishReason.LENGTH
    return None


def _host_reaching(address: str) -> str:
    """The local IP through which `address` (a scheduler) is reachable: workers reach us there too."""
    host = urlparse(address).hostname or "127.0.0.1"
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    return get_ip(host)
