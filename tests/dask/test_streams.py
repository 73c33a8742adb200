"""Token streams: ordering and duplicate dropping (pure), then a real TCP listener and pusher."""

from __future__ import annotations

import asyncio
import socket

import pytest
from distributed import Security
from distributed.comm.addressing import get_address_host_port
from hypothesis import given, settings
from hypothesis import strategies as st

from llumdask.engine.base import TokenLogprob, TokenOutput
from llumdask.plugins.streams import (
    TokenBatch,
    TokenListener,
    TokenOutbox,
    TokenPusher,
    TokenSequence,
    encode_frame,
    split_route,
)
from llumdask.request import FinishReason


def batches_of(tokens: list[int], cuts: list[int], owner_switch: int) -> list[TokenBatch]:
    """Split `tokens` at `cuts`; batches before `owner_switch` come from "a", the rest from "b"."""
    bounds = sorted({0, len(tokens), *[c % (len(tokens) + 1) for c in cuts]})
    out = []
    for k, (i, j) in enumerate(zip(bounds, bounds[1:])):
        last = j == len(tokens)
        out.append(TokenBatch("r", i, tuple(tokens[i:j]), "a" if k < owner_switch else "b",
                              finished=last, finish_reason=FinishReason.LENGTH if last else None,
                              logprobs=tuple(logprob_at(n) for n in range(i, j))))
    return out


def logprob_at(index: int) -> TokenLogprob:
    return TokenLogprob(-index / 8, ((index, -index / 8), (index + 1, -1 - index / 8)))


class ManualClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_outbox_holds_middle_tokens_for_the_interval_but_never_a_first_token_or_an_end():
    clock = ManualClock()
    outbox = TokenOutbox(0.01, clock)
    assert outbox.take() == []
    outbox.add("gw", TokenOutput("r", 0, (5,)))  # a first token goes at once
    assert outbox.take() == [("gw", TokenOutput("r", 0, (5,)))]
    clock.now += 0.004
    outbox.add("gw", TokenOutput("r", 1, (6,)))
    assert outbox.take() == []  # 4 ms after the last hand-off: held
    clock.now += 0.004
    outbox.add("gw", TokenOutput("r", 2, (7,)))
    outbox.add("gw2", TokenOutput("s", 3, (1,)))
    assert outbox.take() == []
    clock.now += 0.003  # 11 ms: everything held goes, in the order it came
    assert [o.first_index for _, o in outbox.take()] == [1, 2, 3]
    outbox.add("gw", TokenOutput("r", 3, (8,)))
    assert outbox.take() == []
    outbox.add("gw", TokenOutput("r", 4, (9,), finished=True, finish_reason=FinishReason.LENGTH))
    assert [o.first_index for _, o in outbox.take()] == [3, 4]  # an end takes the held tokens with it
    outbox.add("gw", TokenOutput("t", 7, (2,)))
    assert outbox.take() == [] and len(outbox.take(force=True)) == 1  # e.g. before the thread sleeps


def test_outbox_without_an_interval_hands_off_every_step_and_rejects_a_negative_one():
    outbox = TokenOutbox(0.0, ManualClock())
    outbox.add("gw", TokenOutput("r", 4, (1,)))
    assert len(outbox.take()) == 1
    with pytest.raises(ValueError, match="interval"):
        TokenOutbox(-0.1)


def test_in_order_batches_deliver_everything_and_finish():
    seq = TokenSequence()
    assert seq.add(TokenBatch("r", 0, (5, 6), "a")) == [5, 6]
    assert not seq.done
    assert seq.add(TokenBatch("r", 2, (7,), "a", finished=True, finish_reason=FinishReason.STOP)) == [7]
    assert seq.done and seq.finish_reason is FinishReason.STOP and seq.delivered == [5, 6, 7]


def test_gap_holds_back_later_tokens_until_filled():
    seq = TokenSequence()
    assert seq.add(TokenBatch("r", 2, (7, 8), "b", finished=True)) == []
    assert not seq.done
    assert seq.add(TokenBatch("r", 0, (5,), "a")) == [5]
    assert seq.add(TokenBatch("r", 1, (6,), "a")) == [6, 7, 8]
    assert seq.done


def test_duplicates_are_dropped_and_disagreement_is_counted():
    seq = TokenSequence()
    seq.add(TokenBatch("r", 0, (1, 2, 3), "a"))
    assert seq.add(TokenBatch("r", 1, (2, 3, 4), "b")) == [4]
    assert seq.conflicts == 0 and seq.owner == "b"
    seq.add(TokenBatch("r", 0, (9,), "a"))
    assert seq.conflicts == 1 and seq.delivered == [1, 2, 3, 4]


