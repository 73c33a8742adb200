"""msgpack-native forms of what crosses Dask comms besides migration messages.

A requester hands a request to the instance the scheduler chose as one plain dict, so that the
worker rebuilds an identical `Request` from plain data:
    {"request_id": str, "prompt_token_ids": [int], "output_token_ids": [int],
     "sampling": {every field of SamplingParams; logit_bias as [[token id, bias], ...]},
     "scheduling_priority": int, "execution_priority": int, "arrival_time": float,
     "cache_salt": str | None}
`output_token_ids` is non-empty only for a resubmission (the instance that held the request died):
the new instance recomputes prompt + output and continues from there.

A migration event goes from the source's worker to the scheduler as
    {"kind": "started" | "committed" | "aborted", "migration_id", "request_id", "source",
     "destination", "time", "stages", "blocks", "bytes", "downtime", "downtime_source",
     "downtime_destination", "reason", "reused_blocks", "waiting"}
(`waiting`: a queued request handed over, no KV moved and no downtime.)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from llumdask.llumlet import MigrationEvent
from llumdask.request import Priority, Request, SamplingParams


def request_to_msg(request: Request) -> dict[str, Any]:
    sampling = dataclasses.asdict(request.sampling)
    sampling["stop_token_ids"] = list(sampling["stop_token_ids"])
    return {
        "request_id": request.request_id,
        "prompt_token_ids": list(request.prompt_token_ids),
        "output_token_ids": list(request.output_token_ids),
        "sampling": sampling,
        "scheduling_priority": int(request.scheduling_priority),
        "execution_priority": int(request.execution_priority),
        "arrival_time": request.arrival_time,
        "cache_salt": request.cache_salt,
    }


def request_from_msg(msg: Mapping[str, Any]) -> Request:
    """Rebuild a request; malformed fields raise ValueError/TypeError naming the field."""
    request = Request(
        request_id=msg["request_id"],
        prompt_token_ids=list(msg["prompt_token_ids"]),
        sampling=SamplingParams(**msg["sampling"]),
        scheduling_priority=Priority.parse(msg["scheduling_priority"]),
        execution_priority=Priority.parse(msg["execution_priority"]),
        arrival_time=float(msg["arrival_time"]),
        cache_salt=msg.get("cache_salt"),
    )
    request.output_token_ids = [int(t) for t in msg.get("output_token_ids", ())]
    if request.output_token_ids and request.remaining_tokens < 1:
        raise ValueError(f"request {request.request_id}: resubmitted with no tokens left to generate")
    return request


def event_to_msg(event: MigrationEvent) -> dict[str, Any]:
    msg = dataclasses.asdict(event)
    msg["kind"] = event.kind.value
    return msg
