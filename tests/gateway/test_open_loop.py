"""The benchmarks' open-loop load against the real gateway (over the scripted backend, served by
uvicorn on loopback): requests go out at their drawn arrival times however slowly the server
answers, and the same number draws the same arrivals."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import uvicorn
from gatewayfakes import MODEL

from llumdask.api.gateway import create_app
from llumdask.benchmarks.openai_load import Level, Workload, row
from llumdask.benchmarks.servers import free_port
from llumdask.config import GatewayConfig
from llumdask.sim.workload import arrivals_within


@contextmanager
def served(app) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_requests_arrive_on_schedule_however_slow_the_server(backend, tokenizer):
    backend.delay = 0.1  # a token every 0.1 s: each request takes 0.4 s, far longer than the gaps
    work = Workload(MODEL, tokenizer.vocab_size, prompt_tokens=8, output_tokens=4)
    level = Level(rate=20.0)
    seconds, settle = 1.0, 0.5
    with served(create_app(backend.open, tokenizer, GatewayConfig())) as url:
        runs = [asyncio.run(level.run(url, work, seconds=seconds, settle=settle, first_number=7)) for _ in range(2)]
    # The requests go out at the times their numbers drew (the same in both runs), not when an
    # earlier one was answered: answered one after another, the 0.4 s answers would put the median
    # request about 5 s behind (0.35 s more per request). The median's bound, a tenth of that, and
    # the last send's leave a loaded machine's event-loop stalls (up to 0.9 s seen in a full suite,
    # delaying every send due meanwhile) their room.
    drawn = arrivals_within(np.random.default_rng(7), level.rate, settle + seconds)
    for run in runs:
        assert not run.errors
        sent = sorted(s.start - (run.window[0] - settle) for s in run.samples)
        # About 30 arrivals in 1.5 s at 20/s; the server's 0.4 s answers do not space them out.
        assert 15 <= len(sent) <= 50
        assert max(sent) < settle + seconds + 1.0
        assert all(s.end - s.start >= 0.35 for s in run.samples)
        assert len(sent) == len(drawn)
        assert float(np.median([abs(a - b) for a, b in zip(sent, drawn)])) < 0.5
    summary = row(level.rate, runs)
    assert summary["successful"] > 0 and summary["decoding_mean"] > 1  # several decode at once
    assert str(level) == "20 requests/s" and str(Level(streams=3)) == "3 streams"


def test_a_level_is_streams_or_a_rate():
    with pytest.raises(ValueError):
        Level()
    with pytest.raises(ValueError):
        Level(streams=2, rate=3.0)
