"""The Redis tier over a real 3-master Redis Cluster (and Valkey, when installed) that the tests start on free
loopback ports (`pc_rag.testing.LocalRedisCluster`; skipped without the binaries). References: blocks rebuilt from
the same seed, compared bit for bit; an engine's logits against the same engine recomputing the chunk (memory store
only); time bounds are generous multiples of the 0.5 s socket timeout so that a hang fails instead of stalling."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch

import pc_rag
from pc_rag.store import MemoryStore, RedisClusterStore, StoreUsageError, TieredStore, open_store
from pc_rag.store.redis_cluster import key_slot
from pc_rag.testing import LocalRedisCluster

from .test_engine_store import rag
from .test_store import assert_same, key_of, make_block

redis = pytest.importorskip("redis", reason="the redis package is not installed (pip install redis)")

SERVERS = [
    pytest.param("redis-server", marks=pytest.mark.skipif(
        shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
        reason="redis-server binary not found (apt-get install redis-server)")),
    pytest.param("valkey-server", marks=pytest.mark.skipif(
        shutil.which("valkey-server") is None or shutil.which("valkey-cli") is None,
        reason="valkey-server binary not found (apt-get install valkey-server)")),
]


@pytest.fixture(params=SERVERS)
def cluster(request, tmp_path):
    c = LocalRedisCluster(tmp_path / "cluster", masters=3, server=request.param)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def node_of(store: RedisClusterStore, key: str) -> str:
    return store._slot_map()[key_slot(store.prefix + key)]


# ---- the spec, without a server -------------------------------------------------------------------------------
def test_spec_takes_the_options_of_redis():
    store = open_store("redis+cluster://127.0.0.1:7000,127.0.0.1:7001/0?ttl_s=60&prefix=x:&compress=int8")
    tier = store.tiers[0]
    assert isinstance(tier, RedisClusterStore)
    assert tier.seeds == ["127.0.0.1:7000", "127.0.0.1:7001"] and tier.prefix == "x:"
    assert tier._node_options["ttl_s"] == 60 and tier._node_options["compress"] == "int8"
    with pytest.raises(StoreUsageError, match="database 0 only"):
        open_store("redis+cluster://127.0.0.1:7000/3")
    with pytest.raises(StoreUsageError, match="host:port"):
        open_store("redis+cluster://127.0.0.1")
    with pytest.raises(StoreUsageError):
        open_store("redis+cluster://127.0.0.1:7000?compress=zip")
    auth = open_store("redis+cluster://me:s%40cret@127.0.0.1:7000").tiers[0]
    assert "s%40cret" in auth._auth and "cret" not in auth.url  # messages never carry the password


def test_no_node_answering_is_a_miss_and_pauses_the_tier():
    store = TieredStore([MemoryStore(), RedisClusterStore([f"127.0.0.1:{pc_rag.testing._free_port()}"])],
                        retry_after_s=30)
    t0 = time.monotonic()
    assert store.get_many_with_source([key_of(1), key_of(2)]) == [(None, None)] * 2
    store.put(key_of(3), make_block(3))
    assert store.get(key_of(3)) is not None  # memory still serves
    assert time.monotonic() - t0 < 3.0
    assert not store._usable(1, "reads")


def test_a_batch_asks_the_nodes_at_the_same_time():
    class SlowNode:  # a node answering each batch 0.3 s late
        def get_many(self, keys, count=True):
            time.sleep(0.3)
            return [make_block(int(k[-2:], 16)) for k in keys]

    store = RedisClusterStore(["127.0.0.1:1"])
    addresses = ["10.0.0.1:6379", "10.0.0.2:6379", "10.0.0.3:6379"]
    store._slots = [addresses[slot * 3 // 16384] for slot in range(16384)]
    store._nodes = {a: SlowNode() for a in addresses}
    keys = [key_of(i) for i in range(30)]
    assert len({node_of(store, k) for k in keys}) == 3
    t0 = time.monotonic()
    got = store.get_many(keys)
    assert time.monotonic() - t0 < 0.6  # one node's delay, not three
    for i, block in enumerate(got):
        assert_same(block, make_block(i))


# ---- against a real cluster -------------------------------------------------------------------------------------
def test_blocks_spread_over_the_masters_and_a_second_client_reads_them(cluster):
    writer, reader = RedisClusterStore(cluster.spec[len("redis+cluster://"):].split(",")), open_store(cluster.spec)
    keys = [key_of(i) for i in range(24)]
    for i, key in enumerate(keys):
        writer.put(key, make_block(i))
    assert len({node_of(writer, k) for k in keys}) == 3  # every master holds some
    got = reader.get_many_with_source(keys + [key_of(99)])
    for i, (block, source) in enumerate(got[:-1]):
        assert source == "redis"
        assert_same(block, make_block(i))
    assert got[-1] == (None, None)
    assert reader.where([keys[0], key_of(99)])[0].tier == "redis"
    stats = reader.tier_stats()[-1]
    assert (stats.hits, stats.misses, stats.errors) == (24, 1, 0)
    used, entries = writer.server_usage()
    assert entries == 24 and used > 0
    writer.clear()
    assert all(b is None for b in writer.get_many(keys))


def test_a_node_down_is_misses_for_its_slots_and_the_rest_is_served(cluster):
    store = TieredStore([RedisClusterStore([f"127.0.0.1:{cluster.ports[0]}"], retry_after_s=0.3)])
    tier = store.tiers[0]
    keys = [key_of(i) for i in range(30)]
    for i, key in enumerate(keys):
        store.put(key, make_block(i))
    down = f"127.0.0.1:{cluster.ports[2]}"
    on_down = [node_of(tier, k) == down for k in keys]
    assert 0 < sum(on_down) < len(keys)

    cluster.stop_node(2)
    t0 = time.monotonic()
    for _ in range(3):  # the first batch pays the dead node's connect once; the next ones skip it
        got = store.get_many_with_source(keys)
    assert time.monotonic() - t0 < 3.0
    for i, ((block, source), lost) in enumerate(zip(got, on_down, strict=True)):
        if lost:
            assert (block, source) == (None, None)
        else:
            assert source == "redis"
            assert_same(block, make_block(i))
    assert store._usable(0, "reads")  # the tier as a whole is not paused: the other masters serve
    store.put(key_of(40), make_block(40))  # writes to live masters land, to the dead one are dropped
    assert tier.tier_stats()[0].errors >= 1

    cluster.start_node(2)  # it keeps its slots (nodes.conf) but lost its data (no persistence)
    cluster.wait_ok()
    time.sleep(0.35)  # past the node's pause
    store.put(keys[on_down.index(True)], make_block(on_down.index(True)))
    assert_same(store.get(keys[on_down.index(True)]), make_block(on_down.index(True)))


def test_a_moved_slot_is_a_miss_then_found_after_the_map_is_refreshed(cluster):
    store = RedisClusterStore([f"127.0.0.1:{cluster.ports[0]}"], retry_after_s=0.0)
    key = key_of(5)
    store.put(key, make_block(5))
    src = node_of(store, key)
    dst = next(f"127.0.0.1:{p}" for p in cluster.ports if f"127.0.0.1:{p}" != src)
    slot = key_slot(store.prefix + key)
    a, b = (redis.Redis(host="127.0.0.1", port=int(x.rsplit(":", 1)[1])) for x in (src, dst))
    dst_id = b.execute_command("CLUSTER MYID")
    dst_id = dst_id.decode() if isinstance(dst_id, bytes) else dst_id
    b.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", a.execute_command("CLUSTER MYID"))
    a.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
    a.execute_command("MIGRATE", "127.0.0.1", int(dst.rsplit(":", 1)[1]), "", 0, 5000, "KEYS", store.prefix + key)
    for node in (a, b):
        node.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
    assert store.get(key) is None  # the old owner answers MOVED: a miss, and the map is asked again
    assert node_of(store, key) == dst
    assert_same(store.get(key), make_block(5))


def test_a_second_engine_reads_chunks_the_first_encoded_and_loses_no_answer_when_a_node_dies(cluster, tiny_path,
                                                                                               docs):
    first = pc_rag.Engine.from_pretrained(tiny_path, store=["memory", cluster.spec])
    first.warm(docs, progress=False)
    second = pc_rag.Engine(first.model, first.tokenizer, store=["memory", cluster.spec])
    recompute = pc_rag.Engine(first.model, first.tokenizer, store="memory")

    # The second engine's chunks come from the cluster: its logits equal those of an engine that encodes the chunks
    # itself, to 1e-5 (the blocks are stored bit-exact in float32: in practice equal).
    prompt = rag(docs, (2, 0), "Which one?")
    got = second.generate(prompt, max_new_tokens=1)
    assert [s.origin for s in got.sources if s.kind == "chunk"] == ["redis", "redis"]
    second.store.tiers[0].clear()
    diff = (second.next_token_logits(prompt) - recompute.next_token_logits(prompt)).abs().max()
    assert diff <= 1e-5

    # Load from 4 threads; a master dies midway. Every request answers, with the tokens of the recomputing engine.
    orders = [(0, 1), (1, 2), (2, 3), (3, 0), (1, 3), (2, 1)]
    prompts = [rag(docs, order, f"Q{i}?") for i, order in enumerate(orders * 3)]
    reference = [recompute.generate(p, max_new_tokens=4).token_ids for p in prompts]
    results: list = [None] * len(prompts)
    errors: list = []
    done = threading.Semaphore(0)

    def worker(ids: list[int]) -> None:
        for i in ids:
            try:
                second.store.tiers[0].clear()  # memory forgets: each request goes to the cluster
                results[i] = second.generate(prompts[i], max_new_tokens=4)
            except Exception as e:  # the test's assertion reports it
                errors.append(e)
            done.release()

    threads = [threading.Thread(target=worker, args=(list(range(t, len(prompts), 4)),)) for t in range(4)]
    for t in threads:
        t.start()
    for _ in range(4):
        assert done.acquire(timeout=120)
    cluster.stop_node(1)
    for t in threads:
        t.join(timeout=300)
    assert not errors and all(r is not None for r in results)
    assert [r.token_ids for r in results] == reference
    origins = [s.origin for r in results for s in r.sources if s.kind == "chunk"]
    assert "redis" in origins
    assert second.store.tier_stats()[-1].errors >= 1  # the dead master was asked, failed, and was paused


def test_logits_with_int8_blocks_from_the_cluster_stay_near_a_recompute(cluster, tiny_path, docs):
    spec = cluster.spec + "?compress=int8"
    first = pc_rag.Engine.from_pretrained(tiny_path, store=[spec])
    first.warm(docs[:2], progress=False)
    second = pc_rag.Engine(first.model, first.tokenizer, store=[spec])
    prompt = rag(docs, (1, 0), "Which?")
    ref = pc_rag.Engine(first.model, first.tokenizer, store="memory").next_token_logits(prompt)
    got = second.next_token_logits(prompt)
    # int8 keys and values (per-channel / per-token scales): the tiny model's logits move by a few 1e-3 at most.
    assert torch.isfinite(got).all() and (got - ref).abs().max() < 0.05
