"""The Redis tier against a real redis-server started on a free local port (skipped when the binary is
missing). Reference: blocks rebuilt from the same seed, compared bit for bit; time bounds are generous
multiples of the 0.5 s socket timeout so that a hang fails the test instead of stalling it."""

from __future__ import annotations

import heapq
import logging
import shutil
import socket
import subprocess
import threading
import time

import pytest
import torch

from pc_rag.blocks import KVBlock
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


class SlowProxy:
    """A TCP proxy in front of a server that delivers every reply `delay_s` late: a slow but alive Redis
    (a loaded server or a long network path). Replies are delayed, not serialised: several replies in flight
    arrive together, as on a real link with that latency. `rate_bytes_per_s`: replies also trickle at that
    rate (a slow link that keeps delivering)."""

    def __init__(self, upstream_port: int, delay_s: float, rate_bytes_per_s: float | None = None):
        self.delay_s = delay_s
        self.rate_bytes_per_s = rate_bytes_per_s
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self.sockets += [client, upstream]
            threading.Thread(target=self._requests, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self.delay_s, self.rate_bytes_per_s),
                             daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        self._pipe(client, upstream, 0.0)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, delay_s: float, rate_bytes_per_s: float | None = None) -> None:
        due: list[tuple[float, int, bytes]] = []  # (time to send, sequence, data)
        cond = threading.Condition()
        done = []

        def sender():
            while True:
                with cond:
                    while not due and not done:
                        cond.wait()
                    if not due:
                        return
                    wait = due[0][0] - time.monotonic()
                    if wait > 0:
                        cond.wait(wait)
                        continue
                    _, _, data = heapq.heappop(due)
                try:
                    dst.sendall(data)
                except OSError:
                    return
                if rate_bytes_per_s:
                    time.sleep(len(data) / rate_bytes_per_s)

        threading.Thread(target=sender, daemon=True).start()
        seq = 0
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = b""
            with cond:
                if not data:
                    done.append(True)
                    cond.notify()
                    return
                heapq.heappush(due, (time.monotonic() + delay_s, seq, data))
                seq += 1
                cond.notify()

    def close(self) -> None:
        for s in self.sockets:
            try:
                s.close()
            except OSError:
                pass


class DripProxy(SlowProxy):
    """Passes everything through until `dripping` is set; from then on it answers each request holding a GET
    itself, as a server gone bad (or a hostile one) would: `$100000000` (a 100 MB value follows) and then one
    byte every `drip_s`, each well within a socket read timeout, for as long as the client listens."""

    def __init__(self, upstream_port: int, drip_s: float = 0.3):
        self.dripping = False
        self.drip_s = drip_s
        super().__init__(upstream_port, 0.0)

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        while True:
            try:
                data = client.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            if not (self.dripping and b"GET" in data):
                upstream.sendall(data)
                continue
            try:
                client.sendall(b"$100000000\r\n")
                while True:
                    time.sleep(self.drip_s)
                    client.sendall(b"x")
            except OSError:  # the client gave up
                return


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
        assert store.locate([key_of(29)]) == [True]  # the newest is kept (EXISTS: no reply that needs memory)
        # Read it back with room to spare: a 400 KB reply counts against maxmemory while it is built, and near
        # the bound the server may evict even the newest key to make room for it (seen once in CI).
        import redis as redis_py

        redis_py.Redis.from_url(srv.url).config_set("maxmemory", "64mb")
        assert_same(store.get(key_of(29)), make_block(29, tokens=3200))
    finally:
        srv.stop()


def test_wrong_type_value_is_a_corrupt_miss_not_an_outage(server):
    # A value of another type under a block's name (another program sharing the prefix, a manual HSET):
    # GET answers WRONGTYPE. That is one bad entry, like a damaged blob, not a server failure.
    import redis as redis_py

    other = redis_py.Redis.from_url(server.url)
    other.hset("pc_rag:" + key_of(1), "field", "value")
    other.rpush("pc_rag:" + key_of(3), "a", "b")
    RedisStore(server.url).put(key_of(2), make_block(2))
    RedisStore(server.url).put(key_of(4), make_block(4))
    tier = RedisStore(server.url)
    store = TieredStore([MemoryStore(), tier], retry_after_s=60)

    assert store.get_with_source(key_of(1)) == (None, None)
    got, source = store.get_with_source(key_of(2))
    assert source == "redis"
    assert_same(got, make_block(2))
    batch = store.get_many_with_source([key_of(3), key_of(4), key_of(5)])
    assert [s for _, s in batch] == [None, "redis", None]
    assert_same(batch[1][0], make_block(4))
    s = tier.tier_stats()[0]
    assert (s.corrupt, s.errors, s.hits, s.misses) == (2, 0, 2, 3)
    assert other.exists("pc_rag:" + key_of(1), "pc_rag:" + key_of(3)) == 0  # removed, as damaged blobs are


