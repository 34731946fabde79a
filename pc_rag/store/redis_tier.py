"""The Redis tier: blocks shared by several engine processes or machines, as safetensors blobs with a TTL.

The size bound lives in the Redis server, not here: run it with `maxmemory <bytes>` and
`maxmemory-policy allkeys-lru` so that it evicts least recently used blocks when full (see docs/store.md).
Each blob is one string value, so a block must stay under the server's `proto-max-bulk-len` (512 MB
by default).

The `redis` package is optional and imported only when a RedisStore is built. Timeouts are short and
the client never retries: a down or unreachable server costs one failed call of at most `timeout_s`,
after which the tiered store skips this tier for a while.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

from ..blocks import KVBlock
from ..errors import StoreError
from .codec import CorruptBlockError, decode_block, encode_block
from .tier import StoreUsageError, TierStats, check_key


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

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        ttl_s: float | None = 7 * 24 * 3600,
        prefix: str = "pc_rag:",
        timeout_s: float = 0.5,
        client: Any = None,
    ):
        if ttl_s is not None and ttl_s <= 0:
            raise StoreUsageError(f"RedisStore ttl_s must be > 0 or None, got {ttl_s}")
        self.url = url
        self.ttl_s = ttl_s
        self.prefix = prefix
        self._client = client if client is not None else _connect(url, timeout_s)
        self._errors: tuple[type[BaseException], ...] = (OSError, *_redis_errors())
        self._lock = threading.Lock()
        self.stats = TierStats(self.name)

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except self._errors as e:
            with self._lock:
                self.stats.errors += 1
            raise StoreError(f"redis store {self.url}: {what} failed: {type(e).__name__}: {e}") from e

    def get(self, key: str) -> KVBlock | None:
        name = self.prefix + check_key(key)
        t0 = time.perf_counter()
        data = self._call("GET", self._client.get, name)
        if data is None:
            with self._lock:
                self.stats.misses += 1
            return None
        try:
            block = decode_block(key, data)
        except CorruptBlockError:
            self._call("DEL", self._client.delete, name)
            with self._lock:
                self.stats.corrupt += 1
                self.stats.misses += 1
            return None
        with self._lock:
            self.stats.hits += 1
            self.stats.load_s += time.perf_counter() - t0
        return block

    def put(self, key: str, block: KVBlock) -> None:
        name = self.prefix + check_key(key)
        data = encode_block(key, block)
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


def _redis_errors() -> tuple[type[BaseException], ...]:
    try:
        import redis
    except ImportError:
        return ()
    return (redis.RedisError,)
