"""A slice of the fault matrix (benchmarks/faults.py) in the default run: the source killed once
it has handed a request over. The rest of the matrix is the benchmark's (README, figures)."""

from __future__ import annotations

import pytest

from llumdask.benchmarks.faults import matrix

pytestmark = pytest.mark.slow


def test_a_source_killed_after_handing_the_request_over_loses_nothing(tmp_path):
    """Its requester resubmits the request, and the scheduler may send it to the instance already
    running it: that instance keeps it (it once refused it as a duplicate, and the client got an
    error). Every token exactly once, nothing left on the survivors."""
    rows = matrix(("last_stage", "commit"), ("kill_source",), runs=1, scratch=tmp_path)
    for row in rows:
        assert row["fired"] == row["exact"] == 1 and row["failed"] == 0 and row["leaked_blocks"] == 0, row


def test_a_preempted_migrant_recomputes_and_a_stage_after_its_timeout_is_ignored(tmp_path):
    """Two faults at the first copy stage, on one cluster. The source engine preempts the request
    (for lack of a block, by its own rule) while its first stage is acknowledged: the migration is
    aborted for that reason and the request recomputes on its source. The destination receives the
    first stage only after the source gave up waiting for its acknowledgement: the migration was
    aborted at the timeout and the late stage changes nothing. Either way the request streams every
    token exactly once and no block is left over, nothing reserved at the destination."""
    preempted, delayed = matrix(("stage",), ("preempt", "delay"), runs=1, scratch=tmp_path)
    for row in (preempted, delayed):
        assert row["fired"] == row["exact"] == 1 and row["failed"] == 0 and row["leaked_blocks"] == 0, row
    assert preempted["outcomes"] == {"aborted: request preempted": 1}, preempted
    assert delayed["outcomes"] == {"aborted: timeout waiting in await-stage-ack": 1}, delayed


def test_a_destination_killed_as_a_later_copy_stage_reaches_it_loses_nothing(tmp_path):
    """A copy stage after the first and before the last (the block the request filled while the
    first was copied) reaches a destination that dies with it: the source hears of the loss, the
    request streams on there exactly, and the survivors hold no block."""
    (row,) = matrix(("later_stage",), ("kill_destination",), runs=1, scratch=tmp_path)
    assert row["fired"] == row["exact"] == 1 and row["failed"] == 0 and row["leaked_blocks"] == 0, row
