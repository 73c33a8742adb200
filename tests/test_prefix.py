"""Prefix identity (chained block hashes), the engines' change log and the scheduler's index."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llumdask.engine.block_manager import BlockManager
from llumdask.prefix import (
    ROOT_HASH,
    PrefixEvents,
    PrefixIndex,
    anchor_stride,
    anchors,
    block_hashes,
    dispatch_keys,
    is_anchor,
    salt_key,
    salted,
)


def test_block_hashes_chain_so_equal_hashes_mean_equal_prefixes():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # the partial third block has none
    assert block_hashes(list(range(33)) + [7] * 7, 16) == a  # differs only past the full blocks
    assert block_hashes([99] + list(range(1, 40)), 16)[1] != a[1]  # block 1 differs through its parent
    assert block_hashes(list(range(16, 40)), 16, parent=a[0]) == a[1:]  # resumable from a parent
    assert block_hashes(list(range(16)), 16, parent=ROOT_HASH) == a[:1]
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)


def test_a_cache_salt_gives_every_block_a_key_of_its_own_the_same_in_every_process():
    hashes = block_hashes(list(range(64)), 16)
    assert salted(hashes, None) is hashes  # unsalted: the hashes are the keys
    a, b = salted(hashes, "tenant-a"), salted(hashes, "tenant-b")
    assert len(set(hashes) | set(a) | set(b)) == 3 * len(hashes)
    assert salted(hashes, "tenant-a") == a
    # Keys chain as hashes do: a prompt's keys begin with those of its prefix, under the same salt only.
    longer, shorter = dispatch_keys(list(range(512)), 16, "tenant-a"), dispatch_keys(list(range(256)), 16, "tenant-a")
    assert len(longer) == 4 and longer[:2] == shorter
    assert dispatch_keys(list(range(256)), 16, None) == anchors(block_hashes(list(range(256)), 16), 16)  # as before salts
    assert not set(shorter) & set(dispatch_keys(list(range(256)), 16, "tenant-b"))
    # A requester and an engine in other processes (Python's str hash differs between them) agree.
    other = subprocess.run([sys.executable, "-c", "from llumdask.prefix import salt_key; print(salt_key('tenant-a'))"],
                           capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "random"})
    assert int(other.stdout) == salt_key("tenant-a")


@pytest.mark.parametrize("block_size, expected", [
    (16, [7, 15]),  # one block in 8: the last of each 128 tokens
    (32, [3, 7, 11, 15]),
    (128, list(range(19))),  # a block is a stride
    (256, list(range(19))),  # blocks longer than a stride: every block still
])
def test_anchors_are_the_last_block_of_each_128_tokens(block_size, expected):
    hashes = list(range(100, 119))
    assert [i for i in range(len(hashes)) if is_anchor(i, block_size)] == expected
    assert anchors(hashes, block_size) == tuple(hashes[i] for i in expected)
    assert anchor_stride(block_size) == (expected[1] - expected[0])


def test_only_reported_blocks_enter_the_change_log():
    bm = BlockManager(4, 4)
    a = bm.allocate("a", 2)
    bm.register(a[0], 10, reported=False)
    bm.register(a[1], 11)
    assert bm.drain_changes() == PrefixEvents(stored=(11,)) and bm.cached_prefix([10, 11], 2) == list(a)
    bm.free("a")
    bm.allocate("b", 4)
    assert bm.drain_changes() == PrefixEvents(removed=(11,))


def test_the_change_log_reports_the_last_state_of_each_hash_and_resets_past_its_bound():
    bm = BlockManager(4, 4)
    a = bm.allocate("a", 2)
    bm.register(a[0], 10)
    bm.register(a[1], 11)
    assert bm.drain_changes() == PrefixEvents(stored=(10, 11))
    assert not bm.drain_changes()
    bm.free("a")
    bm.allocate("b", 4)  # evicts both
    assert bm.drain_changes() == PrefixEvents(removed=(11, 10))
    bm.free("b")
    for round_ in range(5):  # 2 x 4 blocks of changes overflow the log: the next drain resends the cache
        table = bm.allocate(f"c{round_}", 2)
        bm.register(table[0], 100 + 2 * round_)
        bm.register(table[1], 101 + 2 * round_)
        bm.free(f"c{round_}")
    events = bm.drain_changes()
    assert events.reset and set(events.stored) == {h for h in range(100, 110) if bm.cached_prefix([h], 1)}


def test_the_index_finds_each_instances_longest_prefix_and_forgets_what_is_evicted():
    index = PrefixIndex()
    index.apply("a", PrefixEvents(stored=(1, 2, 3)))
    index.apply("b", PrefixEvents(stored=(1, 2)))
    index.apply("c", PrefixEvents(stored=(2, 3)))  # no first block: matches nothing
    assert index.matches((1, 2, 3, 4)) == {"a": 3, "b": 2}
    assert index.matches((5, 1)) == {} and index.matches(()) == {}
    index.apply("a", PrefixEvents(removed=(2, 9)))
    assert index.matches((1, 2, 3)) == {"a": 1, "b": 2}
    index.apply("b", PrefixEvents(stored=(7,), reset=True))
    assert index.matches((1, 2)) == {"a": 1} and index.held_anchors("b") == 1
    index.drop("a")
    assert index.matches((1,)) == {} and index.held_anchors("a") == 0 and len(index) == 3


def test_the_index_counts_its_bytes_as_it_grows_and_gives_them_back_when_an_instance_goes():
    index = PrefixIndex()
    empty = index.memory_bytes()
    index.add("a")
    one_instance = index.memory_bytes()
    assert one_instance > empty
    # 64-bit hashes beyond Python's small-int cache: every new hash is one more object.
    hashes = tuple((1 << 63) + k for k in range(1000))
    index.apply("a", PrefixEvents(stored=hashes))
    full = index.memory_bytes()
    assert full - one_instance > 1000 * sys.getsizeof(hashes[0])
    # A second instance holding the same hash objects adds its set and its bits, not the hashes again.
    index.apply("b", PrefixEvents(stored=hashes))
    assert index.memory_bytes() - full < 1000 * sys.getsizeof(hashes[0])
    index.drop("a")
    index.drop("b")
    assert index.memory_bytes() < full


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(st.tuples(st.sampled_from("abc"), st.lists(st.integers(0, 5), max_size=4),
                              st.lists(st.integers(0, 5), max_size=4), st.booleans()), max_size=12),
    query=st.lists(st.integers(0, 5), max_size=5),
)
def test_the_index_agrees_with_a_set_per_instance(events, query):
    index, model = PrefixIndex(), {}
    for instance, stored, removed, reset in events:
        index.apply(instance, PrefixEvents(tuple(stored), tuple(removed), reset))
        held = set() if reset else model.get(instance, set())
        model[instance] = (held | set(stored)) - set(removed)
    expected = {}
    for instance, held in model.items():
        length = 0
        while length < len(query) and query[length] in held:
            length += 1
        if length:
            expected[instance] = length
    assert index.matches(tuple(query)) == expected
    last_held = max((k + 1 for k, h in enumerate(query) if any(h in held for held in model.values())), default=0)
    assert index.longest_bound(tuple(query)) == last_held >= max(expected.values(), default=0)
    assert len(index) == sum(len(h) for h in model.values())
