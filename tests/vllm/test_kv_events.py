"""vLLM's KV-cache events translated into the scheduler's prefix hashes (engine/vllm/kv_events.py).

The tracker is fed vLLM's own event classes, built as the block pool builds them; the engine
tests at the end read the events of a running vLLM engine.
"""

from __future__ import annotations

import pytest

from llumdask.prefix import PrefixEvents, anchor_stride, anchors, block_hashes, dispatch_keys

pytestmark = [pytest.mark.vllm]

BS = 4  # block size of the unit tests
STRIDE = anchor_stride(BS)  # blocks per anchor at that size


@pytest.fixture
def events(vllm_ready):
    from vllm.distributed import kv_events

    return kv_events


def stored(kv_events, theirs, tokens, parent=None, block_size=BS, **extra):
    fields = {"lora_id": None, "medium": "GPU", "lora_name": None, **extra}
    return kv_events.BlockStored(block_hashes=list(theirs), parent_block_hash=parent, token_ids=list(tokens),
                                 block_size=block_size, **fields)


def removed(kv_events, theirs):
    return kv_events.BlockRemoved(block_hashes=list(theirs), medium="GPU")


def tracker(pool_blocks: int = 1000):
    from llumdask.engine.vllm.kv_events import PrefixTracker

    return PrefixTracker(BS, pool_blocks)


TOKENS = list(range(100, 100 + 2 * STRIDE * BS + 3))  # two anchors' worth and a partial block
OURS = block_hashes(TOKENS, BS)


def test_a_stored_run_reports_the_requesters_anchor_hashes(events):
    t = tracker()
    theirs = [f"v{i}" for i in range(len(OURS))]
    t.apply([stored(events, theirs, TOKENS[: len(OURS) * BS])])
    assert t.drain() == PrefixEvents(stored=anchors(OURS, BS))
    assert not t.drain() and len(t) == len(OURS)


def test_a_run_continuing_a_cached_parent_chains_from_its_hash_and_position(events):
    t = tracker()
    split = STRIDE - 3  # the first anchor falls in the second run
    theirs = [f"v{i}" for i in range(len(OURS))]
    t.apply([stored(events, theirs[:split], TOKENS[: split * BS])])
    assert not t.drain()
    t.apply([stored(events, theirs[split:], TOKENS[split * BS : len(OURS) * BS], parent=theirs[split - 1])])
    assert t.drain() == PrefixEvents(stored=anchors(OURS, BS))


def test_removal_reports_an_anchor_once_its_last_copy_goes(events):
    t = tracker()
    theirs = [f"v{i}" for i in range(STRIDE)]
    run = TOKENS[: STRIDE * BS]
    t.apply([stored(events, theirs, run), stored(events, theirs, run)])  # two requests computed it at once
    assert t.drain() == PrefixEvents(stored=(OURS[STRIDE - 1],))
    t.apply([removed(events, [theirs[-1]])])
    assert not t.drain()
    t.apply([removed(events, [theirs[-1]]), removed(events, ["never-stored"])])
    assert t.drain() == PrefixEvents(removed=(OURS[STRIDE - 1],))


def published(*per_block):
    """A stored event's extra keys as vLLM publishes them (`to_event_extra_keys`), from each
    block's tagged keys as `generate_block_hash_extra_keys` makes them (None: none)."""
    from vllm.v1.core.kv_cache_utils import to_event_extra_keys

    return to_event_extra_keys(list(per_block))


def test_blocks_whose_identity_is_more_than_tokens_and_a_salt_are_left_out_with_their_children(events):
    t = tracker()
    n = STRIDE
    run = TOKENS[: n * BS]
    t.apply([
        stored(events, [f"mm{i}" for i in range(n)], run,
               extra_keys=published((("mm", "image-1", 0),), *[None] * (n - 1))),
        stored(events, ["lora"], run[:BS], lora_name="adapter", extra_keys=published((("lora", "adapter"),))),
        stored(events, ["partial"], run[:2], block_size=2),
        stored(events, ["orphan"], run[:BS], parent="mm0"),  # its parent was left out
        stored(events, ["embeds"], run[:BS],
               extra_keys=published((("cache_salt", "tenant-a"), ("prompt_embeds", b"digest")))),
    ])
    assert not t.drain() and len(t) == 0


