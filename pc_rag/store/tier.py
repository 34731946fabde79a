"""What every tier is: the calls the engine makes, per-tier counters, and the checks on keys and blocks."""

from __future__ import annotations

import inspect
import json
import os
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..blocks import KVBlock
from ..errors import PCRagError, StoreError

# Keys come from `blocks.chunk_key` / `prefix_key` ("chunk-<40 hex>"). Disk file names and Redis names are
# built from them, so only letters, digits, '-' and '_' are allowed: no '/', no '.', nothing that could
# name a path outside the cache directory.
KEY_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,199}")

# KVBlock.meta travels in the safetensors header, which readers refuse above codec.MAX_HEADER_BYTES (1 MiB);
# the engine's meta is a few short strings.
MAX_META_BYTES = 64 << 10


class StoreUsageError(PCRagError, ValueError):
    """The store was called wrongly (bad spec string, key or block); unlike a tier failure this is raised."""


class TierUnavailableError(StoreError):
    """The whole tier is unreachable (server down or not answering, cache folder not a folder): TieredStore
    then skips it for reads and writes alike, where a plain StoreError pauses only the failing direction."""


@dataclass
class TierStats:
    name: str
    hits: int = 0
    misses: int = 0
    bytes_held: int = 0
    entries: int = 0
    evictions: int = 0  # LRU evictions and TTL expiries
    corrupt: int = 0  # corrupt, truncated, foreign or wrong-type entries found (and removed) on load
    errors: int = 0  # failed operations (I/O error, server down); each was treated as a miss by TieredStore
    load_s: float = 0.0  # total time spent in get() calls that hit (wall time of each call)
    # Persistent tiers: where load time goes, summed over the blocks read (in parallel, so the sum can exceed
    # load_s): finding and opening the entry and checking its header (disk) or the round trip (Redis),
    # reading the bytes, verifying them (checksum, shapes), dequantizing compressed blocks.
    open_s: float = 0.0
    read_s: float = 0.0
    verify_s: float = 0.0
    decode_s: float = 0.0
    copy_s: float = 0.0  # reads straight into a caller's buffer (`read_into`): copying verified blocks there
    bytes_read: int = 0  # stored bytes of the blocks served


def add_time(timings: dict[str, float] | None, step: str, seconds: float) -> None:
    """Adds `seconds` to `timings[step]` (a TierStats field name), if timings are kept."""
    if timings is not None:
        timings[step] = timings.get(step, 0.0) + seconds


@dataclass(frozen=True)
class PendingBlock:
    """A block a tier holds but has not read yet (`TieredStore.find_many_with_source`): `read_pending` reads it
    straight into the caller's memory, e.g. a request buffer, instead of into fresh memory of its own."""

    key: str
    tier: str  # the name of the tier holding it ("disk", "redis")
    tier_index: int  # its place in the TieredStore


