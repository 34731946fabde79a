"""The Redis tier against a real redis-server started on a free local port (skipped when the binary is
missing). Reference: blocks rebuilt from the same seed, compared bit for bit; time bounds are generous
multiples of the 0.5 s socket timeout so that a hang fails the test instead of stalling it."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import time

import pytest

from pc_rag.errors import StoreError
from pc_rag.store import MemoryStore, RedisStore, TieredStore

from .test_store import assert_same, key_of, make_block

pytest.importorskip("redis", reason="the redis package is not installed (pip install redis)")
REDIS_SERVER = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server binary not found (apt-get install redis-server)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process without persistence; stop() and start() reuse the same port."""

    def __init__(self, *extra: str):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", *self.extra],
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def server():
    srv = RedisServer()
    srv.start()
    yield srv
    srv.stop()


def test_two_stores_share_blocks(server):
    writer, reader = RedisStore(server.url), RedisStore(server.url)  # two clients, as two engines would be
    writer.put(key_of(1), make_block(1))
    assert_same(reader.get(key_of(1)), make_block(1))
    assert reader.get(key_of(2)) is None
    assert 0 < reader._client.ttl("pc_rag:" + key_of(1)) <= 7 * 24 * 3600
    reader.clear()
    assert writer.get(key_of(1)) is None


def test_tiered_store_survives_server_stop_and_recovers(server, caplog):
    store = TieredStore([MemoryStore(), RedisStore(server.url)], retry_after_s=0.2)
    store.put(key_of(1), make_block(1))
    RedisStore(server.url).put(key_of(2), make_block(2))
    assert store.get_with_source(key_of(2))[1] == "redis"

    server.stop()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pc_rag.store"):
        assert store.get_with_source(key_of(1))[1] == "memory"
        for i in range(3, 8):
            assert store.get(key_of(i)) is None
            store.put(key_of(i), make_block(i))
            time.sleep(0.05)
    assert time.monotonic() - t0 < 5.0
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert store.tier_stats()[1].errors >= 1
    with pytest.raises(StoreError):  # used alone, the tier reports the failure, quickly
        t1 = time.monotonic()
        RedisStore(server.url).get(key_of(1))
    assert time.monotonic() - t1 < 2.0

    server.start()  # a restarted server is empty (no persistence)
    time.sleep(0.25)  # past the backoff
    store.put(key_of(9), make_block(9))
    assert_same(RedisStore(server.url).get(key_of(9)), make_block(9))
    RedisStore(server.url).put(key_of(10), make_block(10))
    got, source = store.get_with_source(key_of(10))
    assert source == "redis"
    assert_same(got, make_block(10))


def test_maxmemory_allkeys_lru_bounds_the_server():
    # The configuration docs/store.md documents for the size bound; ~400 KB blocks, 30 of them, 4 MB allowed.
    srv = RedisServer("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    srv.start()
    try:
        store = RedisStore(srv.url)
        for i in range(30):
            store.put(key_of(i), make_block(i, tokens=3200))
        used, keys = store.server_usage()
        assert used <= 4 * 1024 * 1024 and 0 < keys < 30
        assert store.tier_stats()[0].errors == 0
        assert_same(store.get(key_of(29)), make_block(29, tokens=3200))  # the newest is kept
    finally:
        srv.stop()
