"""KV store tiers. Reference for every round trip: the tensors put in, compared bit for bit (torch.equal,
zero tolerance: a cache must return exactly what was computed). Byte bounds are compared against the sum of
what the tier actually holds (block nbytes in memory, file sizes on disk)."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from pc_rag.blocks import KVBlock
from pc_rag.errors import StoreError
from pc_rag.store import (
    DiskStore,
    MemoryStore,
    RedisStore,
    StoreUsageError,
    TieredStore,
    default_cache_dir,
    open_store,
    parse_bytes,
)
from pc_rag.store.codec import encode_block
from pc_rag.store.disk import BLOCKS_DIR, block_file_name

REPO = Path(__file__).resolve().parents[1]


def make_block(seed: int, tokens: int = 6, dtype: torch.dtype = torch.float32, start: int = 1) -> KVBlock:
    g = torch.Generator().manual_seed(seed)
    shape = (2, 2, tokens, 4)  # [layers, kv_heads, tokens, head_dim]
    return KVBlock(
        torch.randn(shape, generator=g).to(dtype),
        torch.randn(shape, generator=g).to(dtype),
        tuple(range(seed, seed + tokens)),
        start,
        {"seed": str(seed)},
    )


def key_of(i: int) -> str:
    return f"chunk-{i:040x}"


def assert_same(got: KVBlock | None, want: KVBlock) -> None:
    assert got is not None
    assert got.keys.dtype == want.keys.dtype and got.values.dtype == want.values.dtype
    assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert got.token_ids == want.token_ids and got.start == want.start and got.meta == want.meta


def block_path(root: Path, key: str) -> Path:
    """Where a DiskStore opened on `root` keeps the block of `key`."""
    return root / BLOCKS_DIR / block_file_name(key)


def block_names(root: Path) -> set[str]:
    return {p.name for p in (root / BLOCKS_DIR).glob("kv-*.safetensors")}


def dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / BLOCKS_DIR).glob("kv-*.safetensors"))


@pytest.fixture
def fake_redis():
    fakeredis = pytest.importorskip("fakeredis")
    return RedisStore("redis://fake", client=fakeredis.FakeRedis())


# --- round trips -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tier", ["memory", "disk", "redis"])
def test_round_trip_is_bit_identical(tier, dtype, tmp_path, fake_redis):
    store = {"memory": MemoryStore(), "disk": DiskStore(tmp_path), "redis": fake_redis}[tier]
    block = make_block(3, dtype=dtype, start=17)
    assert store.get(key_of(3)) is None
    store.put(key_of(3), block)
    assert_same(store.get(key_of(3)), block)
    s = store.tier_stats()[0]
    assert (s.hits, s.misses) == (1, 1)


def test_keys_and_values_as_views_of_one_tensor(tmp_path):
    # The engine may slice keys and values out of one stacked tensor; safetensors refuses shared storage.
    kv = torch.randn(2, 2, 2, 5, 4)
    block = KVBlock(kv[0], kv[1], tuple(range(5)), 0)
    strided = KVBlock(kv[0].transpose(2, 3).transpose(2, 3)[:, :, 1:], kv[1][:, :, 1:], tuple(range(4)), 1)
    store = DiskStore(tmp_path)
    store.put(key_of(1), block)
    store.put(key_of(2), strided)
    assert_same(store.get(key_of(1)), block)
    assert_same(store.get(key_of(2)), strided)


# --- memory tier ----------------------------------------------------------------------------------------


def test_memory_lru_by_bytes_matches_reference():
    max_bytes = 4000
    store = MemoryStore(max_bytes=max_bytes, policy="lru")
    reference: OrderedDict[str, int] = OrderedDict()  # plain LRU model: key -> nbytes
    for i in range(40):
        block = make_block(i, tokens=1 + (i * 7) % 13)
        store.put(key_of(i), block)
        if block.nbytes <= max_bytes:
            reference[key_of(i)] = block.nbytes
            while sum(reference.values()) > max_bytes:
                reference.popitem(last=False)
        if i % 3 == 0:  # touch an older entry, as a hit would
            old = key_of(i // 2)
            if store.get(old) is not None:
                reference.move_to_end(old)
        s = store.tier_stats()[0]
        assert s.bytes_held == sum(reference.values()) <= max_bytes
        assert s.entries == len(reference)
    assert [k for k in reference if store.get(k) is None] == []


def test_memory_ttl_expiry():
    now = [100.0]
    store = MemoryStore(ttl_s=10, clock=lambda: now[0])
    block = make_block(1)
    store.put(key_of(1), block)
    now[0] += 9.9
    assert store.get(key_of(1)) is block
    now[0] += 0.2
    assert store.get(key_of(1)) is None
    s = store.tier_stats()[0]
    assert (s.hits, s.misses, s.evictions, s.entries, s.bytes_held) == (1, 1, 1, 0, 0)


# --- disk tier ------------------------------------------------------------------------------------------


def test_disk_bound_never_exceeded_under_stream(tmp_path):
    max_bytes = 6000
    store = DiskStore(tmp_path, max_bytes=max_bytes)
    for i in range(30):
        store.put(key_of(i), make_block(i, tokens=1 + i % 9))
        s = store.tier_stats()[0]
        assert s.bytes_held == dir_bytes(tmp_path) <= max_bytes
        assert s.entries == len(block_names(tmp_path))
    assert s.evictions > 0
    assert_same(store.get(key_of(29)), make_block(29, tokens=1 + 29 % 9))  # newest survives


def test_disk_index_and_lru_order_survive_restart(tmp_path):
    store = DiskStore(tmp_path)
    for i in range(3):
        store.put(key_of(i), make_block(i))
        time.sleep(0.02)  # distinct mtimes even on filesystems with coarse timestamps
    store.get(key_of(0))  # now 1 is least recently used
    size = dir_bytes(tmp_path) // 3
    reopened = DiskStore(tmp_path, max_bytes=3 * size)
    s = reopened.tier_stats()[0]
    assert (s.entries, s.bytes_held) == (3, 3 * size)
    reopened.put(key_of(3), make_block(3))
    assert not block_path(tmp_path, key_of(1)).exists()
    assert set(os.listdir(tmp_path / BLOCKS_DIR)) == {block_file_name(key_of(i)) for i in (0, 2, 3)}


def _flip_last_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[-1] ^= 0x01  # inside the last tensor's data: only the checksum can notice
    p.write_bytes(bytes(data))


def _truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _garbage(p: Path) -> None:
    p.write_bytes(b"not a safetensors file")


def _empty(p: Path) -> None:
    p.write_bytes(b"")


@pytest.mark.parametrize("damage", [_flip_last_byte, _truncate, _garbage, _empty])
def test_disk_corrupt_file_is_counted_removed_and_missed(tmp_path, damage, caplog):
    store = DiskStore(tmp_path)
    store.put(key_of(1), make_block(1))
    path = block_path(tmp_path, key_of(1))
    damage(path)
    assert store.get(key_of(1)) is None
    s = store.tier_stats()[0]
    assert (s.corrupt, s.misses, s.hits, s.entries, s.bytes_held) == (1, 1, 0, 0, 0)
    assert not path.exists()
    store.put(key_of(1), make_block(1))  # and the entry can be written again
    assert_same(store.get(key_of(1)), make_block(1))


def test_file_copied_under_another_key_is_a_miss(tmp_path):
    store = DiskStore(tmp_path)
    store.put(key_of(1), make_block(1))
    shutil.copy(block_path(tmp_path, key_of(1)), block_path(tmp_path, key_of(2)))
    assert store.get(key_of(2)) is None
    assert store.tier_stats()[0].corrupt == 1
    assert not block_path(tmp_path, key_of(2)).exists()
    assert_same(store.get(key_of(1)), make_block(1))


BAD_KEYS = ["../escape", "a/b", "/abs", "", ".hidden", "x" * 201, "chunk-\x00", "c d", 7]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_invalid_keys_are_rejected_without_touching_the_filesystem(tmp_path, key):
    root = tmp_path / "cache"
    store = open_store(f"disk:{root}")
    with pytest.raises(StoreUsageError):
        store.put(key, make_block(1))
    with pytest.raises(StoreUsageError):
        DiskStore(root).get(key)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["cache", f"cache/{BLOCKS_DIR}"]


def test_second_process_sees_the_same_disk_cache(tmp_path):
    # Reference: blocks rebuilt from the same seeds in each process.
    DiskStore(tmp_path).put(key_of(1), make_block(1, dtype=torch.bfloat16))
    child = f"""