def test_batch_lookup_pays_a_slow_server_once(server):
    # 12 chunks, a server answering 0.1 s late. Reference: the same keys looked up one by one (the engine's
    # path before get_many_with_source), which pays the delay 12 times.

    keys = [key_of(i) for i in range(12)]
    direct = RedisStore(server.url)
    for i, key in enumerate(keys):
        direct.put(key, make_block(i))
    proxy = SlowProxy(server.port, delay_s=0.1)
    try:
        one_by_one = RedisStore(proxy.url)
        one_by_one.get(key_of(99))  # connect first: the connection is not what is measured
        t0 = time.monotonic()
        assert all(one_by_one.get(key) is not None for key in keys)
        per_key_s = time.monotonic() - t0

        store = TieredStore([MemoryStore(), RedisStore(proxy.url)])
        store.tiers[1].get(key_of(99))
        t0 = time.monotonic()
        got = store.get_many_with_source(keys)
        batch_s = time.monotonic() - t0
    finally:
        proxy.close()
    assert [s for _, s in got] == ["redis"] * 12
    for i, (block, _) in enumerate(got):
        assert_same(block, make_block(i))
    assert per_key_s >= 12 * 0.1
    assert batch_s < 0.5 and batch_s < per_key_s / 4, (batch_s, per_key_s)


def _batch_through_proxy(server, blocks: list[KVBlock], **proxy) -> tuple[list, float, RedisStore]:
    """Stores `blocks` (keys 0..), then looks them all up in one batch through a SlowProxy(**proxy), 0.3 s socket
    timeout: (what the lookup got, its seconds, the Redis tier)."""

    keys = [key_of(i) for i in range(len(blocks))]
    for key, block in zip(keys, blocks, strict=True):
        RedisStore(server.url).put(key, block)
    link = SlowProxy(server.port, **proxy)
    try:
        tier = RedisStore(link.url, timeout_s=0.3)
        store = TieredStore([MemoryStore(), tier], retry_after_s=60)
        t0 = time.monotonic()
        got = store.get_many_with_source(keys)
        return got, time.monotonic() - t0, tier
    finally:
        link.close()


def test_server_slower_than_the_timeout_costs_one_timeout_per_batch(server):
    got, elapsed, tier = _batch_through_proxy(server, [make_block(i) for i in range(12)], delay_s=1.5)
    assert got == [(None, None)] * 12
    assert elapsed < 3 * 0.3, elapsed  # one 0.3 s timeout for the batch, not one per key
    assert tier.tier_stats()[0].errors == 1


def _big_block(seed: int) -> KVBlock:
    """4 MiB of KV (2 MiB of keys, 2 MiB of values, 256 tokens)."""
    g = torch.Generator().manual_seed(seed)
    shape = (4, 4, 256, 128)
    return KVBlock(torch.randn(shape, generator=g), torch.randn(shape, generator=g), tuple(range(256)), 0, {})


def test_a_dripping_server_cannot_hang_a_batch(server, caplog):
    """A server that answers a GET with `$100000000` and then a byte every 0.3 s: each socket read returns well
    within the default 0.5 s timeout, so a per-read bound never fires (before: the request hung, ~1 year for the
    10^8 bytes). Now the batch has one deadline (0.5 s plus the bytes that arrived at 16 MiB/s): the batch is a
    miss within about 1 s, the tier is marked down (a warning naming it too slow) and skipped, by the lookup path
    (a pipeline of GETs) and by the path that reads into a request buffer (EXISTS, then GETs into slots)."""
    from pc_rag.store.redis_tier import TierSlowError
    from pc_rag.store.tier import ReadTarget

    from .test_store_faults import call_bounded

    RedisStore(server.url).put(key_of(1), make_block(1))
    proxy = DripProxy(server.port)
    try:
        tier = RedisStore(proxy.url)
        store = TieredStore([MemoryStore(), tier], retry_after_s=60)
        assert tier.locate([key_of(1)]) == [True]  # connected, passing through
        proxy.dripping = True
        with caplog.at_level(logging.WARNING, logger="pc_rag.store"):
            got, elapsed = call_bounded(lambda: store.get_many_with_source([key_of(1), key_of(2)]), 10.0)
        assert got == [(None, None)] * 2 and elapsed < 1.5, elapsed
        assert "too slow" in caplog.text and tier.tier_stats()[0].errors == 1
        t0 = time.monotonic()
        assert store.get_with_source(key_of(1)) == (None, None)  # skipped: no second wait
        assert time.monotonic() - t0 < 0.05

        # Into a request buffer's slots (the bytes expected are known): the same bound.
        direct = RedisStore(proxy.url)
        proxy.dripping = False
        assert direct.locate([key_of(1)]) == [True]
        proxy.dripping = True
        keys, values = torch.empty(2, 2, 6, 4), torch.empty(2, 2, 6, 4)
        with pytest.raises(TierSlowError, match="too slow"):
            call_bounded(lambda: direct.read_into([key_of(1)], [ReadTarget(lambda b: True, keys, values)]), 10.0)
    finally:
        proxy.close()


def test_a_large_batch_on_a_slow_link_still_completes(server):
    """24 MiB in one batch through a link of 32 MiB/s, 0.3 s per-read timeout: about 0.75 s in all, more than two
    timeouts, yet twice the 16 MiB/s floor, so it completes, equal bit for bit."""
    got, elapsed, tier = _batch_through_proxy(server, [_big_block(i) for i in range(6)], delay_s=0.0,
                                              rate_bytes_per_s=32 << 20)
    assert [s for _, s in got] == ["redis"] * 6, (elapsed, tier.tier_stats())
    for i, (block, _) in enumerate(got):
        assert_same(block, _big_block(i))
    assert elapsed > 0.5, elapsed  # the link was the bottleneck: the deadline was really tested
