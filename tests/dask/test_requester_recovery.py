"""The requester's recovery decision on its own (the cluster paths are test_failures.py's): what
it does with a request whose instance died, given the tokens that request already has."""

from __future__ import annotations

import asyncio

import pytest

from llumdask.plugins.requester import Requester, _Open
from llumdask.plugins.streams import TokenBatch, TokenStream
from llumdask.request import Request, SamplingParams


def recover(sampling: SamplingParams, delivered: int) -> tuple[TokenStream, list[Request]]:
    """Resubmit a request with `delivered` tokens after its instance "dead" died; the placements tried."""
    placed: list[Request] = []

    async def scenario() -> TokenStream:
        requester = Requester(client=None)  # no cluster: placement is recorded, not performed

        async def place(requests: list[Request], *, admitted: bool = False) -> str:
            assert admitted, "a resubmission was admitted once: it must never be refused for load"
            placed.extend(requests)
            return "alive"

        requester._place = place
        stream = TokenStream("r")
        if delivered:
            stream.push(TokenBatch("r", 0, tuple(range(10, 10 + delivered)), "dead"))
        entry = requester._open["r"] = _Open(Request("r", [1, 2, 3], sampling), stream, "dead")
        await requester._resubmit(entry)
        return stream

    return asyncio.run(scenario()), placed


def test_a_request_goes_on_elsewhere_from_the_tokens_it_has():
    stream, placed = recover(SamplingParams(max_tokens=8, presence_penalty=0.5), delivered=3)
    (request,) = placed
    assert request.output_token_ids == [10, 11, 12] and request.sampling.presence_penalty == 0.5
    assert stream.sequence.owner is None  # the next tokens' sender becomes the owner


@pytest.mark.parametrize("structured", [{"json_object": True}, {"json_schema": '{"type": "object"}'}])
def test_a_structured_output_fails_rather_than_start_a_second_document(structured):
    stream, placed = recover(SamplingParams(max_tokens=8, **structured), delivered=3)
    assert not placed

    async def read() -> list[int]:
        tokens = await stream.next_tokens()  # those delivered before the death, then the failure
        with pytest.raises(RuntimeError, match="after 3 tokens.*grammar would start over"):
            await stream.next_tokens()
        return tokens

    assert asyncio.run(read()) == [10, 11, 12]


def test_a_structured_output_with_no_token_yet_simply_starts_elsewhere():
    _, placed = recover(SamplingParams(max_tokens=8, json_object=True), delivered=0)
    assert len(placed) == 1 and placed[0].output_token_ids == []


def test_a_request_that_could_not_go_on_is_no_longer_open():
    """Its stream failed (not placed in time): it is never resubmitted again later, when an
    instance appears, to run with nobody reading."""

    async def scenario() -> Requester:
        requester = Requester(client=None)

        async def place(requests: list[Request], *, admitted: bool = False) -> str:
            raise RuntimeError("not placed within 0.5 s")

        requester._place = place
        entry = requester._open["r"] = _Open(Request("r", [1, 2, 3], SamplingParams(max_tokens=8)), TokenStream("r"),
                                             "dead")
        await requester._resubmit(entry)
        with pytest.raises(RuntimeError, match="not placed"):
            await entry.stream.next_tokens()
        return requester

    assert "r" not in asyncio.run(scenario())._open


def test_a_request_aborted_while_it_is_being_resubmitted_is_aborted_where_it_went():
    aborted: list[tuple[str, str]] = []

    async def scenario() -> Requester:
        requester = Requester(client=None)

        async def place(requests: list[Request], *, admitted: bool = False) -> str:
            requester.abort_soon("r")  # its caller left meanwhile (aborted at its dead holder too, in vain)
            return "alive"

        async def abort_on(instance: str, request_id: str) -> None:
            aborted.append((instance, request_id))

        requester._place, requester._abort_on = place, abort_on
        entry = requester._open["r"] = _Open(Request("r", [1, 2, 3], SamplingParams(max_tokens=8)), TokenStream("r"),
                                             "dead")
        await requester._resubmit(entry)
        await asyncio.gather(*requester._undoing.values())
        return requester

    requester = asyncio.run(scenario())
    assert ("alive", "r") in aborted and "r" not in requester._open and requester.resubmissions == 0