import sys, torch
sys.path.insert(0, {str(REPO / "tests")!r})
from test_store import make_block, key_of
from pc_rag.store import DiskStore
store = DiskStore({str(tmp_path)!r})
got = store.get(key_of(1))
want = make_block(1, dtype=torch.bfloat16)
assert got is not None and torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
store.put(key_of(2), make_block(2))
print("child ok")
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "child ok" in out.stdout, out.stderr
    assert_same(DiskStore(tmp_path).get(key_of(2)), make_block(2))


# --- failing tiers -------------------------------------------------------------------------------------


def _only_disk(path: Path) -> TieredStore:
    return TieredStore([DiskStore(path)], retry_after_s=0.05)


def test_directory_that_is_a_file_degrades_to_miss(tmp_path, caplog):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    store = TieredStore([MemoryStore(), DiskStore(blocker / "cache")], retry_after_s=60)
    with caplog.at_level(logging.WARNING, logger="pc_rag.store"):
        store.put(key_of(1), make_block(1))
        assert store.get_with_source(key_of(1))[1] == "memory"
        assert store.get(key_of(2)) is None
    disk = store.tier_stats()[1]
    assert disk.errors == 1
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory_degrades_to_miss(tmp_path):
    store = _only_disk(tmp_path)
    tmp_path.chmod(0o555)
    try:
        store.put(key_of(1), make_block(1))
        assert store.get(key_of(1)) is None
        assert store.tier_stats()[0].errors >= 1
    finally:
        tmp_path.chmod(0o755)