def test_the_owner_is_whoever_sent_the_furthest_tokens_not_the_latest_batch():
    seq = TokenSequence()
    seq.add(TokenBatch("r", 0, (1, 2), "source"))
    seq.add(TokenBatch("r", 4, (5, 6), "destination"))  # overtook the source's last tokens
    assert seq.owner == "destination"
    assert seq.add(TokenBatch("r", 2, (3, 4), "source")) == [3, 4, 5, 6]
    assert seq.owner == "destination"


def test_a_batch_without_tokens_claims_ownership_from_where_the_tokens_are():
    """A migration's destination says so at its commit; the source's last tokens, sent later, do
    not win it back, and a claim from behind the furthest tokens is stale."""
    seq = TokenSequence()
    seq.add(TokenBatch("r", 0, (1, 2), "source"))
    assert seq.add(TokenBatch("r", 3, (), "destination")) == []
    assert seq.owner == "destination"
    assert seq.add(TokenBatch("r", 2, (3,), "source")) == [3]
    assert seq.owner == "destination"
    seq.add(TokenBatch("r", 1, (), "source"))
    assert seq.owner == "destination" and seq.delivered == [1, 2, 3]


def test_start_index_skips_tokens_delivered_elsewhere():
    seq = TokenSequence(start_index=3)
    assert seq.add(TokenBatch("r", 0, (1, 2, 3, 4), "a")) == [4]
    assert seq.next_index == 4 and seq.conflicts == 0
    with pytest.raises(ValueError, match="start_index"):
        TokenSequence(start_index=-1)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50), min_size=1, max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=10),
    owner_switch=st.integers(0, 10),
    data=st.data(),
)
def test_any_arrival_order_with_duplicates_reassembles_the_stream(tokens, cuts, owner_switch, data):
    batches = batches_of(tokens, cuts, owner_switch)
    duplicated = batches + data.draw(st.lists(st.sampled_from(batches), max_size=5))
    arrival = data.draw(st.permutations(duplicated))
    seq = TokenSequence()
    delivered: list[int] = []
    for batch in arrival:
        delivered += seq.add(batch)
        assert delivered == tokens[: len(delivered)]
        assert seq.logprobs(0, len(delivered)) == [logprob_at(n) for n in range(len(delivered))]
    assert delivered == tokens and seq.done and seq.conflicts == 0


def test_logprobs_cross_the_wire_beside_their_tokens():
    import msgpack

    prompt = (None, TokenLogprob(-2.5, ((7, -0.5),), rank=4), TokenLogprob(-0.5, ((7, -0.5),)))  # ranks cross too
    batch = TokenBatch("r", 0, (4, 5), "a", logprobs=(logprob_at(0), logprob_at(1)), prompt_logprobs=prompt)
    back = TokenBatch.from_msg(msgpack.unpackb(msgpack.packb(batch.to_msg())))
    assert back == batch
    plain = TokenBatch("r", 0, (4,), "a")
    assert "logprobs" not in plain.to_msg() and TokenBatch.from_msg(plain.to_msg()) == plain
    with pytest.raises(ValueError, match="1 logprobs for 2 tokens"):
        TokenBatch.from_msg({**batch.to_msg(), "logprobs": [list(logprob_at(0))]})
    seq = TokenSequence()
    seq.add(batch)
    assert seq.prompt_logprobs == prompt and seq.logprobs(1, 2) == [logprob_at(1)]
    # An entry without a rank (sent by a worker of an older release) reads as rank unknown.
    older = {**batch.to_msg(), "logprobs": [[-0.5, [[3, -0.25]]], [-0.75, []]]}
    assert TokenBatch.from_msg(older).logprobs == (TokenLogprob(-0.5, ((3, -0.25),)), TokenLogprob(-0.75))


def test_the_prompts_cached_tokens_cross_the_wire_with_the_first_batch():
    import msgpack

    first = TokenBatch("r", 0, (4,), "a", cached_tokens=32)
    assert TokenBatch.from_msg(msgpack.unpackb(msgpack.packb(first.to_msg()))) == first
    assert "cached_tokens" not in TokenBatch("r", 1, (5,), "a").to_msg()
    seq = TokenSequence()
    seq.add(TokenBatch("r", 1, (5,), "b"))
    assert seq.cached_tokens is None
    seq.add(first)
    seq.add(TokenBatch("r", 0, (4,), "c", cached_tokens=0))  # a duplicate from elsewhere changes nothing
    assert seq.cached_tokens == 32


