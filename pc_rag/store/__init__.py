"""Where KV blocks live. Storage knows blocks (tensors + metadata) and string keys, never the model.

The engine calls `get(key) -> KVBlock | None`, `put(key, block)`, `tier_stats()` and `clear()`, and
`get_with_source(store, key)` to learn which tier served a block. Build stores with
`open_store(spec)`:

    memory.py      MemoryStore: tensors in process memory, LRU bounded by bytes, optional TTL
    disk.py        DiskStore: one safetensors file per block, persistent, LRU bounded by bytes
    redis_tier.py  RedisStore: safetensors blobs in a shared Redis, TTL; the server bounds the size
    tiered.py      TieredStore: tiers top to bottom, read-through promotion, write-through; a failing
                   tier is a miss, never an error
    codec.py       block <-> safetensors bytes, with the key, shape and checksum checks done on load
    spec.py        open_store: spec strings ("memory", "disk:/path", "redis://...") and the default
"""

from .codec import CorruptBlockError
from .disk import DiskStore
from .memory import MemoryStore
from .redis_tier import RedisStore
from .spec import default_cache_dir, open_store, parse_bytes
from .tier import Store, StoreUsageError, TierStats, check_key, get_with_source
from .tiered import TieredStore

__all__ = [
    "CorruptBlockError",
    "DiskStore",
    "MemoryStore",
    "RedisStore",
    "Store",
    "StoreUsageError",
    "TierStats",
    "TieredStore",
    "check_key",
    "default_cache_dir",
    "get_with_source",
    "open_store",
    "parse_bytes",
]