def test_a_salt_past_the_first_block_is_not_a_salt(events):
    """vLLM salts a sequence's first block only: extra keys on a later block are something else."""
    t = tracker()
    t.apply([stored(events, ["v0"], TOKENS[:BS])])
    t.apply([stored(events, ["v1"], TOKENS[BS : 2 * BS], parent="v0", extra_keys=published((("cache_salt", "t"),)))])
    assert len(t) == 1


def test_a_salted_run_reports_the_requesters_salted_keys_and_its_children_keep_the_salt(events):
    """vLLM keys a salted sequence's first block with the salt (published untagged in the event's
    extra keys); the blocks after it carry none of their own but inherit it through their parent."""
    t = tracker()
    split = STRIDE - 3
    theirs = [f"s{i}" for i in range(len(OURS))]
    t.apply([stored(events, theirs[:split], TOKENS[: split * BS],
                    extra_keys=published((("cache_salt", "tenant-a"),), *[None] * (split - 1)))])
    t.apply([stored(events, theirs[split:], TOKENS[split * BS : len(OURS) * BS], parent=theirs[split - 1])])
    keys = dispatch_keys(TOKENS, BS, "tenant-a")
    assert t.drain() == PrefixEvents(stored=keys) and not set(keys) & set(anchors(OURS, BS))
    t.apply([removed(events, [theirs[STRIDE - 1]])])
    assert t.drain() == PrefixEvents(removed=keys[:1])


def test_a_cleared_cache_resets_the_index_entry(events):
    t = tracker()
    t.apply([stored(events, [f"v{i}" for i in range(STRIDE)], TOKENS[: STRIDE * BS])])
    t.apply([events.AllBlocksCleared()])
    assert t.drain() == PrefixEvents(reset=True) and len(t) == 0


def test_a_change_log_past_twice_the_pool_sends_the_whole_cache(events):
    t = tracker(pool_blocks=1)
    for round_ in range(3):
        tokens = [round_ * 1000 + i for i in range(STRIDE * BS)]
        t.apply([stored(events, [f"r{round_}b{i}" for i in range(STRIDE)], tokens)])
    t.apply([removed(events, [f"r0b{STRIDE - 1}"])])
    cached = {block_hashes([r * 1000 + i for i in range(STRIDE * BS)], BS)[-1] for r in (1, 2)}
    events_out = t.drain()
    assert events_out.reset and set(events_out.stored) == cached


# ---------------------------------------------------------------------- a running engine
def run(engine, request_id: str, prompt: list[int]) -> None:
    from llumdask.request import Request, SamplingParams

    engine.add_request(Request(request_id, prompt, SamplingParams(max_tokens=2, ignore_eos=True)))
    while engine.has_work():
        engine.step()
    engine.check_integrity()


def prompt(seed: int, length: int = 9 * 128 + 5) -> list[int]:
    return [10 + (seed * 131 + 7 * i) % 450 for i in range(length)]


@pytest.mark.slow
def test_a_running_engine_reports_what_the_requester_hashes_and_its_evictions(tight_engine):
    first, second = prompt(1), prompt(2)
    tight_engine.prefix_events()
    run(tight_engine, "first", first)
    anchor = anchors(block_hashes(first, 128), 128)
    assert anchor and tight_engine.prefix_events() == PrefixEvents(stored=anchor)
    run(tight_engine, "again", first)
    assert not tight_engine.prefix_events()  # a hit caches nothing new
    run(tight_engine, "second", second)  # its ten blocks take the first's cached ones
    events = tight_engine.prefix_events()  # evicted in vLLM's order: the tail of a prefix first
    assert events.stored == anchors(block_hashes(second, 128), 128) and sorted(events.removed) == sorted(anchor)


@pytest.mark.slow
def test_events_off_reports_none(blind_engine):
    run(blind_engine, "plain", prompt(3))
    assert blind_engine.prefix_events() is None