def test_listener_receives_pushed_tokens_in_order_over_a_real_connection():
    async def main():
        listener = await TokenListener().start()
        pusher = TokenPusher("tcp://127.0.0.1:1")
        try:
            stream = listener.open("r1")
            other = listener.open("r2")
            # The destination's first tokens overtake the source's last ones.
            await _push(pusher, [(listener.address, TokenOutput("r1", 2, (30, 40))),
                                 (listener.address, TokenOutput("r2", 0, (9,), True, FinishReason.LENGTH))])
            await _push(pusher, [(listener.address, TokenOutput("r1", 0, (10, 20)))])
            await _push(pusher, [(listener.address, TokenOutput("r1", 3, (40, 50), True, FinishReason.STOP))])
            got = await asyncio.wait_for(_collect(stream), 10)
            assert got == [10, 20, 30, 40, 50]
            assert stream.sequence.finish_reason is FinishReason.STOP
            assert await asyncio.wait_for(_collect(other), 10) == [9]
            assert stream.sequence.owner == "tcp://127.0.0.1:1"
        finally:
            pusher.close()
            await listener.close()

    asyncio.run(main())


def test_pusher_reports_an_unreachable_requester_and_tries_again_later():
    async def main():
        listener = await TokenListener().start()
        address = listener.address
        await listener.close()
        lost: list[str] = []
        pusher = TokenPusher("w", on_unreachable=lost.append, connect_timeout=1)
        await _push(pusher, [(address, TokenOutput("r", 0, (1,)))])
        assert lost == [address]
        await _push(pusher, [(address, TokenOutput("r", 1, (2,)))])
        assert lost == [address, address]
        pusher.close()

    asyncio.run(main())


def test_a_new_requester_at_a_closed_ones_address_gets_every_token():
    """Listener ports are reused: after a requester closes, another may bind its address. The
    pusher's old connection to it must not swallow the new one's tokens or call it unreachable."""
    async def main():
        first = await TokenListener().start()
        lost: list[str] = []
        pusher = TokenPusher("w", on_unreachable=lost.append)
        stream = first.open("r1")
        await _push(pusher, [(first.address, TokenOutput("r1", 0, (1,), True, FinishReason.LENGTH))])
        assert await asyncio.wait_for(_collect(stream), 10) == [1]
        address = first.address
        await first.close()
        second = await TokenListener(address).start()
        try:
            assert split_route(second.address)[0] == split_route(address)[0]  # the same port, a new key
            stream = second.open("r2")
            for k in range(3):
                await _push(pusher, [(second.address, TokenOutput("r2", k, (10 + k,), k == 2, FinishReason.LENGTH))])
            assert await asyncio.wait_for(_collect(stream), 10) == [10, 11, 12]
            assert lost == []
        finally:
            pusher.close()
            await second.close()

    asyncio.run(main())


def test_a_requester_that_stops_reading_is_reported_when_a_send_times_out():
    async def main():
        server = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel does), never reads
        address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
        lost: list[str] = []
        pusher = TokenPusher("w", on_unreachable=lost.append, send_timeout=0.2)
        big = TokenOutput("r", 1, tuple(range(1 << 16)))
        for _ in range(200):  # until the socket buffers are full
            await _push(pusher, [(address, big)])
            if lost:
                break
        pusher.close()
        server.close()
        assert lost == [address]

    asyncio.run(main())


def test_listener_reports_a_closed_sender_and_survives_a_bad_frame():
    async def main():
        closed: list[str] = []
        listener = await TokenListener(on_sender_closed=closed.append).start()
        pusher = TokenPusher("owner-1")
        stream = listener.open("r")
        await _push(pusher, [(listener.address, TokenOutput("r", 0, (1,)))])
        assert await asyncio.wait_for(stream.next_tokens(), 10) == [1]
        pusher.close()
        with socket.create_connection(get_address_host_port(split_route(listener.address)[0])) as bad:
            bad.sendall(b"\xff\xff\xff\xff")  # a frame over the size limit
        for _ in range(100):
            if closed:
                break
            await asyncio.sleep(0.05)
        assert closed == ["owner-1"]  # the bad frame's connection named no sender
        other = TokenPusher("owner-2")
        await _push(other, [(listener.address, TokenOutput("r", 1, (2,), True, FinishReason.LENGTH))])
        assert await asyncio.wait_for(stream.next_tokens(), 10) == [2]
        other.close()
        await listener.close()

    asyncio.run(main())


