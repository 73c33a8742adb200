import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llumdask.engine.block_manager import BlockManager, OutOfBlocks


def test_allocate_and_free_return_blocks_to_the_pool():
    bm = BlockManager(8, 4)
    table = bm.allocate("a", 3)
    assert len(table) == 3 and bm.free_blocks == 5 and bm.used_blocks == 3
    bm.allocate("a", 1)
    assert len(bm.table("a")) == 4
    bm.free("a")
    assert bm.free_blocks == 8 and bm.used_blocks == 0 and bm.table("a") == []
    bm.free("a")  # no-op for an owner without blocks
    bm.check_integrity()


def test_allocating_more_than_free_raises_and_changes_nothing():
    bm = BlockManager(4, 4)
    bm.allocate("a", 3)
    assert not bm.can_allocate(2)
    with pytest.raises(OutOfBlocks, match="'b'.*2 blocks requested, 1 free"):
        bm.allocate("b", 2)
    assert bm.free_blocks == 1 and bm.table("b") == []
    bm.check_integrity()


def test_reservations_add_up_per_stage_and_release_is_idempotent():
    bm = BlockManager(10, 4)
    assert bm.reserve("m", 3)
    assert bm.reserve("m", 2)
    assert len(bm.reservation("m")) == 5 and bm.reserved_blocks == 5 and bm.free_blocks == 5
    assert not bm.reserve("m", 6)
    assert bm.reserved_blocks == 5
    bm.release("m")
    bm.release("m")
    assert bm.free_blocks == 10 and bm.reserved_blocks == 0
    bm.check_integrity()


def test_adopt_turns_a_reservation_into_a_table_and_frees_the_spare():
    bm = BlockManager(10, 4)
    bm.reserve("m", 4)
    reserved = list(bm.reservation("m"))
    table = bm.adopt("m", "r", keep=3)
    assert table == reserved[:3]
    assert bm.used_blocks == 3 and bm.reserved_blocks == 0 and bm.free_blocks == 7
    bm.reserve("m2", 1)
    with pytest.raises(ValueError, match="already holds"):
        bm.adopt("m2", "r", keep=1)
    bm.release("m2")
    bm.check_integrity()


def test_integrity_check_catches_a_double_owned_block():
    bm = BlockManager(4, 4)
    bm.allocate("a", 1)
    bm._tables["b"] = list(bm._tables["a"])  # corrupt on purpose: a second holder nobody counted
    with pytest.raises(AssertionError, match="holder count"):
        bm.check_integrity()
    bm._refs[bm._tables["a"][0]] = 2
    bm.check_integrity()
    bm._free[-1] = bm._tables["a"][0]  # and now also free, in place of a free block lost
    with pytest.raises(AssertionError, match="owned twice"):
        bm.check_integrity()


def test_a_freed_cached_block_keeps_its_prefix_until_evicted_least_recently_freed_first():
    bm = BlockManager(6, 4)
    a = list(bm.allocate("a", 3))
    for block, h in zip(a, (11, 12, 13)):
        bm.register(block, h)
    b = list(bm.allocate("b", 2))
    bm.register(b[0], 21)
    bm.free("a")  # tail first: 13, 12, 11 in that order
    bm.free("b")
    assert bm.free_blocks == 6 and bm.cached_free_blocks == 4 and bm.cached_blocks == 4
    assert bm.cached_prefix([11, 12, 13, 14], 4) == a
    # The two plain free blocks go first (one never used, b's tail held no hash); then a's tail,
    # then a's middle.
    bm.allocate("c", 4)
    assert bm.cached_prefix([11, 12, 13], 3) == [a[0]] and bm.evictions == 2
    assert bm.cached_prefix([21], 1) == [b[0]]
    bm.check_integrity()


def test_sharing_counts_holders_and_a_shared_block_is_freed_with_its_last_holder():
    bm = BlockManager(6, 4)
    a = list(bm.allocate("a", 2))
    bm.register(a[0], 1)
    bm.register(a[1], 2)
    hit = bm.cached_prefix([1, 2], 2)
    assert bm.blocks_to_take(1, hit) == 1  # held blocks cost nothing more
    bm.share("b", hit)
    bm.allocate("b", 1)
    assert bm.used_blocks == 3 and bm.free_blocks == 3
    bm.free("a")
    assert bm.used_blocks == 3 and bm.cached_free_blocks == 0  # b still holds the prefix
    bm.free("b")
    assert bm.used_blocks == 0 and bm.cached_free_blocks == 2 and bm.free_blocks == 6
    hit = bm.cached_prefix([1, 2], 2)
    assert bm.blocks_to_take(1, hit) == 3  # free cached blocks leave the free pool when shared
    bm.share("c", hit)
    assert bm.free_blocks == 4 and bm.cached_free_blocks == 0
    bm.check_integrity()


