"""Faults the store must survive, each as a user met it (the "Hardening" issue): foreign files in the cache
folder, entries that are not block files, a full or read-only disk, a failing stat() at start, wrong Redis
types; and the calls the engine uses to look up a request's blocks at once, keep blocks out of persistent
tiers and place loaded blocks on its device.

References: files outside the store's own names compared byte for byte before and after; blocks compared bit
for bit with those put (assert_same); hits and corrupt entries counted by the tiers themselves. Time bounds
are generous (1 s where the fixed store takes milliseconds) and every call that could hang runs in a thread
with a timeout, so a regression fails instead of stalling the suite."""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from pc_rag import cli
from pc_rag.store import DiskStore, MemoryStore, RedisStore, TieredStore

from .conftest import PlainStore
from .test_store import assert_same, key_of, make_block


def call_bounded(fn, timeout_s: float, on_hang=None):
    """(fn's result, seconds it took), running fn in a daemon thread; fails the test if it is still running
    after timeout_s, calling on_hang first so that the thread can be released."""
    out = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as e:  # re-raised in the test's thread
            out["error"] = e

    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    elapsed = time.monotonic() - t0
    if thread.is_alive():
        if on_hang is not None:
            on_hang()
        pytest.fail(f"still running after {timeout_s} s: the call hangs")
    if "error" in out:
        raise out["error"]
    return out["result"], elapsed


def snapshot(root: Path, skip: Path | None = None) -> dict[str, bytes]:
    """Every regular file under root (except under `skip`) -> its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and (skip is None or skip not in p.parents)
    }


# --- 1: the disk tier touches only its own files -----------------------------------------------------------


def checkpoint_folder(root: Path) -> None:
    """What a typo in --cache-dir points at: an HF checkpoint with adapter, plus a file named like a block of the
    old layout (`<key>.safetensors`) and files named with the new prefix outside the store's subfolder."""
    root.mkdir(parents=True, exist_ok=True)
    weights = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64)}
    (root / "model.safetensors").write_bytes(save(weights, metadata={"format": "pt"}))
    (root / "adapter_model.safetensors").write_bytes(save({"lora_A": torch.ones(8, 64)}))
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / f"{key_of(77)}.safetensors").write_bytes(b"x" * 3000)
    (root / f"kv-{key_of(78)}.safetensors").write_bytes(b"y" * 3000)
    (root / f".kv-{key_of(79)}.1.2.tmp").write_bytes(b"z" * 10)
    os.utime(root / f".kv-{key_of(79)}.1.2.tmp", (0, 0))  # as old as a dead writer's temp file


def test_disk_tier_never_touches_files_it_did_not_name(tmp_path):
    root = tmp_path / "checkpoint"
    checkpoint_folder(root)
    # Foreign names inside the store's own subfolder are left alone too.
    sub = root / "pc_rag-kv-v1"
    sub.mkdir()
    (sub / "model.safetensors").write_bytes(b"w" * 5000)
    (sub / "kv-notes.txt").write_text("mine")
    (sub / f"kv-{key_of(80)}.safetensors.bak").write_bytes(b"b" * 4000)
    before = snapshot(root)

    store = DiskStore(root, max_bytes=2000)  # far below what the folder holds: the start evicts to the bound
    assert snapshot(root) == before
    store = DiskStore(root, max_bytes=3 * 1000)
    for i in range(12):  # each block file is ~0.9 KB: evictions happen
        store.put(key_of(i), make_block(i))
    assert store.tier_stats()[0].evictions > 0
    after = snapshot(root)
    assert {k: v for k, v in after.items() if k in before} == before
    assert_same(store.get(key_of(11)), make_block(11))
    store.clear()
    assert snapshot(root) == before
    assert store.get(key_of(11)) is None


