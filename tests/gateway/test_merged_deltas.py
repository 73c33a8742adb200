"""The choices of one completion are read together: what their engine step made at once comes out
in one list (a stream writes it in one go), and a choice's failure still lets out what the others
made before it."""

from __future__ import annotations

import asyncio

import pytest

from llumdask.api.gateway.generation import Delta, merged_deltas


class Choice:
    """A stand-in for a Generation: one delta per step, all choices stepping on the same events."""

    def __init__(self, steps: list[asyncio.Event], fail_at: int | None = None) -> None:
        self._steps = steps
        self._fail_at = fail_at

    async def deltas(self):
        for k, step in enumerate(self._steps):
            await step.wait()
            if k == self._fail_at:
                raise RuntimeError("the instance was lost")
            yield Delta(f"t{k}", k, k + 1)


async def _read(choices: list[Choice], steps: list[asyncio.Event], lists: list) -> list:
    """Step the choices one event at a time; every list `merged_deltas` yields goes into `lists`
    (filled as it goes, so that what came before an error is still there)."""

    async def consume() -> None:
        async for ready in merged_deltas(choices):
            lists.append(ready)

    reader = asyncio.ensure_future(consume())
    for step in steps:
        await asyncio.sleep(0.01)
        step.set()
    await reader
    return lists


def test_the_choices_of_one_step_come_in_one_list():
    async def run():
        steps = [asyncio.Event() for _ in range(3)]
        return await _read([Choice(steps) for _ in range(4)], steps, [])

    lists = asyncio.run(run())
    # Three steps, each with the four choices' deltas; the last step's list also ends them.
    assert len(lists) == 3
    for k, ready in enumerate(lists[:2]):
        assert sorted(ready) == [(i, Delta(f"t{k}", k, k + 1)) for i in range(4)]
    assert sorted(ready for ready in lists[2] if ready[1] is not None) == [(i, Delta("t2", 2, 3)) for i in range(4)]
    assert sorted(i for i, delta in lists[2] if delta is None) == [0, 1, 2, 3]


def test_a_choice_that_fails_raises_after_what_was_ready_before_it():
    async def run(lists):
        steps = [asyncio.Event() for _ in range(2)]
        await _read([Choice(steps), Choice(steps, fail_at=1)], steps, lists)

    lists: list = []
    with pytest.raises(RuntimeError, match="lost"):
        asyncio.run(run(lists))
    assert sorted(lists[0]) == [(0, Delta("t0", 0, 1)), (1, Delta("t0", 0, 1))]
    # The failing choice's step also finished the other choice's delta, which goes out first.
    assert (0, Delta("t1", 1, 2)) in [item for ready in lists[1:] for item in ready]


def test_one_choice_is_read_directly():
    async def run():
        steps = [asyncio.Event() for _ in range(2)]
        return await _read([Choice(steps)], steps, [])

    assert asyncio.run(run()) == [[(0, Delta("t0", 0, 1))], [(0, Delta("t1", 1, 2))], [(0, None)]]
