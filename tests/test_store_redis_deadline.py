"""Every exchange with Redis (connecting and its handshake, lookups, reads, writes) within one deadline, against a
fake server in the test that answers every command, the connection's handshake included, one byte at a time
(each byte well within a socket timeout, so only a deadline for the whole exchange cuts it off). No redis-server
needed. Reference: the same calls against the same fake answering at once succeed, so the deadline is what failed
the slow ones; the bound asserted is the 0.5 s deadline plus scheduling slack, where each exchange took 2-3 s (a
finite drip) or forever (an endless one) before."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
import torch

from pc_rag.blocks import KVBlock
from pc_rag.store import MemoryStore, RedisStore, TieredStore
from pc_rag.store.redis_cluster import RedisClusterStore
from pc_rag.store.redis_tier import TierSlowError
from pc_rag.store.tier import ReadTarget

from .test_store import key_of, make_block
from .test_store_faults import call_bounded

pytest.importorskip("redis", reason="the redis package is not installed (pip install redis)")

TIMEOUT_S = 0.5
# The deadline plus what a loaded 2-core machine may add (thread start, a redis-py reconnect); far below the 2-3 s
# (finite drip) or unbounded (endless drip) the same calls took without a deadline for the whole exchange.
BOUND_S = TIMEOUT_S + 0.45


class DripServer:
    """A fake Redis: reads RESP commands and answers each one, in order, as Redis would (`+OK`, `:0`, `$-1`, a
    nil for GET); each answer sent one byte every `drip_s` (0 = at once). `endless`: every answer is a simple string
    that never ends (`+OOOO...`). `deaf`: never reads what the client sends (its writes fill the socket buffers)."""

    def __init__(self, drip_s: float = 0.2, endless: bool = False, deaf: bool = False):
        self.drip_s, self.endless, self.deaf = drip_s, endless, deaf
        self.commands: list[bytes] = []  # every command name received, in order
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.closed = threading.Event()
        self.clients: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.clients.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket):
        buf = b""
        try:
            while not self.closed.is_set():
                if self.deaf:
                    time.sleep(0.05)
                    continue
                data = client.recv(1 << 16)
                if not data:
                    return
                buf += data
                while True:
                    parsed = _parse_command(buf)
                    if parsed is None:
                        break
                    args, buf = parsed
                    self.commands.append(args[0].upper())
                    self._answer(client, _reply(args))
        except OSError:  # the client gave up
            return

    def _answer(self, client, reply: bytes):
        if self.endless:
            client.sendall(b"+")
            while not self.closed.is_set():
                time.sleep(self.drip_s)
                client.sendall(b"O")
            return
        if not self.drip_s:
            client.sendall(reply)
            return
        for i in range(len(reply)):
            time.sleep(self.drip_s)
            client.sendall(reply[i:i + 1])

    def close(self):
        self.closed.set()
        for s in [self.sock, *self.clients]:
            try:
                s.close()
            except OSError:
                pass


def _parse_command(buf: bytes):
    """(arguments, rest of buf) for the first whole RESP array of bulk strings in buf, or None."""
    if not buf.startswith(b"*") or b"\r\n" not in buf:
        return None
    head, rest = buf.split(b"\r\n", 1)
    args = []
    for _ in range(int(head[1:])):
        if b"\r\n" not in rest:
            return None
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line[1:])
        if len(rest) < size + 2:
            return None
        args.append(rest[:size])
        rest = rest[size + 2:]
    return args, rest


def _reply(args: list[bytes]) -> bytes:
    name = args[0].upper()
    if name == b"GET":
        return b"$-1\r\n"
    if name in (b"EXISTS", b"UNLINK", b"DBSIZE"):
        return b":0\r\n"
    if name == b"SCAN":
        return b"*2\r\n$1\r\n0\r\n*0\r\n"
    if name == b"INFO":
        body = b"used_memory:1\r\n"
        return b"$%d\r\n%s\r\n" % (len(body), body)
    if name == b"HELLO":  # redis-py >= 8 speaks RESP3: the handshake's reply is a map naming the protocol
        return b"%2\r\n$6\r\nserver\r\n$5\r\nredis\r\n$5\r\nproto\r\n:3\r\n"
    if name == b"PING":
        return b"+PONG\r\n"
    return b"+OK\r\n"  # CLIENT SETINFO, SELECT, AUTH, SET


@pytest.fixture
def drip():
    servers = []

    def make(**kwargs):
        servers.append(DripServer(**kwargs))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


EXCHANGES = {
    "get_many": lambda store: store.get_many([key_of(1), key_of(2)]),
    "locate": lambda store: store.locate([key_of(1)]),
    "read_into": lambda store: store.read_into([key_of(1)], [ReadTarget(lambda b: True, torch.empty(2, 2, 6, 4),
                                                                  torch.empty(2, 2, 6, 4))]),
    "put": lambda store: store.put(key_of(1), make_block(1)),
    "clear": lambda store: store.clear(),
    "server_usage": lambda store: store.server_usage(),
}


@pytest.mark.parametrize("name", list(EXCHANGES))
def test_the_fake_answering_at_once_serves_every_exchange(drip, name):
    """The reference: the same exchanges, answered at once, succeed (a miss, no error)."""
    server = drip(drip_s=0.0)
    store = RedisStore(server.url, timeout_s=TIMEOUT_S)
    EXCHANGES[name](store)
    assert store.tier_stats()[0].errors == 0
    assert server.commands[0] in (b"HELLO", b"CLIENT")  # redis-py's handshake went to the fake too


@pytest.mark.parametrize("endless", [False, True], ids=["drip", "endless"])
@pytest.mark.parametrize("name", list(EXCHANGES))
def test_a_dripping_server_costs_each_exchange_at_most_its_deadline(drip, name, endless):
    """A fresh connection each time: the handshake drips too (before: a finite drip took 2-3 s, the handshake's
    replies under no deadline; an endless one never returned)."""
    server = drip(drip_s=0.2, endless=endless)
    store = RedisStore(server.url, timeout_s=TIMEOUT_S)
    t0 = time.monotonic()
    with pytest.raises(TierSlowError, match="too slow"):
        call_bounded(lambda: EXCHANGES[name](store), 10.0)
    assert time.monotonic() - t0 < BOUND_S
    assert store.tier_stats()[0].errors == 1


@pytest.mark.parametrize("endless", [False, True], ids=["drip", "endless"])
def test_a_request_through_the_tiered_store_costs_at_most_the_deadline_then_skips_the_tier(drip, endless, caplog):
    server = drip(drip_s=0.2, endless=endless)
    tier = RedisStore(server.url, timeout_s=TIMEOUT_S)
    store = TieredStore([MemoryStore(), tier], retry_after_s=60)
    with caplog.at_level(logging.WARNING, logger="pc_rag.store"):
        got, elapsed = call_bounded(lambda: store.get_many([key_of(1), key_of(2)]), 10.0)
    assert got == [None, None] and elapsed < BOUND_S, elapsed
    assert "too slow" in caplog.text
    t0 = time.monotonic()
    store.put(key_of(3), make_block(3))  # written to memory; the Redis tier is skipped, no second wait
    assert store.get_many([key_of(1)]) == [None]
    assert time.monotonic() - t0 < 0.2
    assert tier.tier_stats()[0].errors == 1


def test_each_exchange_is_timed_from_its_own_start(drip):
    """Two exchanges on one connection: the deadline is per exchange, not per connection or per store."""
    server = drip(drip_s=0.0)
    store = RedisStore(server.url, timeout_s=TIMEOUT_S)
    for _ in range(3):
        store.get_many([key_of(1)])
        time.sleep(TIMEOUT_S / 2)
    assert store.tier_stats()[0].errors == 0


def test_a_server_that_stops_reading_bounds_a_write(drip):
    """A SET of 16 MiB to a server that never reads: the sockets' buffers fill and the write waits. The deadline
    allows the bytes' time at 16 MiB/s ahead (1 s) plus 0.5 s; the write is cut there, not per socket call."""
    server = drip(deaf=True)
    store = RedisStore(server.url, timeout_s=TIMEOUT_S)
    g = torch.Generator().manual_seed(0)
    shape = (8, 8, 256, 128)  # 8 MiB of keys, 8 of values
    big = KVBlock(torch.randn(shape, generator=g), torch.randn(shape, generator=g), tuple(range(256)), 0, {})
    t0 = time.monotonic()
    with pytest.raises(TierSlowError, match="too slow"):
        call_bounded(lambda: store.put(key_of(1), big), 10.0)
    assert time.monotonic() - t0 < TIMEOUT_S + 1.0 + 0.6


def test_cluster_slot_map_from_dripping_seeds_costs_one_deadline_and_asks_the_failed_seed_last(drip):
    """Two seeds that drip: CLUSTER SLOTS is asked under one deadline for both (each connection's handshake
    included), not one per seed; the seed that failed is asked last the next time."""
    a, b = drip(drip_s=0.2), drip(drip_s=0.2)
    store = RedisClusterStore([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"], timeout_s=TIMEOUT_S)
    from pc_rag.errors import StoreError

    t0 = time.monotonic()
    with pytest.raises(StoreError, match="no node answered CLUSTER SLOTS"):
        call_bounded(lambda: store._ask_slots(), 10.0)
    assert time.monotonic() - t0 < BOUND_S
    assert store._failed_seeds == [f"127.0.0.1:{a.port}"]  # the deadline passed on the first; b was not asked
    assert not b.commands
