"""The Redis tier: blocks shared by several engine processes or machines, as safetensors blobs with a TTL.

The size bound lives in the Redis server, not here: run it with `maxmemory <bytes>` and
`maxmemory-policy allkeys-lru` so that it evicts least recently used blocks when full (see docs/store.md).
Each blob is one string value, so a block must stay under the server's `proto-max-bulk-len` (512 MB
by default).

The `redis` package is optional and imported only when a RedisStore is built. Timeouts are short and
the client never retries: a down or unreachable server costs one failed call of at most `timeout_s`,
after which the tiered store skips this tier for a while.

`get_many` fetches a request's blocks in one round trip (a pipeline of GETs, sent as one write and answered
in one stream), so a slow server costs its latency once per request, not once per block. Every exchange with the
server (a read or write batch, a SCAN, an INFO, and the connecting and handshake it may start with: TCP connect,
AUTH/HELLO, SELECT, CLIENT SETINFO) has one deadline for the whole of it, not one per socket operation:
`timeout_s` from its start plus the time the bytes moved so far (sent and received) would take at
`min_transfer_bytes_per_s` (16 MiB/s, a 130 Mbit/s link), the received ones counted up to what the batch is
expected to hold where the caller says (the request buffer's slots a block is read into). So a healthy large batch
that keeps arriving is never cut off, while a server that answers one byte every 0.3 s (each socket read well
within its timeout: a handshake or a `$100000000` reply answered that way used to hold the request for as long as
the server pleased) is cut off after about `timeout_s`. An exchange past its deadline is a miss and a
`TierSlowError`, which the TieredStore treats as an unreachable tier: skipped for reads and writes for its
`retry_after_s`. The deadline is enforced by the client's socket (`_DeadlineSocket`, a plain TCP or Unix socket;
a TLS connection, rediss://, keeps the per-operation timeouts only) and by the connect timeout, shortened to what
is left (name resolution is not bounded). A value of another
Redis type under a block's name (WRONGTYPE) is a corrupt entry for that key only, like a damaged blob.
`locate` (a pipeline of EXISTS) and `read_into` let a TieredStore read a request's blocks straight into its buffer,
as the disk tier does: the replies are decoded in the reader threads, compressed blocks into the slots.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..blocks import KVBlock
from ..errors import StoreError
from .codec import CorruptBlockError, StaleBlockError, decode_block, encode_block, tier_codec
from .tier import (
    Held,
    ReadTarget,
    Store,
    StoreUsageError,
    TierStats,
    TierUnavailableError,
    add_time,
    check_key,
    in_parallel,
)

log = logging.getLogger("pc_rag.store")


MIN_TRANSFER_BYTES_PER_S = 16 << 20
# What a block's blob holds beyond its tensors' bytes: the safetensors header (a few hundred bytes here).
BLOB_OVERHEAD_BYTES = 64 << 10


class ClusterRedirectError(StoreError):
    """A cluster node answered MOVED or ASK: the key's slot is served elsewhere (used alone, point the store at the
    cluster with `redis+cluster://`; RedisClusterStore refreshes its slot map)."""


def _redirected(error: BaseException) -> bool:
    """A MOVED or ASK reply (redis-py parses them as MovedError / AskError, its message without the word)."""
    return type(error).__name__ in ("MovedError", "AskError") or str(error).startswith(("MOVED ", "ASK "))


class TierSlowError(TierUnavailableError):
    """A batch took longer than its deadline: the tier is answered as down (a miss now, skipped for a while)."""


@dataclass
class _Exchange:
    """One exchange's deadline: `timeout_s` from its start, plus the bytes moved so far (the received ones counted up
    to `cap_bytes`, the bytes the batch is expected to hold, when known) at `min_bytes_per_s`."""

    timeout_s: float
    min_bytes_per_s: float
    cap_bytes: int | None = None
    start: float = field(default_factory=time.monotonic)
    received: int = 0
    sent: int = 0

    def left_s(self, sending: int = 0) -> float:
        """Seconds left; `sending`: bytes about to be sent, whose time is allowed ahead."""
        received = self.received if self.cap_bytes is None else min(self.received, self.cap_bytes)
        moved = received + self.sent + sending
        return self.start + self.timeout_s + moved / self.min_bytes_per_s - time.monotonic()

    def describe(self) -> str:
        return (f"{self.sent} bytes sent and {self.received} received in {time.monotonic() - self.start:.2f} s, "
                f"under {self.timeout_s:g} s plus {self.min_bytes_per_s / 2**20:g} MiB/s")


# The exchange the current thread is in, if any: the client's sockets (_DeadlineSocket) bound each operation by what
# is left of it. Per thread because redis-py hands each thread its own connection from the pool for a call.
_EXCHANGE = threading.local()


def _current() -> _Exchange | None:
    return getattr(_EXCHANGE, "now", None)


class _DeadlineSocket(socket.socket):
    """A client socket whose reads and writes, while its thread is in an exchange (`_EXCHANGE.now`), wait no longer
    than the exchange's deadline allows and count the bytes they move; outside an exchange it is a plain socket."""

    @classmethod
    def adopt(cls, sock: socket.socket) -> socket.socket:
        if type(sock) is not socket.socket:  # a TLS socket: left as it is (per-operation timeouts only)
            return sock
        timeout = sock.gettimeout()
        adopted = cls(sock.family, sock.type, sock.proto, fileno=sock.detach())
        adopted.settimeout(timeout)
        return adopted

    def _bounded(self, op, flags: int = 0, sending: int | None = None):
        """`op` (a read, or a write of `sending` bytes) within what is left of the thread's exchange."""
        exchange = _current()
        timeout = self.gettimeout()
        if exchange is None or timeout == 0 or flags & socket.MSG_PEEK:
            return op()
        left = exchange.left_s(sending or 0)
        if left <= 0:
            raise TimeoutError(f"the exchange's deadline passed ({exchange.describe()})")
        if timeout is None or timeout > left:
            super().settimeout(left)
        try:
            got = op()
        finally:
            super().settimeout(timeout)
        if sending is None:
            exchange.received += got if isinstance(got, int) else len(got)
        else:
            exchange.sent += sending if got is None else got  # sendall returns None once all is sent
        return got

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        return self._bounded(lambda: super(_DeadlineSocket, self).recv(bufsize, flags), flags)

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        return self._bounded(lambda: super(_DeadlineSocket, self).recv_into(buffer, nbytes, flags), flags)

    def sendall(self, data, flags: int = 0) -> None:
        # A timeout bounds a whole sendall (Python >= 3.5), so the deadline covers every byte of it.
        return self._bounded(lambda: super(_DeadlineSocket, self).sendall(data, flags), flags, memoryview(data).nbytes)

    def send(self, data, flags: int = 0) -> int:
        return self._bounded(lambda: super(_DeadlineSocket, self).send(data, flags), flags, memoryview(data).nbytes)