def test_disk_full_warns_once_and_recovers(tmp_path, monkeypatch, caplog):
    store = _only_disk(tmp_path)
    disk = store.tiers[0]
    real_write = DiskStore._write

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk, "_write", full)
    with caplog.at_level(logging.WARNING, logger="pc_rag.store"):
        for i in range(3):
            store.put(key_of(i), make_block(i))
            time.sleep(0.06)  # past the backoff: every put retries the tier and fails again
        assert store.get(key_of(0)) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()
    assert disk.tier_stats()[0].errors == 3
    assert os.listdir(tmp_path / BLOCKS_DIR) == []  # no temp files left behind
    monkeypatch.setattr(disk, "_write", real_write)
    time.sleep(0.06)
    store.put(key_of(5), make_block(5))
    assert store.get_with_source(key_of(5))[1] == "disk"


def test_failed_tier_is_skipped_during_backoff(tmp_path):
    calls = []

    class Broken(MemoryStore):
        name = "broken"

        def get(self, key):
            calls.append(key)
            raise StoreError("down")

    store = TieredStore([Broken(), MemoryStore()], retry_after_s=60)
    for i in range(5):
        assert store.get(key_of(i)) is None
    assert len(calls) == 1


# --- tiered ------------------------------------------------------------------------------------------


def test_read_through_promotion_and_sources(tmp_path, fake_redis):
    memory, disk = MemoryStore(), DiskStore(tmp_path)
    store = TieredStore([memory, disk, fake_redis])
    block = make_block(4)
    fake_redis.put(key_of(4), block)  # as if another machine had computed it
    got, source = store.get_with_source(key_of(4))
    assert source == "redis"
    assert_same(got, block)
    assert_same(memory.get(key_of(4)), block)
    assert_same(disk.get(key_of(4)), block)
    assert store.get_with_source(key_of(4))[1] == "memory"
    memory.clear()
    assert store.get_with_source(key_of(4))[1] == "disk"
    assert store.get_with_source(key_of(5)) == (None, None)
    assert [s.name for s in store.tier_stats()] == ["memory", "disk", "redis"]


def test_write_through_reaches_every_tier(tmp_path, fake_redis):
    tiers = [MemoryStore(), DiskStore(tmp_path), fake_redis]
    TieredStore(tiers).put(key_of(7), make_block(7))
    for tier in tiers:
        assert_same(tier.get(key_of(7)), make_block(7))


def test_bad_block_raises_instead_of_marking_tiers_down(tmp_path):
    store = open_store(f"disk:{tmp_path}")
    bad = KVBlock(torch.zeros(2, 2, 3, 4), torch.zeros(2, 2, 3, 4), (1, 2), 0)
    with pytest.raises(StoreUsageError, match="3 tokens of KV but 2 token ids"):
        store.put(key_of(1), bad)


