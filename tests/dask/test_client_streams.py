"""A notebook stream left before its end aborts its request, however it is left: closed, at the end
of a `with` block, or dropped. The instance decodes at the latency profile's pace here, so a
request left running would hold it for half a minute."""

from __future__ import annotations

import asyncio
import gc

import pytest
from daskhelpers import assert_workers_clean, prompt_of
from distributed import Client

from llumdask.api.client import connect
from llumdask.api.gateway.tokenizer import load_tokenizer, model_location
from llumdask.clusters.local import local_cluster

pytestmark = pytest.mark.slow

# A thousand tokens at the profile's pace (about 30 ms a step) take half a minute; left, the
# request must be gone within seconds.
LONG, GONE_WITHIN = 1000, 8.0


def test_a_stream_left_before_its_end_aborts_its_request():
    vocab = load_tokenizer(model_location(None)).vocab_size  # the text stream's tokens are its tokenizer's
    overrides = {"sim-engine": {"total-blocks": 256, "real-time": True, "vocab-size": vocab}}
    with local_cluster(1, config_overrides=overrides) as cluster, connect(cluster) as llum:
        stream = llum.stream(prompt_of(1, 20), max_tokens=LONG)
        next(stream)
        stream.close()
        assert_workers_clean(llum.dask_client, GONE_WITHIN)
        with pytest.raises(RuntimeError, match="aborted"):
            next(stream)

        with llum.stream(prompt_of(2, 20), max_tokens=LONG) as stream:
            next(stream)
        assert_workers_clean(llum.dask_client, GONE_WITHIN)

        stream = llum.stream(prompt_of(3, 20), max_tokens=LONG)
        next(stream)
        del stream
        gc.collect()
        assert_workers_clean(llum.dask_client, GONE_WITHIN)

        with llum.stream("Hello there", max_tokens=LONG) as text:  # a text stream: its tokens' request
            next(text)
        assert_workers_clean(llum.dask_client, GONE_WITHIN)

        finished = llum.stream(prompt_of(4, 20), max_tokens=3)
        assert len(list(finished)) == 3
        finished.close()  # nothing to abort
        assert finished.finish_reason is not None and not llum.requester._open

        left = llum.stream(prompt_of(5, 20), max_tokens=LONG)
        next(left)
        llum.close()  # ends its requests
        with pytest.raises(RuntimeError, match="LlumdaskClient is closed"):
            llum.generate([1, 2, 3])
        left.close()  # nothing left to do
        llum.close()  # closing again is harmless


def test_an_async_stream_left_in_an_async_with_block_aborts_its_request():
    overrides = {"sim-engine": {"total-blocks": 256, "real-time": True}}
    with local_cluster(1, config_overrides=overrides) as cluster:
        async def scenario() -> None:
            async with Client(cluster.scheduler_address, asynchronous=True) as dask_client, \
                    connect(dask_client) as llum:
                with pytest.raises(TypeError, match="async with"):  # a plain `with` would never close it
                    with llum:
                        pass
                async with llum.stream(prompt_of(5, 20), max_tokens=LONG) as stream:
                    await anext(stream)
                # While the client is still there (closing it ends its requests anyway).
                await asyncio.to_thread(assert_workers_clean, sync_client, GONE_WITHIN)
                with pytest.raises(RuntimeError, match="aborted"):  # read again: no wait for ever
                    await anext(stream)

        with Client(cluster) as sync_client:
            asyncio.run(scenario())