def test_a_migration_reuses_cached_blocks_holds_them_and_hands_them_on():
    bm = BlockManager(8, 4)
    a = list(bm.allocate("a", 3))
    for block, h in zip(a, (1, 2, 3)):
        bm.register(block, h)
    bm.free("a")  # all three cached and free
    reused = bm.reserve_cached("m", [1, 2, 9])  # the third block is not the migrant's
    assert reused == a[:2] and bm.cached_free_blocks == 1 and bm.reserved_blocks == 2
    assert bm.reserve("m", 3) and bm.reserved_blocks == 5
    assert bm.reservation("m")[:2] == a[:2] and len(bm.reservation("m")) == 5
    bm.allocate("x", 3)  # the two plain free blocks, then the one cached block nobody holds
    assert bm.evictions == 1 and bm.free_blocks == 0
    assert bm.cached_prefix([1, 2], 2) == a[:2]  # held by the migration: not evicted
    bm.check_integrity()
    with pytest.raises(ValueError, match="reservation already"):
        bm.reserve_cached("m", [1])
    table = bm.adopt("m", "r", 4)
    assert table[:2] == a[:2] and bm.reserved_blocks == 0 and bm.table("r") == table and bm.free_blocks == 1
    bm.check_integrity()
    bm.free("r")
    assert bm.cached_prefix([1, 2], 2) == a[:2]  # cached again once freed
    bm.check_integrity()


def test_releasing_a_migration_gives_back_its_reused_blocks_still_cached():
    bm = BlockManager(4, 4)
    a = list(bm.allocate("a", 2))
    bm.register(a[0], 1)
    bm.share("b", [a[0]])  # a running request holds it too
    assert bm.reserve_cached("m", [1, 2]) == [a[0]]
    bm.release("m")
    bm.release("m")  # idempotent
    assert bm.reserved_blocks == 0 and bm.table("b") == [a[0]]
    bm.free("a")
    bm.free("b")
    assert bm.cached_free_blocks == 1 and bm.free_blocks == 4
    bm.check_integrity()


def test_register_and_share_refuse_what_is_not_theirs():
    bm = BlockManager(4, 4)
    with pytest.raises(ValueError, match="not held"):
        bm.register(0, 7)
    a = bm.allocate("a", 2)
    bm.register(a[0], 7)
    bm.register(a[1], 7)  # the hash is cached already: the first block keeps it
    assert bm.cached_prefix([7], 1) == [a[0]] and bm.cached_blocks == 1
    with pytest.raises(ValueError, match="no cached prefix"):
        bm.share("b", [a[1]])
    with pytest.raises(ValueError, match="already holds"):
        bm.share("a", [a[0]])
    bm.check_integrity()


@pytest.mark.parametrize("total, size", [(0, 4), (4, 0), (2.5, 4)])
def test_bad_sizes_are_rejected(total, size):
    with pytest.raises(ValueError):
        BlockManager(total, size)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / free / reserve / release / adopt sequences against a counting model."""

    TOTAL = 12

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(self.TOTAL, 4)
        self.tables: dict[str, int] = {}
        self.reservations: dict[str, int] = {}

    owners = st.sampled_from(["a", "b", "c", "d"])
    migrations = st.sampled_from(["m1", "m2", "m3"])

    @rule(owner=owners, n=st.integers(0, 6))
    def allocate(self, owner, n):
        if self.bm.can_allocate(n):
            self.bm.allocate(owner, n)
            self.tables[owner] = self.tables.get(owner, 0) + n
        else:
            with pytest.raises(OutOfBlocks):
                self.bm.allocate(owner, n)

    @rule(owner=owners)
    def free(self, owner):
        self.bm.free(owner)
        self.tables.pop(owner, None)

    @precondition(lambda self: any(self.tables.values()))
    @rule(data=st.data(), h=st.integers(0, 5))
    def register(self, data, h):
        owner = data.draw(st.sampled_from(sorted(o for o, n in self.tables.items() if n)))
        block = data.draw(st.sampled_from(self.bm.table(owner)))
        self.bm.register(block, h)

    @rule(owner=owners, hashes=st.lists(st.integers(0, 5), max_size=4))
    def share(self, owner, hashes):
        if owner in self.tables:
            return
        hit = self.bm.cached_prefix(hashes, len(hashes))
        if len(set(hit)) < len(hit):
            return
        taken = self.bm.blocks_to_take(0, hit)
        free_before = self.bm.free_blocks
        self.bm.share(owner, hit)
        assert self.bm.free_blocks == free_before - taken
        if hit:
            self.tables[owner] = len(hit)

    @rule(mid=migrations, n=st.integers(0, 6))
    def reserve(self, mid, n):
        fits = n <= self.free_in_model()
        assert self.bm.reserve(mid, n) is fits
        if fits:
            self.reservations[mid] = self.reservations.get(mid, 0) + n

    @rule(mid=migrations)
    def release(self, mid):
        self.bm.release(mid)
        self.reservations.pop(mid, None)

    @precondition(lambda self: self.reservations)
    @rule(data=st.data(), owner=st.sampled_from(["x", "y"]))
    def adopt(self, data, owner):
        if owner in self.tables:
            self.bm.free(owner)
            del self.tables[owner]
        mid = data.draw(st.sampled_from(sorted(self.reservations)))
        keep = data.draw(st.integers(0, self.reservations[mid] + 1))
        table = self.bm.adopt(mid, owner, keep)
        kept = min(keep, self.reservations.pop(mid))
        assert len(table) == kept
        if kept:
            self.tables[owner] = kept

    def free_in_model(self):
        return self.TOTAL - self.bm.used_blocks - sum(self.reservations.values())

    @invariant()
    def never_leaks_or_double_owns(self):
        self.bm.check_integrity()
        assert self.bm.free_blocks == self.free_in_model()
        held = {b for owner in self.tables for b in self.bm.table(owner)}
        assert self.bm.used_blocks == len(held) <= sum(self.tables.values())
        assert self.bm.reserved_blocks == sum(self.reservations.values())
        for owner, n in self.tables.items():
            assert len(self.bm.table(owner)) == n


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