@dataclass(frozen=True)
class Sink:
    """Where `read_into` hands a block it read for the caller: `take(block) -> bool` (True: used). `keys` and
    `values`, when given, are where the block belongs: CPU tensors [L, H_kv, T, D] whose [T, D] planes are each
    contiguous (a request buffer's slots). A block stored bit-exact in their shape and dtype is then read from its
    file straight into them, verified there, and the block `take` gets views them: nothing is left to copy. A
    compressed block of their shape and dtype is verified where it was read (a staging buffer, a Redis reply) and
    dequantized straight into them, and the block `take` gets views them too. (If a block fails its checks they may
    hold garbage, and `take` is not called.) Any other block (of another dtype or shape) views a staging buffer or
    the reply, and `take` copies it."""

    take: Callable[[KVBlock], bool]
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def slots(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(keys, values) when the sink names both, for reading or decoding into; else None."""
        return None if self.keys is None or self.values is None else (self.keys, self.values)

    @staticmethod
    def of(sink: Sink | Callable[[KVBlock], bool]) -> Sink:
        """A Sink, or a plain `take(block) -> bool` made one (with no slots)."""
        return sink if isinstance(sink, Sink) else Sink(sink)


# A request's blocks are read and decoded in parallel: file reads, zstd and the xxh3 checksum release the GIL.
# One pool for every tier of the process, started on first use.
_READERS: ThreadPoolExecutor | None = None
_READERS_LOCK = threading.Lock()
READER_THREADS = min(8, os.cpu_count() or 1)


def _readers() -> ThreadPoolExecutor:
    global _READERS
    with _READERS_LOCK:
        if _READERS is None:
            _READERS = ThreadPoolExecutor(max_workers=READER_THREADS, thread_name_prefix="pc_rag-read")
        return _READERS


def in_parallel(load: Callable, items: list) -> list:
    """`[load(*item) for item in items]`, spread over the reader threads: one interleaved share of the items per
    thread (a task per item cost more than it saved for the 32-token prefix blocks of exact mode, measured)."""
    workers = min(READER_THREADS, len(items))
    if workers <= 1:
        return [load(*item) for item in items]
    shares = list(_readers().map(lambda i: [load(*item) for item in items[i::workers]], range(workers)))
    out = [None] * len(items)
    for i, share in enumerate(shares):
        out[i::workers] = share
    return out


@runtime_checkable
class Store(Protocol):
    """What the engine calls. Every tier and the tiered composition implement it.

    Optional, used when present: `get_many(keys)` (one call for a request's blocks), `get_with_source`,
    `get_many_with_source`, a `persist` argument to `put`, and a `persistent` class attribute (True for
    tiers that outlive the process: disk, Redis). Reads into the caller's memory: a store with
    `find_many_with_source` and `read_pending` (TieredStore), over tiers with `locate(keys) -> [bool]` and
    `read_into(keys, sinks) -> [bool]` (DiskStore).
    """

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


TIERS = ("all", "volatile", "persistent")


def get_many_with_source(store: Store, keys: Sequence[str],
                         tiers: str = "all") -> list[tuple[KVBlock | None, str | None]]:
    """`get_with_source` for a request's keys at once, in order: a TieredStore asks each tier once for all the
    keys still missing (one Redis round trip for the whole request); a single tier with `get_many` is asked
    once; any other store is asked key by key. `tiers`: "all", or only the tiers that do not outlive the process
    ("volatile": memory) or those that do ("persistent": disk, Redis); a store of one tier is that kind of tier,
    by its `persistent` attribute, and answers all misses when it is not of the kind asked."""
    keys = list(keys)
    if hasattr(store, "get_many_with_source"):
        return store.get_many_with_source(keys, tiers) if tiers != "all" else store.get_many_with_source(keys)
    if not _of_kind(store, tiers):
        return [(None, None)] * len(keys)
    if hasattr(store, "get_many"):
        blocks = get_many(store, keys)
        return [(b, store.name if b is not None else None) for b in blocks]
    return [get_with_source(store, key) for key in keys]


def find_many_with_source(store: Store, keys: Sequence[str],
                          tiers: str = "all") -> list[tuple[KVBlock | PendingBlock | None, str | None]]:
    """`get_many_with_source`, except that a store able to read blocks straight into the caller's memory (a
    TieredStore over a disk or Redis tier) answers PendingBlocks for the blocks it would read from such a tier,
    for its `read_pending`. Any other store answers as `get_many_with_source`."""
    if hasattr(store, "find_many_with_source"):
        return store.find_many_with_source(list(keys), tiers) if tiers != "all" else store.find_many_with_source(
            list(keys))
    return get_many_with_source(store, keys, tiers)


def _of_kind(store: Store, tiers: str) -> bool:
    if tiers not in TIERS:
        raise StoreUsageError(f"unknown tiers {tiers!r}; choose one of {', '.join(TIERS)}")
    return tiers == "all" or (tiers == "persistent") == bool(getattr(store, "persistent", False))


def has_persistent(store: Store) -> bool:
    """Whether the store outlives the process in part (a TieredStore with a disk or Redis tier) or whole (such a
    tier alone)."""
    return bool(getattr(store, "has_persistent", getattr(store, "persistent", False)))


def get_many(store: Store, keys: list[str]) -> list[KVBlock | None]:
    """`store.get_many(keys)` when the store has it, else one `get` per key; always one result per key."""
    if not hasattr(store, "get_many"):
        return [store.get(key) for key in keys]
    blocks = list(store.get_many(keys))
    if len(blocks) != len(keys):
        raise StoreError(f"store {store.name!r}: get_many returned {len(blocks)} results for {len(keys)} keys")
    return blocks


def put_block(store: Store, key: str, block: KVBlock, persist: bool = True) -> None:
    """`store.put(key, block, persist=persist)` when the store takes `persist` (TieredStore); otherwise a plain
    `store.put(key, block)`, skipped when `persist` is False and the store is itself persistent (a disk or
    Redis tier used alone). persist=False: the block may be kept in memory but must not outlive the process."""
    if _takes_persist(store):
        store.put(key, block, persist=persist)
    elif persist or not getattr(store, "persistent", False):
        store.put(key, block)


def put_persistent(store: Store, key: str, block: KVBlock) -> None:
    """`key` into the store's persistent tiers only (TieredStore.put_persistent), or into a store of one tier as it
    is (the caller only asks this of stores with `has_persistent`)."""
    if hasattr(store, "put_persistent"):
        store.put_persistent(key, block)
    else:
        store.put(key, block)


def _takes_persist(store: Store) -> bool:
    try:
        params = inspect.signature(store.put).parameters
    except (TypeError, ValueError):  # a builtin or C-implemented put without a signature
        return False
    return "persist" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


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
    meta_bytes = len(json.dumps(block.meta, sort_keys=True, default=str))
    if meta_bytes > MAX_META_BYTES:
        raise StoreUsageError(
            f"KVBlock.meta is {meta_bytes} bytes of JSON, more than {MAX_META_BYTES}: keep meta to a few short "
            "strings (it is stored in every block's header)"
        )
    return block