def test_cli_stats_and_clear_see_only_block_files(tmp_path, capsys):
    root = tmp_path / "checkpoint"
    checkpoint_folder(root)
    store = DiskStore(root)
    for i in range(3):
        store.put(key_of(i), make_block(i))
    ours = [store.file_for(key_of(i)) for i in range(3)]
    before = snapshot(root, skip=ours[0].parent)

    assert cli.main(["stats", "--json", "--cache-dir", str(root)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["kv_entries"] == 3 and stats["kv_bytes"] == sum(p.stat().st_size for p in ours)
    assert cli.main(["clear", "--cache-dir", str(root)]) == 0
    assert "removed 3 KV blocks" in capsys.readouterr().out
    assert not any(p.exists() for p in ours)
    assert snapshot(root, skip=ours[0].parent) == before


def test_clear_on_a_folder_without_blocks_creates_nothing(tmp_path, capsys):
    root = tmp_path / "checkpoint"
    checkpoint_folder(root)
    names = sorted(os.listdir(root))
    assert cli.main(["clear", "--cache-dir", str(root)]) == 0
    assert "removed 0 KV blocks" in capsys.readouterr().out
    assert sorted(os.listdir(root)) == names


# --- 4: entries that are not block files ------------------------------------------------------------------


def _tier_stays_up(store: TieredStore, disk: DiskStore) -> None:
    """A block that is on disk is still served from disk right after the bad entry (no 60 s pause)."""
    got, source = store.get_with_source(key_of(2))
    assert source == "disk"
    assert_same(got, make_block(2))
    assert disk.tier_stats()[0].errors == 0


def _disk_only(root: Path) -> tuple[TieredStore, DiskStore]:
    disk = DiskStore(root)
    disk.put(key_of(2), make_block(2))
    return TieredStore([disk], retry_after_s=60), disk


def test_fifo_under_a_block_name_is_a_fast_corrupt_miss(tmp_path):
    store, disk = _disk_only(tmp_path)
    fifo = disk.file_for(key_of(1))
    os.mkfifo(fifo)

    def release():  # an open() blocked on the FIFO returns once a writer opens it
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass

    result, elapsed = call_bounded(lambda: store.get_with_source(key_of(1)), 5.0, on_hang=release)
    assert result == (None, None) and elapsed < 1.0
    assert disk.tier_stats()[0].corrupt == 1
    assert not os.path.lexists(fifo)
    _tier_stays_up(store, disk)


@pytest.mark.parametrize("holds_a_file", [False, True])
def test_directory_under_a_block_name_is_a_corrupt_miss_not_an_outage(tmp_path, holds_a_file):
    store, disk = _disk_only(tmp_path)
    folder = disk.file_for(key_of(1))
    folder.mkdir()
    if holds_a_file:
        (folder / "someone_else.txt").write_text("keep me")
    result, elapsed = call_bounded(lambda: store.get_with_source(key_of(1)), 5.0)
    assert result == (None, None) and elapsed < 1.0
    assert disk.tier_stats()[0].corrupt == 1
    _tier_stays_up(store, disk)
    store.put(key_of(1), make_block(1))  # neither raises nor pauses the tier
    if holds_a_file:  # what the folder holds is not ours to remove: kept, and the block is not stored
        assert (folder / "someone_else.txt").read_text() == "keep me"
        assert store.get(key_of(1)) is None
    else:  # an empty folder is removed and the block stored in its place
        assert_same(store.get(key_of(1)), make_block(1))
    _tier_stays_up(store, disk)


def _sparse_zeros(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


def _block_with_sparse_tail(path: Path, size: int) -> None:
    # A plausible header (a real block for this key) with a file 8 GiB long: only the sizes can tell.
    path.write_bytes(path.with_name("real").read_bytes())
    with open(path, "r+b") as f:
        f.truncate(size)


@pytest.mark.parametrize("make", [_sparse_zeros, _block_with_sparse_tail])
def test_huge_sparse_file_is_refused_without_reading_it(tmp_path, make):
    store, disk = _disk_only(tmp_path)
    path = disk.file_for(key_of(1))
    disk.put(key_of(1), make_block(1))
    os.replace(path, path.with_name("real"))
    size = 8 << 30
    make(path, size)
    if os.stat(path).st_blocks * 512 > (1 << 20):
        pytest.skip("this filesystem does not make sparse files")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    result, elapsed = call_bounded(lambda: store.get_with_source(key_of(1)), 20.0)
    assert result == (None, None) and elapsed < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < (256 << 10)  # < 256 MiB more
    assert disk.tier_stats()[0].corrupt == 1
    assert not path.exists()
    _tier_stays_up(store, disk)


def test_a_huge_sparse_file_is_not_indexed_at_its_size(tmp_path, caplog):
    """A 64 GiB sparse file under a block's name in the folder a store starts on. Before: indexed at 64 GiB, over
    the 1 MiB bound, so every valid block was evicted (and deleted). Now: a corrupt entry, removed, never counted;
    the valid blocks stay and are served."""
    writer = DiskStore(tmp_path, max_bytes=1 << 20)
    for i in range(4):
        writer.put(key_of(i), make_block(i))
    held = writer.tier_stats()[0].bytes_held
    sparse = writer.file_for(key_of(99))
    _sparse_zeros(sparse, 64 << 30)
    if os.stat(sparse).st_blocks * 512 > (1 << 20):
        pytest.skip("this filesystem does not make sparse files")
    now = time.time_ns()
    os.utime(sparse, ns=(now + 10**9, now + 10**9))  # the newest entry: an LRU bound evicts all others first
    with caplog.at_level(logging.WARNING, logger="pc_rag.store"):
        store = DiskStore(tmp_path, max_bytes=1 << 20)
    s = store.tier_stats()[0]
    assert (s.bytes_held, s.entries, s.evictions, s.corrupt) == (held, 4, 0, 1)
    assert not sparse.exists() and "sparse" in caplog.text
    for i in range(4):
        assert_same(store.get(key_of(i)), make_block(i))


def test_symlink_under_a_block_name_is_not_followed(tmp_path):
    store, disk = _disk_only(tmp_path / "cache")
    elsewhere = DiskStore(tmp_path / "elsewhere")
    elsewhere.put(key_of(1), make_block(1))  # a valid block for this very key, outside the cache folder
    target = elsewhere.file_for(key_of(1))
    data = target.read_bytes()
    disk.file_for(key_of(1)).symlink_to(target)
    assert store.get_with_source(key_of(1)) == (None, None)
    assert disk.tier_stats()[0].corrupt == 1
    assert not os.path.lexists(disk.file_for(key_of(1)))  # the link is removed, never its target
    assert target.read_bytes() == data
    _tier_stays_up(store, disk)


# --- 6 (without a server): a value of another Redis type -------------------------------------------------


def test_wrong_redis_type_is_a_corrupt_miss_not_an_outage():
    fakeredis = pytest.importorskip("fakeredis")
    redis = RedisStore("redis://fake", client=fakeredis.FakeRedis())
    store = TieredStore([MemoryStore(), redis], retry_after_s=60)
    client = redis._client
    client.hset("pc_rag:" + key_of(1), "field", "value")
    redis.put(key_of(2), make_block(2))
    assert store.get_with_source(key_of(1)) == (None, None)
    got, source = store.get_with_source(key_of(2))
    assert source == "redis"
    assert_same(got, make_block(2))
    s = redis.tier_stats()[0]
    assert (s.corrupt, s.errors, s.hits) == (1, 0, 1)
    assert not client.exists("pc_rag:" + key_of(1))
    store.put(key_of(1), make_block(1))
    assert_same(redis.get(key_of(1)), make_block(1))


# --- 7: a failing write does not stop reads ---------------------------------------------------------------


def _requests_on_a_disk_that_cannot_be_written(store: TieredStore, n: int) -> list[str | None]:
    """Each request reads its chunk (on disk) and then stores a newly computed block, which fails."""
    sources = []
    for i in range(n):
        got, source = store.get_with_source(key_of(i))
        if got is not None:
            assert_same(got, make_block(i))
        sources.append(source)
        store.put(key_of(100 + i), make_block(100 + i))
    return sources


def test_failed_write_does_not_stop_reads(tmp_path, monkeypatch):
    disk = DiskStore(tmp_path)
    for i in range(9):
        disk.put(key_of(i), make_block(i))

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk, "_write", full)
    store = TieredStore([MemoryStore(), disk])  # the default 5 s pause
    assert _requests_on_a_disk_that_cannot_be_written(store, 9) == ["disk"] * 9
    s = disk.tier_stats()[0]
    assert s.hits == 9 and s.errors == 1  # the first failed write paused writes only
    monkeypatch.undo()  # space again; retry_now() ends the pause without waiting 5 s
    store.retry_now()
    store.put(key_of(200), make_block(200))
    assert_same(disk.get(key_of(200)), make_block(200))


def _mount_tmpfs(where: Path, size: str) -> None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_full_or_read_only_filesystem_keeps_serving_reads(tmp_path, fault):
    mnt = tmp_path / "mnt"
    _mount_tmpfs(mnt, "512k")
    try:
        disk = DiskStore(mnt)
        for i in range(9):
            disk.put(key_of(i), make_block(i))
        if fault == "full":
            fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)  # someone else's file takes the rest
            try:
                while True:
                    os.write(fd, b"\0" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC
            finally:
                os.close(fd)
        else:
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        store = TieredStore([MemoryStore(), disk])
        assert _requests_on_a_disk_that_cannot_be_written(store, 9) == ["disk"] * 9
        assert disk.tier_stats()[0].errors >= 1  # the writes did fail, for real
        assert not list(disk.blocks_dir.glob(".kv-*.tmp"))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_failed_read_does_not_stop_writes():
    class ReadsFail(MemoryStore):
        name = "flaky"

        def get(self, key):
            raise OSError(errno.EIO, "Input/output error")

    flaky = ReadsFail()
    store = TieredStore([flaky], retry_after_s=60)
    assert store.get(key_of(1)) is None
    store.put(key_of(1), make_block(1))
    assert_same(MemoryStore.get(flaky, key_of(1)), make_block(1))


# --- 8: one failing stat() at start ------------------------------------------------------------------------


def test_one_failed_stat_at_start_skips_that_file_only(tmp_path, monkeypatch):
    store = DiskStore(tmp_path)
    for i in range(6):
        store.put(key_of(i), make_block(i))
        t = 1_000_000 + i  # distinct mtimes: LRU order 0 (oldest) .. 5
        os.utime(store.file_for(key_of(i)), (t, t))
    size = store.file_for(key_of(0)).stat().st_size
    flaky_name = store.file_for(key_of(3)).name
    real_scandir = os.scandir

    class Entry:
        def __init__(self, entry):
            self._entry = entry

        def __getattr__(self, name):
            return getattr(self._entry, name)

        def stat(self, **kwargs):
            if self._entry.name == flaky_name:  # e.g. removed by another process between listing and stat
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", self._entry.path)
            return self._entry.stat(**kwargs)

    class Listing:
        def __init__(self, path):
            self._it = real_scandir(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._it.close()

        def __iter__(self):
            return self

        def __next__(self):
            return Entry(next(self._it))

    monkeypatch.setattr(os, "scandir", Listing)
    reopened = DiskStore(tmp_path, max_bytes=3 * size)
    monkeypatch.setattr(os, "scandir", real_scandir)
    s = reopened.tier_stats()[0]
    assert (s.entries, s.bytes_held, s.evictions) == (3, 3 * size, 2)  # 5 indexed, the 2 oldest evicted
    present = [i for i in range(6) if reopened.file_for(key_of(i)).exists()]
    assert present == [2, 3, 4, 5]  # 3 was not indexed, so not evicted; found again when read
    assert_same(reopened.get(key_of(3)), make_block(3))


# --- the engine's calls: batch lookups, persist=False, placement -------------------------------------------


class Recording:
    """A tier that records the calls made to it; with `batch`, it has get_many, else only get."""

    def __init__(self, name: str, batch: bool):
        self.name = name
        self.inner = MemoryStore()
        self.calls: list[tuple[str, object]] = []
        if batch:
            self.get_many = self._get_many

    def get(self, key):
        self.calls.append(("get", key))
        return self.inner.get(key)

    def _get_many(self, keys):
        self.calls.append(("get_many", list(keys)))
        return [self.inner.get(k) for k in keys]

    def put(self, key, block):
        self.inner.put(key, block)

    def clear(self):
        self.inner.clear()

    def tier_stats(self):
        return self.inner.tier_stats()


def test_get_many_with_source_asks_each_tier_once_for_the_missing_keys():
    top, lower = Recording("top", batch=True), Recording("lower", batch=False)  # lower: asked key by key
    top.put(key_of(1), make_block(1))
    lower.put(key_of(2), make_block(2))
    store = TieredStore([top, lower])
    keys = [key_of(1), key_of(2), key_of(3), key_of(1)]
    got = store.get_many_with_source(keys)
    assert [source for _, source in got] == ["top", "lower", None, "top"]
    assert_same(got[0][0], make_block(1))
    assert_same(got[1][0], make_block(2))
    assert got[2][0] is None
    assert top.calls == [("get_many", [key_of(1), key_of(2), key_of(3)])]  # the repeated key asked once
    assert lower.calls == [("get", key_of(2)), ("get", key_of(3))]
    assert_same(top.inner.get(key_of(2)), make_block(2))  # promoted


def test_get_many_with_source_for_any_store(tmp_path):
    from pc_rag.store import as_store

    got = as_store(PlainStore("mine", {key_of(1): make_block(1)})).get_many_with_source([key_of(1), key_of(2)])
    assert [s for _, s in got] == ["mine", None]
    disk = DiskStore(tmp_path)
    disk.put(key_of(1), make_block(1))
    assert [s for _, s in disk.get_many_with_source([key_of(2), key_of(1)])] == [None, "disk"]
    assert TieredStore([MemoryStore()]).get_many_with_source([]) == []


def test_put_persist_false_stays_out_of_persistent_tiers(tmp_path):
    fakeredis = pytest.importorskip("fakeredis")
    from pc_rag.store import as_store, block_files

    memory, disk = MemoryStore(), DiskStore(tmp_path / "a")
    redis = RedisStore("redis://fake", client=fakeredis.FakeRedis())
    assert (memory.persistent, disk.persistent, redis.persistent) == (False, True, True)
    store = TieredStore([memory, disk, redis])
    store.put(key_of(1), make_block(1), persist=False)
    assert_same(memory.get(key_of(1)), make_block(1))
    assert block_files(tmp_path / "a") == [] and redis._client.dbsize() == 0
    store.put(key_of(2), make_block(2))  # persist defaults to True: every tier
    assert_same(disk.get(key_of(2)), make_block(2))
    assert_same(redis.get(key_of(2)), make_block(2))

    alone = DiskStore(tmp_path / "b")  # a persistent store used alone: a non-persist put is skipped
    alone.put_volatile(key_of(1), make_block(1))
    assert block_files(tmp_path / "b") == []
    alone.put(key_of(1), make_block(1))
    assert_same(alone.get(key_of(1)), make_block(1))

    class Mine:  # a user's store without `persist` or `persistent`: a plain put either way
        name = "mine"

        def __init__(self):
            self.keys = []

        def put(self, key, block):
            self.keys.append(key)

    mine = Mine()
    as_store(mine).put_volatile(key_of(1), make_block(1))
    assert mine.keys == [key_of(1)]


def test_blocks_are_moved_to_the_device_once_before_promotion(tmp_path):
    # Reference: the block as written, on the device asked for ("meta": a device of its own without a GPU).
    fakeredis = pytest.importorskip("fakeredis")
    memory, disk = MemoryStore(), DiskStore(tmp_path)
    redis = RedisStore("redis://fake", client=fakeredis.FakeRedis())
    store = TieredStore([memory, disk, redis])
    store.set_device("meta")
    want = make_block(1)
    redis.put(key_of(1), want)

    got, source = store.get_with_source(key_of(1))
    assert source == "redis" and got.keys.device.type == "meta" and got.keys.shape == want.keys.shape
    assert memory.get(key_of(1)) is got  # the memory tier holds the moved block
    assert_same(disk.get(key_of(1)), want)  # a persistent tier gets the block as read, not a copy back
    assert store.get_with_source(key_of(1)) == (got, "memory")

    memory.clear()
    for i in (2, 3):
        disk.put(key_of(i), make_block(i))
    got = store.get_many_with_source([key_of(2), key_of(1), key_of(3), key_of(2)])
    assert [s for _, s in got] == ["disk"] * 4
    assert all(b.keys.device.type == "meta" and b.values.device.type == "meta" for b, _ in got)


def test_a_persistent_store_used_alone_moves_its_blocks_too(tmp_path):
    disk = DiskStore(tmp_path)
    disk.put(key_of(1), make_block(1))
    store = TieredStore([disk])
    store.set_device("meta")
    got, source = store.get_with_source(key_of(1))
    assert source == "disk" and got.keys.device.type == "meta"
    store.set_device(None)
    assert store.get(key_of(1)).keys.device.type == "cpu"
