"""What every tier is: the calls the engine makes, per-tier counters, and the checks on keys and blocks."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..blocks import KVBlock
from ..errors import PCRagError

# Keys come from `blocks.chunk_key` / `prefix_key` ("chunk-<40 hex>"). Disk file names and Redis names are
# built from them, so only letters, digits, '-' and '_' are allowed: no '/', no '.', nothing that could
# name a path outside the cache directory.
KEY_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,199}")


class StoreUsageError(PCRagError, ValueError):
    """The store was called wrongly (bad spec string, key or block); unlike a tier failure this is raised."""


@dataclass
class TierStats:
    name: str
    hits: int = 0
    misses: int = 0
    bytes_held: int = 0
    entries: int = 0
    evictions: int = 0  # LRU evictions and TTL expiries
    corrupt: int = 0  # corrupt, truncated or foreign entries found (and removed) on load
    errors: int = 0  # failed operations (I/O error, server down); each was treated as a miss by TieredStore
    load_s: float = 0.0  # total time spent in get() calls that hit


@runtime_checkable
class Store(Protocol):
    """What the engine calls. Every tier and the tiered composition implement it."""

    name: str

    def get(self, key: str) -> KVBlock | None: ...

    def put(self, key: str, block: KVBlock) -> None: ...

    def clear(self) -> None: ...

    def tier_stats(self) -> list[TierStats]: ...


def get_with_source(store: Store, key: str) -> tuple[KVBlock | None, str | None]:
    """The block and the name of the tier that served it, for any store: a TieredStore says which of its
    tiers hit; a single tier answers with its own name."""
    if hasattr(store, "get_with_source"):
        return store.get_with_source(key)
    block = store.get(key)
    return block, (store.name if block is not None else None)


def check_key(key: str) -> str:
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        raise StoreUsageError(
            f"invalid store key {key!r}: keys are 1-200 characters of letters, digits, '-' and '_' "
            "starting with a letter or digit; build them with pc_rag.blocks.chunk_key or prefix_key"
        )
    return key


def check_block(block: KVBlock) -> KVBlock:
    if not isinstance(block, KVBlock):
        raise StoreUsageError(f"store.put expects a KVBlock, got {type(block).__name__}")
    k, v = block.keys, block.values
    if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype:
        raise StoreUsageError(
            f"KVBlock keys and values must both be [layers, kv_heads, tokens, head_dim] with one dtype; "
            f"got keys {tuple(k.shape)} {k.dtype}, values {tuple(v.shape)} {v.dtype}"
        )
    if k.shape[2] != len(block.token_ids):
        raise StoreUsageError(
            f"KVBlock holds {k.shape[2]} tokens of KV but {len(block.token_ids)} token ids"
        )
    return block