@functools.cache
def _deadline_connections() -> dict[str, type]:
    """redis-py connection classes whose sockets are `_DeadlineSocket`s, by URL scheme."""
    from redis.connection import Connection, UnixDomainSocketConnection

    def with_deadline(base: type) -> type:
        def _connect(self):
            exchange = _current()
            if exchange is None:
                return _DeadlineSocket.adopt(base._connect(self))
            # The TCP connect waits no longer than the exchange has left; the handshake that follows (AUTH, HELLO,
            # SELECT, CLIENT SETINFO) goes through the adopted socket, under the same deadline.
            configured = self.socket_connect_timeout
            left = exchange.left_s()
            if left <= 0:
                raise TimeoutError(f"the exchange's deadline passed before connecting ({exchange.describe()})")
            self.socket_connect_timeout = left if configured is None else min(configured, left)
            try:
                return _DeadlineSocket.adopt(base._connect(self))
            finally:
                self.socket_connect_timeout = configured

        return type(f"Deadline{base.__name__}", (base,), {"_connect": _connect})

    return {"redis": with_deadline(Connection), "unix": with_deadline(UnixDomainSocketConnection)}


def _connect(url: str, timeout_s: float) -> Any:
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError as e:
        raise StoreError(
            f"the Redis tier ({url}) needs the redis package: pip install 'redis>=5'"
        ) from e
    scheme = url.split("://", 1)[0].lower()
    extra = {"connection_class": _deadline_connections()[scheme]} if scheme in ("redis", "unix") else {}
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),  # redis-py >= 6 retries 3 times with backoff by default
        health_check_interval=0,
        **extra,
    )


