"""Where KV blocks live. Storage knows blocks (tensors + metadata) and string keys, never the model.

Every store subclasses `Store` (tier.py), the one interface the engine calls: `get`, `put`, `clear` and
`tier_stats`, which a store must define, and, with defaults built on those, the batch lookups
(`get_many_with_source(keys, tiers=...)`, `find_many_with_source`, which leaves disk and Redis blocks unread as
PendingBlocks for `read_pending` to read straight into a request's buffer: a `ReadTarget` names
the slots),
`where(keys)` (which tier holds each key, reading and counting nothing: `Engine.explain`), `put_volatile` (memory
only) and `put_persistent` (disk and Redis only: the engine's extents of prefix blocks), `promote`, `prefetch`
(pc_rag.prefetch) and `set_device` (TieredStore moves blocks read from lower tiers to the engine's
device, before promoting them). A user's store either subclasses Store or is a plain object with get, put, clear
and tier_stats, seen through the interface by `as_store` (open_store does it). Build stores with
`open_store(spec)`:

    memory.py      MemoryStore: tensors in process memory, bounded by bytes (GDSF or LRU), optional TTL
    disk.py        DiskStore: one safetensors file per block in <dir>/pc_rag-kv-v1/, persistent, LRU bounded
                   by bytes; never touches a file it did not name; reads a request's files in parallel
    redis_tier.py  RedisStore: safetensors blobs in a shared Redis, TTL; the server bounds the size; one
                   pipelined round trip per batch
    redis_cluster.py  RedisClusterStore: the Redis tier over a Redis Cluster or Valkey cluster: keys split by
                   hash slot, one RedisStore (pipeline, deadline) per master, read in parallel; a node down is
                   misses for its slots
    tiered.py      TieredStore: tiers top to bottom, read-through promotion, write-through; a failing
                   tier is a miss, never an error (reads and writes paused apart)
    codec.py       block <-> safetensors bytes (exact, or int8 with `compress=int8`), with the key, layout,
                   shape and xxh3 checksum checks done on load
    spec.py        open_store: spec strings ("memory", "disk:/path", "redis://...") and the default
"""

from .codec import CorruptBlockError
from .disk import BLOCKS_DIR, DiskStore, block_files
from .memory import MemoryStore
from .redis_cluster import RedisClusterStore
from .redis_tier import RedisStore
from .spec import default_cache_dir, disk_folder, open_store, parse_bytes
from .tier import (
    ForeignStore,
    Held,
    PendingBlock,
    ReadTarget,
    Store,
    StoreUsageError,
    TierStats,
    TierUnavailableError,
    as_store,
    check_key,
)
from .tiered import TieredStore

__all__ = [
    "BLOCKS_DIR",
    "CorruptBlockError",
    "DiskStore",
    "ForeignStore",
    "Held",
    "MemoryStore",
    "PendingBlock",
    "ReadTarget",
    "RedisClusterStore",
    "RedisStore",
    "Store",
    "StoreUsageError",
    "TierStats",
    "TierUnavailableError",
    "TieredStore",
    "as_store",
    "block_files",
    "check_key",
    "default_cache_dir",
    "disk_folder",
    "open_store",
    "parse_bytes",
]
