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
        await requester._resubmit(_Open(Request("r", [1, 2, 3], sampling), stream, "dead"))
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
