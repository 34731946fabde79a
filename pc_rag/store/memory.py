"""The memory tier: blocks kept as tensors (on whatever device they were put), LRU bounded by bytes."""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

from ..blocks import KVBlock
from .tier import Store, StoreUsageError, TierStats, check_key


class MemoryStore(Store):
    """LRU bounded by bytes (not entries): chunk KV sizes vary by orders of magnitude.

    `ttl_s`: an entry older than this (since its last put) is a miss and is dropped. Blocks are held by
    reference: callers must not modify a block's tensors after putting or getting it.
    """

    name = "memory"
    persistent = False

    def __init__(
        self,
        max_bytes: int = 4 << 30,
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_bytes < 0 or (ttl_s is not None and ttl_s <= 0):
            raise StoreUsageError(f"MemoryStore needs max_bytes >= 0 and ttl_s > 0, got {max_bytes}, {ttl_s}")
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._blocks: OrderedDict[str, tuple[KVBlock, float]] = OrderedDict()  # key -> (block, expiry time)
        self._lock = threading.Lock()
        self.stats = TierStats(self.name)

    def get(self, key: str) -> KVBlock | None:
        check_key(key)
        t0 = time.perf_counter()
        with self._lock:
            entry = self._blocks.get(key)
            if entry is not None and self._clock() >= entry[1]:
                self._drop(key)
                self.stats.evictions += 1
                entry = None
            if entry is None:
                self.stats.misses += 1
                return None
            self._blocks.move_to_end(key)
            self.stats.hits += 1
            self.stats.load_s += time.perf_counter() - t0
            return entry[0]

    def get_many(self, keys: list[str]) -> list[KVBlock | None]:
        return [self.get(key) for key in keys]

    def contains(self, key: str) -> bool:
        """Whether a live entry is held, without counting a hit or a miss or touching the LRU order (the
        prefetcher asks before loading a block from a lower tier)."""
        with self._lock:
            entry = self._blocks.get(key)
            return entry is not None and self._clock() < entry[1]

    def put(self, key: str, block: KVBlock) -> None:
        check_key(key)
        if block.nbytes > self.max_bytes:
            return  # larger than the whole budget: keeping it would evict everything and still not fit
        expiry = math.inf if self.ttl_s is None else self._clock() + self.ttl_s
        with self._lock:
            self._drop(key)
            self._blocks[key] = (block, expiry)
            self.stats.bytes_held += block.nbytes
            while self.stats.bytes_held > self.max_bytes:
                self._drop(next(iter(self._blocks)))
                self.stats.evictions += 1
            self.stats.entries = len(self._blocks)

    def _drop(self, key: str) -> None:
        entry = self._blocks.pop(key, None)
        if entry is not None:
            self.stats.bytes_held -= entry[0].nbytes
            self.stats.entries = len(self._blocks)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.stats.bytes_held = 0
            self.stats.entries = 0

    def tier_stats(self) -> list[TierStats]:
        with self._lock:
            return [replace(self.stats)]
