"""Where KV blocks live. Storage knows blocks (tensors + metadata) and string keys, never the model.

The engine needs two calls: `get(key) -> KVBlock | None` and `put(key, block)`. A tier that fails must
behave as a miss, never fail the request.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from .blocks import KVBlock


@dataclass
class TierStats:
    name: str
    hits: int = 0
    misses: int = 0
    bytes_held: int = 0
    entries: int = 0
    evictions: int = 0
    corrupt: int = 0
    errors: int = 0
    load_s: float = 0.0


class MemoryStore:
    """LRU bounded by bytes (not entries): chunk KV sizes vary by orders of magnitude."""

    def __init__(self, max_bytes: int = 4 << 30):
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[str, KVBlock] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = TierStats("memory")

    def get(self, key: str) -> KVBlock | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is None:
                self.stats.misses += 1
                return None
            self._blocks.move_to_end(key)
            self.stats.hits += 1
            return block

    def put(self, key: str, block: KVBlock) -> None:
        if block.nbytes > self.max_bytes:
            return  # larger than the whole budget: keeping it would evict everything and still not fit
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self.stats.bytes_held -= old.nbytes
            self._blocks[key] = block
            self.stats.bytes_held += block.nbytes
            while self.stats.bytes_held > self.max_bytes:
                _, evicted = self._blocks.popitem(last=False)
                self.stats.bytes_held -= evicted.nbytes
                self.stats.evictions += 1
            self.stats.entries = len(self._blocks)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.stats.bytes_held = 0
            self.stats.entries = 0

    def tier_stats(self) -> list[TierStats]:
        return [self.stats]