def test_a_connection_cancelled_with_its_loop_ends_as_a_closed_one_without_a_traceback():
    """A client's process exiting without close() cancels the listener's connection handlers with
    its loop: each ends as a closed connection would, and asyncio reports no error (Python 3.11's
    start_server prints a traceback for a handler that ends cancelled)."""
    async def main():
        reported: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, context: reported.append(context))
        closed: list[str] = []
        listener = await TokenListener(on_sender_closed=closed.append).start()
        stream = listener.open("r")
        pusher = TokenPusher("owner")
        await _push(pusher, [(listener.address, TokenOutput("r", 0, (1,)))])
        assert await asyncio.wait_for(stream.next_tokens(), 10) == [1]
        (handler,) = [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "_handle_connection"]
        handler.cancel()
        await asyncio.sleep(0.1)  # the server's done-callback runs
        assert handler.done() and not handler.cancelled() and closed == ["owner"]
        pusher.close()
        await listener.close()
        return reported

    assert asyncio.run(main()) == []


def test_a_connection_without_the_listeners_key_is_refused_and_changes_no_stream(caplog):
    async def main():
        listener = await TokenListener().start()
        stream = listener.open("r")
        address, key = split_route(listener.address)
        forged = encode_frame([TokenBatch("r", 0, (666,), "intruder", True, FinishReason.STOP).to_msg()])
        hellos = (b"", encode_frame([{"op": "llumnix_tokens_hello", "key": "guess", "instance": "intruder"}]))
        for hello in hellos:  # no hello at all (tokens first), and a wrong key
            reader, writer = await asyncio.open_connection(*get_address_host_port(address))
            writer.write(hello + forged)
            assert await asyncio.wait_for(reader.read(1), 10) == b""  # closed by the listener
            writer.close()
        assert listener.refused == 2 and stream.sequence.next_index == 0 and not stream.sequence.done
        pusher = TokenPusher("owner")
        await _push(pusher, [(listener.address, TokenOutput("r", 0, (1, 2), True, FinishReason.LENGTH))])
        assert await asyncio.wait_for(_collect(stream), 10) == [1, 2]
        pusher.close()
        await listener.close()
        return key

    key = asyncio.run(main())
    assert "refused a connection" in caplog.text and key not in caplog.text


def test_a_listeners_key_stays_out_of_the_log(caplog):
    async def main():
        listener = await TokenListener().start()
        route = listener.address
        await listener.close()
        pusher = TokenPusher("w", connect_timeout=1)
        await _push(pusher, [(route, TokenOutput("r", 1, (5,)))])
        pusher.close()
        return route

    route = asyncio.run(main())
    assert "unreachable" in caplog.text and split_route(route)[0] in caplog.text
    assert split_route(route)[1] not in caplog.text


def test_under_dask_security_tokens_travel_over_tls_with_the_clusters_certificates():
    security, stranger = Security.temporary(), Security.temporary()

    async def main():
        connected: list[str] = []
        listener = await TokenListener(ssl_context=security.get_listen_args("client")["ssl_context"],
                                       on_sender_closed=connected.append).start()
        assert listener.address.startswith("tls://")
        stream = listener.open("r")
        pusher = TokenPusher("owner", ssl_context=security.get_connection_args("worker")["ssl_context"])
        for k in range(5):  # several pushes on one connection (TLS records read as nothing, not as a close)
            await _push(pusher, [(listener.address, TokenOutput("r", k, (k,), k == 4, FinishReason.LENGTH))])
            await asyncio.sleep(0.05)
        assert await asyncio.wait_for(_collect(stream), 10) == [0, 1, 2, 3, 4]
        assert connected == []  # the one connection is still open
        # Plain TCP, or TLS with another CA's certificate: no stream changes.
        other = listener.open("o")
        lost: list[str] = []
        outsider = TokenPusher("outsider", on_unreachable=lost.append, connect_timeout=2,
                               ssl_context=stranger.get_connection_args("worker")["ssl_context"])
        await _push(outsider, [(listener.address, TokenOutput("o", 0, (666,), True, FinishReason.STOP))])
        reader, writer = await asyncio.open_connection(*get_address_host_port(split_route(listener.address)[0]))
        writer.write(encode_frame([TokenBatch("o", 0, (666,), "plain", True, FinishReason.STOP).to_msg()]))
        await asyncio.wait_for(reader.read(), 10)  # the listener drops what is not TLS
        writer.close()
        await asyncio.sleep(0.1)
        assert other.sequence.next_index == 0 and not other.sequence.done
        outsider.close()
        pusher.close()
        await listener.close()

    asyncio.run(main())


async def _push(pusher: TokenPusher, outbox) -> None:
    """Push from another thread, as the engine thread does, while this loop serves the listener."""
    await asyncio.get_running_loop().run_in_executor(None, pusher.push, outbox)


async def _collect(stream) -> list[int]:
    return [t async for t in stream]
