"""The one store interface (pc_rag.store.Store): every method exists with a default built on get/put/clear, the
tiers override what they do better, a user's duck-typed store is seen through it, and `where` answers without
touching anything. References: the blocks put in (bit for bit), and the tiers' counters and contents before the
call (unchanged, exactly)."""

from __future__ import annotations

import pytest

from pc_rag.errors import StoreError
from pc_rag.store import (
    DiskStore,
    ForeignStore,
    Held,
    MemoryStore,
    PendingBlock,
    RedisStore,
    Store,
    TieredStore,
    as_store,
    block_files,
    open_store,
)

from .conftest import PlainStore
from .test_store import assert_same, key_of, make_block


class Minimal(Store):
    """A store of one's own that defines only what a store must: get, put, clear."""

    name = "minimal"

    def __init__(self, persistent: bool = False):
        self.persistent = persistent
        self.blocks: dict = {}
        self.gets = 0

    def get(self, key):
        self.gets += 1
        return self.blocks.get(key)

    def put(self, key, block):
        self.blocks[key] = block

    def clear(self):
        self.blocks.clear()


def test_every_method_has_a_default_built_on_get_and_put():
    store = Minimal()
    store.put(key_of(1), make_block(1))
    keys = [key_of(1), key_of(2)]
    assert [b is not None for b in store.get_many(keys)] == [True, False]
    assert store.get_with_source(key_of(1))[1] == "minimal"
    assert [o for _, o in store.get_many_with_source(keys)] == ["minimal", None]
    assert [o for _, o in store.find_many_with_source(keys)] == ["minimal", None]  # nothing left unread
    assert store.get_many_with_source(keys, tiers="persistent") == [(None, None)] * 2  # not that kind of store
    assert store.locate(keys) == [True, False]
    taken = {}
    assert store.read_into(keys, [lambda b: taken.setdefault("b", b) is b, lambda b: True]) == [True, False]
    assert_same(taken["b"], make_block(1))
    assert store.read_pending([PendingBlock(key_of(1), "minimal", 0)], [lambda b: True]) == [True]
    assert_same(store.reread([key_of(1)])[0], make_block(1))
    store.promote([PendingBlock(key_of(1), "minimal", 0)])  # nothing above it: a no-op
    assert (store.can_prefetch, store.prefetch(keys), store.has_persistent, store.tier_stats()) == (False, 0, False, [])
    store.set_device("cpu")  # nothing to move: accepted, ignored
    gets = store.gets
    assert store.where(keys) == [None, None] and store.gets == gets  # cannot tell without reading: reads nothing


@pytest.mark.parametrize("persistent", [False, True])
def test_memory_only_and_persistent_only_puts_follow_the_store_kind(persistent):
    store = Minimal(persistent)
    store.put_volatile(key_of(1), make_block(1))
    store.put_persistent(key_of(2), make_block(2))
    assert set(store.blocks) == ({key_of(2)} if persistent else {key_of(1)})
    assert store.has_persistent is persistent


def test_a_store_must_define_get_put_clear():
    class Empty(Store):
        pass

    with pytest.raises(NotImplementedError, match="Empty must define get"):
        Empty().get(key_of(1))


def test_a_duck_typed_store_is_seen_through_the_interface():
    """tests/conftest.PlainStore has only get, put, clear and tier_stats: open_store wraps it, keeps its name, and
    the object's other attributes stay reachable."""
    plain = PlainStore("mine")
    store = open_store(plain)
    assert isinstance(store, ForeignStore) and store.inner is plain and store.name == "mine"
    assert store.blocks is plain.blocks  # an attribute of the user's object, read through
    store.put(key_of(1), make_block(1))
    assert [o for _, o in store.get_many_with_source([key_of(1), key_of(2)])] == ["mine", None]
    assert as_store(store) is store and as_store(MemoryStore()).name == "memory"


def test_a_duck_typed_get_many_is_used_and_checked():
    class Batch(PlainStore):
        def __init__(self, answer_count=None):
            super().__init__()
            self.answer_count = answer_count
            self.batches = []

        def get_many(self, keys):
            self.batches.append(list(keys))
            got = [self.blocks.get(k) for k in keys]
            return got if self.answer_count is None else got[: self.answer_count]

    good = Batch()
    good.put(key_of(1), make_block(1))
    store = as_store(good)
    assert [b is not None for b in store.get_many([key_of(1), key_of(2)])] == [True, False]
    assert good.batches == [[key_of(1), key_of(2)]]
    with pytest.raises(StoreError, match="returned 1 results for 2 keys"):
        as_store(Batch(answer_count=1)).get_many([key_of(1), key_of(2)])


def test_tiered_puts_go_to_the_tiers_of_their_kind(tmp_path):
    """The composition overrides every put: memory-only blocks never reach disk, persistent-only never memory."""
    memory, disk = MemoryStore(), DiskStore(tmp_path)
    store = TieredStore([memory, disk])
    store.put_volatile(key_of(1), make_block(1))
    store.put_persistent(key_of(2), make_block(2))
    store.put_volatile(key_of(3), make_block(3))
    assert memory.contains(key_of(1)) and memory.contains(key_of(3)) and not memory.contains(key_of(2))
    assert len(block_files(tmp_path)) == 1 and disk.contains(key_of(2)) and not disk.contains(key_of(1))


def test_where_reads_counts_and_promotes_nothing(tmp_path):
    fakeredis = pytest.importorskip("fakeredis")
    memory, disk = MemoryStore(), DiskStore(tmp_path)
    redis = RedisStore("redis://fake", client=fakeredis.FakeRedis())
    store = TieredStore([memory, disk, redis])
    memory.put(key_of(1), make_block(1))
    disk.put(key_of(2), make_block(2))
    redis.put(key_of(3), make_block(3))
    redis.put(key_of(2), make_block(2))  # held twice: the first tier from the top answers
    before = [vars(s).copy() for s in store.tier_stats()]
    keys = [key_of(i) for i in (1, 2, 3, 4)]
    assert store.where(keys) == [Held("memory", False), Held("disk", True), Held("redis", True), None]
    assert store.where(keys, tiers="persistent") == [None, Held("disk", True), Held("redis", True), None]
    assert store.where(keys, tiers="volatile") == [Held("memory", False), None, None, None]
    assert [vars(s) for s in store.tier_stats()] == before
    assert not memory.contains(key_of(2)) and not memory.contains(key_of(3))  # nothing promoted
    assert store.contains(key_of(3)) and not store.contains(key_of(4))
