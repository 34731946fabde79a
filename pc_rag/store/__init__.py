"""Where KV blocks live. Storage knows blocks (tensors + metadata) and string keys, never the model.

The engine calls `get(key) -> KVBlock | None`, `put(key, block)`, `tier_stats()` and `clear()`, and
`get_with_source(store, key)` to learn which tier served a block; `get_many_with_source(store, keys)`
looks up a request's blocks at once (one Redis round trip), `find_many_with_source(store, keys)` does the same
but leaves disk and Redis blocks unread (PendingBlocks, read later by `TieredStore.read_pending` straight into a
request's buffer: a `Sink` names the slots), `put_block(store, key, block, persist=False)`
keeps a block out of persistent tiers, `put_persistent(store, key, block)` puts one only there (the engine's
extents of prefix blocks; lookups take `tiers="volatile"` or `"persistent"` to match),
`TieredStore.set_placement(fn)` places blocks read from lower tiers (e.g. on the engine's device) before they
are promoted, and `TieredStore.prefetch(keys)` loads blocks from the persistent tiers into memory ahead of a
request (pc_rag.prefetch). Build stores with `open_store(spec)`:

    memory.py      MemoryStore: tensors in process memory, LRU bounded by bytes, optional TTL
    disk.py        DiskStore: one safetensors file per block in <dir>/pc_rag-kv-v1/, persistent, LRU bounded
                   by bytes; never touches a file it did not name; reads a request's files in parallel
    redis_tier.py  RedisStore: safetensors blobs in a shared Redis, TTL; the server bounds the size; one
                   pipelined round trip per batch
    tiered.py      TieredStore: tiers top to bottom, read-through promotion, write-through; a failing
                   tier is a miss, never an error (reads and writes paused apart)
    codec.py       block <-> safetensors bytes (exact, or int8 with `compress=int8`), with the key, layout,
                   shape and xxh3 checksum checks done on load
    spec.py        open_store: spec strings ("memory", "disk:/path", "redis://...") and the default
"""

from .codec import CorruptBlockError
from .disk import BLOCKS_DIR, DiskStore, block_files
from .memory import MemoryStore
from .redis_tier import RedisStore
from .spec import default_cache_dir, open_store, parse_bytes
from .tier import (
    PendingBlock,
    Sink,
    Store,
    StoreUsageError,
    TierStats,
    TierUnavailableError,
    check_key,
    find_many_with_source,
    get_many_with_source,
    get_with_source,
    has_persistent,
    put_block,
    put_persistent,
)
from .tiered import TieredStore

__all__ = [
    "BLOCKS_DIR",
    "CorruptBlockError",
    "DiskStore",
    "MemoryStore",
    "PendingBlock",
    "RedisStore",
    "Sink",
    "Store",
    "StoreUsageError",
    "TierStats",
    "TierUnavailableError",
    "TieredStore",
    "block_files",
    "check_key",
    "default_cache_dir",
    "find_many_with_source",
    "get_many_with_source",
    "has_persistent",
    "get_with_source",
    "open_store",
    "parse_bytes",
    "put_block",
    "put_persistent",
]