class RedisStore(Store):
    """`client`: an existing redis.Redis-compatible client (tests pass a fakeredis one); else built from
    `url` with `timeout_s` for connect and for every call.

    The server is shared and evicts on its own, so `tier_stats()` leaves bytes_held, entries and evictions
    at 0 rather than guess; `server_usage()` asks the server.
    """

    name = "redis"
    persistent = True
    reads_in_place = True

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        ttl_s: float | None = 7 * 24 * 3600,
        prefix: str = "pc_rag:",
        timeout_s: float = 0.5,
        client: Any = None,
        compress: str | None = None,
        min_transfer_bytes_per_s: float = MIN_TRANSFER_BYTES_PER_S,
    ):
        if ttl_s is not None and ttl_s <= 0:
            raise StoreUsageError(f"RedisStore ttl_s must be > 0 or None, got {ttl_s}")
        if not min_transfer_bytes_per_s > 0:
            raise StoreUsageError(f"RedisStore min_transfer_bytes_per_s must be > 0, got {min_transfer_bytes_per_s}")
        self.timeout_s = timeout_s
        self.min_transfer_bytes_per_s = min_transfer_bytes_per_s
        self.codec = tier_codec(compress)
        self.url = url
        self.ttl_s = ttl_s
        self.prefix = prefix
        self._client = client if client is not None else _connect(url, timeout_s)
        self._errors, self._unreachable = _redis_errors()
        self._lock = threading.Lock()
        self.stats = TierStats(self.name)

    def _call(self, what: str, fn, *args, expected_bytes: int | None = None, **kwargs):
        """`fn(*args, **kwargs)`, one exchange with the server, within one deadline for the whole of it (the
        module docstring); past it, a TierSlowError. `expected_bytes`: what the replies should hold, when known."""
        exchange = _Exchange(self.timeout_s, self.min_transfer_bytes_per_s, expected_bytes)
        with _within(exchange):
            try:
                return fn(*args, **kwargs)
            except self._errors as e:
                with self._lock:
                    self.stats.errors += 1
                message = f"redis store {self.url}: {what} failed: {type(e).__name__}: {e}"
                if _redirected(e):
                    raise ClusterRedirectError(message) from e
                if isinstance(e, self._unreachable):  # no answer at all: reads and writes fail alike
                    if exchange.left_s() <= 0:
                        raise TierSlowError(f"redis store {self.url}: {what} was too slow ({exchange.describe()}, "
                                            f"expected {expected_bytes or 'unknown'} bytes); the tier is skipped "
                                            f"for a while") from e
                    raise TierUnavailableError(message) from e
                raise StoreError(message) from e  # the server answered with an error (e.g. OOM on SET)

    def get(self, key: str) -> KVBlock | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[str], count: bool = True) -> list[KVBlock | None]:
        """The blocks of `keys`, in one round trip: a pipeline of GETs rather than MGET, because MGET answers
        nil for a value of another type where GET names the WRONGTYPE, which is counted as corrupt.
        `count=False` (`reread`): not counted as hits, misses, bytes or load time."""
        return self._read(keys, [None] * len(keys), count)

    def locate(self, keys: list[str]) -> list[bool]:
        """Whether the server holds an entry under each key's name, reading no block: the keys `read_into` may
        then load. A key with no entry is a miss; an entry that expires before `read_into` is a miss then."""
        held = self._exists(keys)
        with self._lock:
            self.stats.misses += held.count(False)
        return held

    def where(self, keys: Sequence[str], tiers: str = "all") -> list[Held | None]:
        """As `locate` (one round trip), counted as nothing."""
        keys = list(keys)
        if not self._of_kind(tiers):
            return [None] * len(keys)
        return [Held(self.name, True) if h else None for h in self._exists(keys)]

    def _exists(self, keys: list[str]) -> list[bool]:
        """One round trip: a pipeline of EXISTS."""
        names = [self.prefix + check_key(key) for key in keys]
        if not names:
            return []

        def ask():
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return pipe.execute()

        # `locate` counts the misses, `where` nothing.
        return [bool(n) for n in self._call(f"EXISTS of {len(names)} keys", ask, expected_bytes=64 * len(names))]

    def read_into(self, keys: list[str], sinks: list[ReadTarget | Callable[[KVBlock], bool]]) -> list[bool]:
        """Fetches the blocks of `keys` (one round trip) and hands each one to its sink, as `DiskStore.read_into`:
        per key, whether its sink took it. A compressed block is verified in the reply and dequantized straight
        into its sink's slots (see ReadTarget); an uncompressed one views the reply, and the sink copies it. Unlike the
        disk tier, the transfer is the cost and the reply is one stream, so there is no thread pool here. What a
        sink raises propagates, once the counters are settled."""
        sinks = [ReadTarget.of(s) for s in sinks]
        blocks = self._read(keys, [s.slots for s in sinks], count=True)
        t0 = time.perf_counter()
        try:
            return [block is not None and bool(sink.take(block)) for block, sink in zip(blocks, sinks, strict=True)]
        finally:
            with self._lock:
                self.stats.copy_s += time.perf_counter() - t0

    def reread(self, keys: list[str]) -> list[KVBlock | None]:
        """`get_many` for blocks `read_into` already served into a caller's buffer and now wanted in memory of their
        own (promotion): fetched again, not counted again. (Keeping every reply until then would hold a prompt's
        blocks in memory for blocks that are mostly never promoted: the exact-prefix blocks are cloned from the
        request buffer instead.)"""
        return self.get_many(keys, count=False)

    def _read(self, keys: list[str], outs: list, count: bool) -> list[KVBlock | None]:
        """The blocks of `keys` in one round trip, each decoded into its `outs` slots where given (decode_block's
        `out`); None for a miss. Damaged entries are removed and counted corrupt (with count=False too)."""
        names = [self.prefix + check_key(key) for key in keys]
        if not names:
            return []
        t0 = time.perf_counter()

        def fetch():
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            return pipe.execute(raise_on_error=False)  # a per-key error reply comes back as its exception

        expected = None  # known when every block has slots to go to: a blob holds their bytes, or fewer (int8)
        if all(out is not None for out in outs):
            expected = sum(k.nbytes + v.nbytes + BLOB_OVERHEAD_BYTES for k, v in outs)
        replies = self._call(f"GET of {len(names)} keys", fetch, expected_bytes=expected)
        timings = {"read_s": time.perf_counter() - t0}  # the round trip and the transfer
        for name, data in zip(names, replies, strict=True):
            if isinstance(data, Exception) and not str(data).startswith("WRONGTYPE"):
                with self._lock:
                    self.stats.errors += 1
                message = f"redis store {self.url}: GET {name} failed: {type(data).__name__}: {data}"
                raise (ClusterRedirectError if _redirected(data) else StoreError)(message)
        # Decoded in the reader threads: checksums and zstd release the GIL, and a compressed prompt's decoding
        # took as long as its transfer in this thread alone.
        decoded = in_parallel(_decode, list(zip(keys, replies, outs, strict=True)))
        blocks: list[KVBlock | None] = []
        bad, stale = [], []  # damaged entries; entries of another format (another pc_rag version)
        nbytes = 0
        for name, data, (block, outcome, steps) in zip(names, replies, decoded, strict=True):
            for step, seconds in steps.items():
                add_time(timings, step, seconds)
            if block is not None:
                nbytes += len(data)
            elif outcome == "stale":
                stale.append(name)
            elif outcome == "corrupt":
                bad.append(name)
            blocks.append(block)
        hits = sum(b is not None for b in blocks)
        with self._lock:
            self.stats.corrupt += len(bad)
            if count:
                self.stats.hits += hits
                self.stats.misses += len(blocks) - hits
                self.stats.bytes_read += nbytes
                for step, seconds in timings.items():
                    setattr(self.stats, step, getattr(self.stats, step) + seconds)
                if hits:
                    self.stats.load_s += time.perf_counter() - t0
        bad += stale
        if bad:
            try:  # a second round trip only when something was damaged; a put would overwrite it anyway
                self._unlink(bad)
            except StoreError as e:
                log.debug("redis store: cannot remove corrupt entries %s (%s)", bad, e)
        return blocks

    def put(self, key: str, block: KVBlock) -> None:
        name = self.prefix + check_key(key)
        data = encode_block(key, block, self.codec)
        ex = None if self.ttl_s is None else max(1, round(self.ttl_s))
        self._call("SET", self._client.set, name, data, ex=ex)

    def clear(self) -> None:
        """Deletes every key under this store's prefix (on the whole server database, all processes)."""
        cursor = 0
        while True:  # one exchange (and deadline) per page of names
            cursor, names = self._call("SCAN", self._client.scan, cursor, match=self.prefix + "*", count=1000)
            if names:
                self._unlink(names)
            if not int(cursor):
                return

    def _unlink(self, names: list) -> None:
        """One round trip: a pipeline of single-key UNLINKs (a cluster node refuses one UNLINK of keys in several
        slots)."""
        def unlink():
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.unlink(name)
            return pipe.execute()

        self._call("UNLINK", unlink)

    def server_usage(self) -> tuple[int, int]:
        """(used_memory bytes, number of keys) of the server database: one round trip each."""
        info = self._call("INFO", self._client.info, "memory")
        return int(info["used_memory"]), int(self._call("DBSIZE", self._client.dbsize))

    def tier_stats(self) -> list[TierStats]:
        with self._lock:
            return [replace(self.stats)]


@contextlib.contextmanager
def _within(exchange: _Exchange | None) -> Iterator[None]:
    previous = _current()
    _EXCHANGE.now = exchange
    try:
        yield
    finally:
        _EXCHANGE.now = previous


def _decode(key: str, data, out) -> tuple[KVBlock | None, str, dict[str, float]]:
    """One reply decoded (in a reader thread): (block or None, "hit" / "miss" / "stale" / "corrupt", timings)."""
    timings: dict[str, float] = {}
    if data is None:
        return None, "miss", timings
    if isinstance(data, Exception):  # WRONGTYPE: another type of value under a block's name
        return None, "corrupt", timings
    try:
        return decode_block(key, data, timings, out), "hit", timings
    except StaleBlockError:
        return None, "stale", timings
    except CorruptBlockError:
        return None, "corrupt", timings


def _redis_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(every error a call may raise, those that mean the server could not be reached or did not answer)."""
    try:
        import redis
    except ImportError:  # a client passed in without the package (tests): socket errors only
        return (OSError,), (OSError,)
    unreachable = (OSError, redis.ConnectionError, redis.TimeoutError)
    return (*unreachable, redis.RedisError), unreachable