def test_read_racing_an_eviction_leaves_the_index_true(tmp_path, monkeypatch):
    # The race CI once caught (about 1 run in 8 of the test below): an eviction picks key 0 as its victim and,
    # before it removes the file, another thread reads key 0 and lists it again; then the file goes and the
    # index lists a file that is gone. The hook runs that read from another thread at exactly that moment.
    size = len(encode_block(key_of(0), make_block(0)))
    store = DiskStore(tmp_path, max_bytes=2 * size)
    store.put(key_of(0), make_block(0))
    store.put(key_of(1), make_block(1))
    unlink = DiskStore._unlink
    got = []

    def unlink_while_reading(self, paths):
        if any(p.name == block_file_name(key_of(0)) for p in paths):
            reader = threading.Thread(target=lambda: got.append(store.get(key_of(0))))
            reader.start()
            reader.join(timeout=0.5)  # the fixed store makes the reader wait for the lock: it ends after us
        unlink(self, paths)

    monkeypatch.setattr(DiskStore, "_unlink", unlink_while_reading)
    store.put(key_of(2), make_block(2))  # evicts key 0
    monkeypatch.setattr(DiskStore, "_unlink", unlink)
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(got) == 1  # served the whole block it read, or a miss if the file was already gone
    if got[0] is not None:
        assert_same(got[0], make_block(0))
    stats = store.tier_stats()[0]
    assert stats.bytes_held == dir_bytes(tmp_path) <= 2 * size
    assert block_names(tmp_path) == {block_file_name(k) for k in store._index}


def test_threads_share_one_store(tmp_path):
    store = TieredStore([MemoryStore(max_bytes=3000), DiskStore(tmp_path, max_bytes=8000)])
    errors = []

    def worker(t: int) -> None:
        try:
            for n in range(30):
                i = (t * 7 + n) % 12  # overlapping keys across threads
                got = store.get(key_of(i))
                if got is None:
                    store.put(key_of(i), make_block(i))
                else:
                    assert_same(got, make_block(i))
        except Exception as e:  # surfaced below: an exception in a thread does not fail the test by itself
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert errors == []
    memory, disk = store.tier_stats()
    assert memory.bytes_held <= 3000 and memory.errors == 0
    assert disk.bytes_held == dir_bytes(tmp_path) <= 8000 and disk.errors == 0 and disk.corrupt == 0
    assert not list((tmp_path / BLOCKS_DIR).glob("*.tmp"))


# --- Redis without a server -------------------------------------------------------------------------------


def test_redis_corrupt_and_foreign_blobs_are_misses(fake_redis):
    fake_redis.put(key_of(1), make_block(1))
    client = fake_redis._client
    client.set("pc_rag:" + key_of(2), client.get("pc_rag:" + key_of(1)))  # foreign: stored under key 1
    client.set("pc_rag:" + key_of(3), b"\x00" * 40)
    assert fake_redis.get(key_of(2)) is None and fake_redis.get(key_of(3)) is None
    assert fake_redis.tier_stats()[0].corrupt == 2
    assert client.get("pc_rag:" + key_of(2)) is None and client.get("pc_rag:" + key_of(3)) is None
    assert_same(fake_redis.get(key_of(1)), make_block(1))


def test_redis_blob_has_ttl(fake_redis):
    fake_redis.put(key_of(1), make_block(1))
    assert 0 < fake_redis._client.ttl("pc_rag:" + key_of(1)) <= 7 * 24 * 3600


def test_missing_redis_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(StoreError, match="pip install"):
        RedisStore("redis://127.0.0.1:1/0")


def test_unreachable_redis_is_a_fast_miss():
    pytest.importorskip("redis")
    store = open_store("redis://127.0.0.1:1/0")  # port 1: connection refused
    t0 = time.monotonic()
    store.put(key_of(1), make_block(1))
    assert store.get(key_of(1)) is None
    assert time.monotonic() - t0 < 2.0
    assert store.tier_stats()[0].errors == 1  # put failed; the get was skipped during the backoff


# --- open_store -----------------------------------------------------------------------------------


def test_spec_strings(tmp_path):
    store = open_store(["memory:2MiB", f"disk:{tmp_path}?max_bytes=1GB", "redis://127.0.0.1:1/2?ttl_s=60"])
    memory, disk, redis = store.tiers
    assert isinstance(memory, MemoryStore) and memory.max_bytes == 2 << 20
    assert isinstance(disk, DiskStore) and disk.path == tmp_path and disk.max_bytes == 10**9
    assert isinstance(redis, RedisStore) and redis.ttl_s == 60 and redis.url == "redis://127.0.0.1:1/2"
    assert open_store("memory?max_bytes=1000&ttl_s=5").tiers[0].ttl_s == 5
    same = MemoryStore()
    assert open_store(same) is same


