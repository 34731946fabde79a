"""The Redis tier: blocks shared by several engine processes or machines, as safetensors blobs with a TTL.

The size bound lives in the Redis server, not here: run it with `maxmemory <bytes>` and
`maxmemory-policy allkeys-lru` so that it evicts least recently used blocks when full (see docs/store.md).
Each blob is one string value, so a block must stay under the server's `proto-max-bulk-len` (512 MB
by default).

The `redis` package is optional and imported only when a RedisStore is built. Timeouts are short and
the client never retries: a down or unreachable server costs one failed call of at most `timeout_s`,
after which the tiered store skips this tier for a while.

`get_many` fetches a request's blocks in one round trip (a pipeline of GETs, sent as one write and answered
in one stream), so a slow server costs its latency once per request, not once per block; the wait for the
server to answer is bounded by one `timeout_s` for the batch. The bound applies to every socket read, not
to the transfer as a whole: a batch of large blocks that keeps arriving is not cut off. A value of another
Redis type under a block's name (WRONGTYPE) is a corrupt entry for that key only, like a damaged blob.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any

from ..blocks import KVBlock
from ..errors import StoreError
from .codec import CorruptBlockError, StaleBlockError, decode_block, encode_block, tier_codec
from .tier import StoreUsageError, TierStats, TierUnavailableError, check_key

log = logging.getLogger("pc_rag.store")


def _connect(url: str, timeout_s: float) -> Any:
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError as e:
        raise StoreError(
            f"the Redis tier ({url}) needs the redis package: pip install 'redis>=5'"
        ) from e
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),  # redis-py >= 6 retries 3 times with backoff by default
        health_check_interval=0,
    )


class RedisStore:
    """`client`: an existing redis.Redis-compatible client (tests pass a fakeredis one); else built from
    `url` with `timeout_s` for connect and for every call.

    The server is shared and evicts on its own, so `tier_stats()` leaves bytes_held, entries and evictions
    at 0 rather than guess; `server_usage()` asks the server.
    """

    name = "redis"
    persistent = True

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        ttl_s: float | None = 7 * 24 * 3600,
        prefix: str = "pc_rag:",
        timeout_s: float = 0.5,
        client: Any = None,
        compress: str | None = None,
    ):
        if ttl_s is not None and ttl_s <= 0:
            raise StoreUsageError(f"RedisStore ttl_s must be > 0 or None, got {ttl_s}")
        self.codec = tier_codec(compress)
        self.url = url
        self.ttl_s = ttl_s
        self.prefix = prefix
        self._client = client if client is not None else _connect(url, timeout_s)
        self._errors, self._unreachable = _redis_errors()
        self._lock = threading.Lock()
        self.stats = TierStats(self.name)

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except self._errors as e:
            with self._lock:
                self.stats.errors += 1
            message = f"redis store {self.url}: {what} failed: {type(e).__name__}: {e}"
            if isinstance(e, self._unreachable):  # no answer at all: reads and writes fail alike
                raise TierUnavailableError(message) from e
            raise StoreError(message) from e  # the server answered with an error (e.g. OOM on SET)

    def get(self, key: str) -> KVBlock | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[str]) -> list[KVBlock | None]:
        """The blocks of `keys`, in one round trip: a pipeline of GETs rather than MGET, because MGET answers
        nil for a value of another type where GET names the WRONGTYPE, which is counted as corrupt."""
        names = [self.prefix + check_key(key) for key in keys]
        if not names:
            return []
        t0 = time.perf_counter()

        def fetch():
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            return pipe.execute(raise_on_error=False)  # a per-key error reply comes back as its exception

        replies = self._call(f"GET of {len(names)} keys", fetch)
        timings = {"read_s": time.perf_counter() - t0}  # the round trip and the transfer
        blocks: list[KVBlock | None] = []
        bad, stale = [], []  # damaged entries; entries of another format (another pc_rag version)
        nbytes = 0
        for key, name, data in zip(keys, names, replies, strict=True):
            block = None
            if isinstance(data, Exception):
                if not str(data).startswith("WRONGTYPE"):
                    with self._lock:
                        self.stats.errors += 1
                    raise StoreError(f"redis store {self.url}: GET {name} failed: {type(data).__name__}: {data}")
                bad.append(name)
            elif data is not None:
                try:
                    block = decode_block(key, data, timings)
                    nbytes += len(data)
                except StaleBlockError:
                    stale.append(name)
                except CorruptBlockError:
                    bad.append(name)
            blocks.append(block)
        hits = sum(b is not None for b in blocks)
        with self._lock:
            self.stats.hits += hits
            self.stats.misses += len(blocks) - hits
            self.stats.corrupt += len(bad)
            self.stats.bytes_read += nbytes
            for step, seconds in timings.items():
                setattr(self.stats, step, getattr(self.stats, step) + seconds)
            if hits:
                self.stats.load_s += time.perf_counter() - t0
        bad += stale
        if bad:
            try:  # a second round trip only when something was damaged; a put would overwrite it anyway
                self._call("UNLINK", self._client.unlink, *bad)
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
        names = self._call("SCAN", lambda: list(self._client.scan_iter(match=self.prefix + "*", count=1000)))
        for i in range(0, len(names), 1000):
            self._call("UNLINK", self._client.unlink, *names[i : i + 1000])

    def server_usage(self) -> tuple[int, int]:
        """(used_memory bytes, number of keys) of the server database: one round trip each."""
        info = self._call("INFO", self._client.info, "memory")
        return int(info["used_memory"]), int(self._call("DBSIZE", self._client.dbsize))

    def tier_stats(self) -> list[TierStats]:
        with self._lock:
            return [replace(self.stats)]


def _redis_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(every error a call may raise, those that mean the server could not be reached or did not answer)."""
    try:
        import redis
    except ImportError:  # a client passed in without the package (tests): socket errors only
        return (OSError,), (OSError,)
    unreachable = (OSError, redis.ConnectionError, redis.TimeoutError)
    return (*unreachable, redis.RedisError), unreachable