@pytest.mark.parametrize("spec", ["nvme:/x", "memory:lots", "disk:/x?colour=red", "memory?ttl_s=soon", 3.5])
def test_bad_specs_name_the_problem(spec):
    with pytest.raises(StoreUsageError, match="spec|size|store"):
        open_store(spec)


def test_default_location(tmp_path, monkeypatch):
    monkeypatch.delenv("PC_RAG_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "pc_rag"
    monkeypatch.setenv("PC_RAG_CACHE_DIR", str(tmp_path / "explicit"))
    store = open_store()
    assert [t.name for t in store.tiers] == ["memory", "disk"]
    assert store.tiers[1].path == tmp_path / "explicit" and (tmp_path / "explicit").is_dir()


def test_parse_bytes():
    assert [parse_bytes(s) for s in ["512", "4KiB", "1.5GB", "2 MiB"]] == [512, 4096, 1_500_000_000, 2 << 20]


def test_get_with_source_for_any_store(tmp_path):
    disk = DiskStore(tmp_path)
    disk.put(key_of(1), make_block(1))
    assert disk.get_with_source(key_of(1))[1] == "disk"
    assert disk.get_with_source(key_of(2)) == (None, None)
    assert TieredStore([MemoryStore(), disk]).get_with_source(key_of(1))[1] == "disk"


def test_cache_directory_removed_while_running_is_recreated(tmp_path):
    store = DiskStore(tmp_path / "cache")
    shutil.rmtree(tmp_path / "cache")
    store.put(key_of(1), make_block(1))
    assert_same(store.get(key_of(1)), make_block(1))


def test_store_does_not_import_model_code():
    # Storage sees tensors and keys only: no module of pc_rag/store imports transformers or model code.
    import ast

    forbidden = {"transformers", "pc_rag.model", "pc_rag.engine", "pc_rag.assemble"}
    for path in (REPO / "pc_rag" / "store").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                names = [base if node.level == 0 else f"pc_rag.{base}" if node.level == 2 else f"pc_rag.store.{base}"]
            for name in names:
                assert not any(name == f or name.startswith(f + ".") for f in forbidden), (path.name, name)


def _block_of(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 1, tokens, 4, generator=g)
    return KVBlock(k, k.clone(), tuple(range(tokens)), 0)


def test_gdsf_keeps_the_block_used_often_over_the_one_used_last():
    """Reference: the order worked out by hand. Three blocks of the same size fit; "often" is used three times,
    then two new blocks arrive: LRU drops "often" (least recently used), GDSF drops a block used once."""
    size = _block_of(8).nbytes
    kept = {}
    for policy in ("lru", "gdsf"):
        store = MemoryStore(max_bytes=3 * size, policy=policy)
        store.put("chunk-often", _block_of(8))
        for _ in range(3):
            assert store.get("chunk-often") is not None
        store.put("chunk-a", _block_of(8, 1))
        store.put("chunk-b", _block_of(8, 2))
        store.put("chunk-c", _block_of(8, 3))  # one must leave
        kept[policy] = {k for k in ("chunk-often", "chunk-a", "chunk-b", "chunk-c") if store.contains(k)}
        assert store.tier_stats()[0].evictions == 1 and store.tier_stats()[0].bytes_held == 3 * size
    assert kept["lru"] == {"chunk-a", "chunk-b", "chunk-c"}
    assert "chunk-often" in kept["gdsf"] and len(kept["gdsf"]) == 3


def test_gdsf_ages_out_blocks_used_long_ago():
    """L rises to each evicted priority: a block used twice long ago leaves once the newer ones have been used
    as often since. Reference: after enough rounds of new blocks used twice, the old block is gone."""
    size = _block_of(4).nbytes
    store = MemoryStore(max_bytes=2 * size, policy="gdsf")
    store.put("chunk-old", _block_of(4))
    store.get("chunk-old")
    for i in range(6):
        store.put(f"chunk-{i}", _block_of(4, i))
        store.get(f"chunk-{i}")
        store.get(f"chunk-{i}")
    assert not store.contains("chunk-old")
    with pytest.raises(StoreUsageError):
        MemoryStore(policy="lfu")
    assert open_store(["memory:1MiB?policy=gdsf"]).tiers[0].policy == "gdsf"
