"""What every tier is: the calls the engine makes, per-tier counters, and the checks on keys and blocks."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

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


log = logging.getLogger("pc_rag.store")


class StoreUsageError(PCRagError, ValueError):
    """The store was called wrongly (bad spec string, key or block); unlike a tier failure this is raised."""


class TierUnavailableError(StoreError):
    """The whole tier is unreachable (server down or not answering, cache folder not a folder): TieredStore
    then skips it for reads and writes alike, where a plain StoreError pauses only the failing direction."""


READ, WRITE = "reads", "writes"
_DIRECTION = {"get": READ, "put": WRITE, "clear": WRITE}


class Pauses:
    """The rule that a failing part of a store is skipped for a while, reads and writes apart: per part (a tier of a
    TieredStore, a node of a Redis Cluster) and direction, when to try again. A TierUnavailableError pauses both
    directions (nothing answers), any other failure only the direction that failed (a full disk still serves
    reads). The first failure of each direction logs one warning on the "pc_rag.store" logger, recovery one info
    line."""

    def __init__(self, retry_after_s: float, what: str = "store tier"):
        self.retry_after_s = retry_after_s
        self.what = what  # how the log names a part: "store tier 'redis'", "redis cluster node '10.0.0.3:6379'"
        self._retry_at: dict[Hashable, dict[str, float]] = {}  # part -> {direction: retry at}; absent while working
        self._lock = threading.Lock()

    def usable(self, part: Hashable, direction: str) -> bool:
        until = self._retry_at.get(part, {}).get(direction)
        return until is None or time.monotonic() >= until

    def failed(self, part: Hashable, label: str, op: str, e: Exception) -> None:
        directions = (READ, WRITE) if isinstance(e, TierUnavailableError) else (_DIRECTION[op],)
        retry_at = time.monotonic() + self.retry_after_s
        with self._lock:
            paused = self._retry_at.setdefault(part, {})
            newly_down = [d for d in directions if d not in paused]
            for d in directions:
                paused[d] = retry_at
        if newly_down:
            log.warning(
                "%s %r failed on %s (%s: %s); its %s are treated as misses, retrying every %.1f s",
                self.what, label, op, type(e).__name__, e, " and ".join(newly_down), self.retry_after_s,
            )
        else:
            log.debug("%s %r still failing on %s: %s", self.what, label, op, e)

    def succeeded(self, part: Hashable, label: str, direction: str) -> None:
        if direction not in self._retry_at.get(part, {}):
            return
        with self._lock:
            was_down = self._retry_at.get(part, {}).pop(direction, None) is not None
        if was_down:
            log.info("%s %r: %s work again", self.what, label, direction)

    def clear(self) -> None:
        """Ends every pause: each part is tried on the next call."""
        with self._lock:
            self._retry_at.clear()


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
class ReadTarget:
    """Where `read_into` hands a block it read for the caller (the tiers' read calls name it a sink):
    `take(block) -> bool` (True: used). `keys` and `values`, when given, are where the block belongs: CPU tensors
    [L, H_kv, T, D] whose [T, D] planes are each contiguous (a request buffer's slots). A block stored bit-exact in
    their shape and dtype is then read from its file straight into them, verified there, and the block `take` gets
    views them: nothing is left to copy. A compressed block of their shape and dtype is verified where it was read
    (a staging buffer, a Redis reply) and dequantized straight into them, and the block `take` gets views them too.
    (If a block fails its checks they may hold garbage, and `take` is not called.) Any other block (of another
    dtype or shape) views a staging buffer or the reply, and `take` copies it."""

    take: Callable[[KVBlock], bool]
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def slots(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(keys, values) when the sink names both, for reading or decoding into; else None."""
        return None if self.keys is None or self.values is None else (self.keys, self.values)

    @staticmethod
    def of(sink: ReadTarget | Callable[[KVBlock], bool]) -> ReadTarget:
        """A ReadTarget, or a plain `take(block) -> bool` made one (with no slots)."""
        return sink if isinstance(sink, ReadTarget) else ReadTarget(sink)



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


TIERS = ("all", "volatile", "persistent")


@dataclass(frozen=True)
class Held:
    """Where a store holds a key, as `Store.where` answers without reading it: the tier's name, and whether that tier
    reads blocks straight into a caller's buffer (`read_pending`) rather than into memory of their own."""

    tier: str
    in_place: bool = False


class Store:
    """The one store interface: every tier (memory, disk, Redis), their composition (`TieredStore`) and a user's
    own store subclass it. A store must define `get`, `put` and `clear`; every other method has a default built on
    those, which a tier overrides where it can do better (one round trip for many keys, a read straight into a
    request buffer, a lookup that reads nothing). So what a store can do is read from its class, not discovered.

    A user's store may also be a plain object with `get`, `put`, `clear` and `tier_stats` (and a `name`) that does
    not subclass Store: `as_store` wraps it in a `ForeignStore`, which uses the object's own methods of this
    interface where it has them and these defaults for the rest (`open_store` and `TieredStore` do this).

    Class attributes a tier sets: `name` (reported as the origin of the blocks it serves), `persistent` (it
    outlives the process: disk, Redis) and `reads_in_place` (`locate` and `read_into` read blocks straight into a
    caller's buffer: disk, Redis).
    """

    name: str = "store"
    persistent: bool = False
    reads_in_place: bool = False

    # ---- what every store defines -------------------------------------------------------------------------
    def get(self, key: str) -> KVBlock | None:
        raise NotImplementedError(f"{type(self).__name__} must define get(key)")

    def put(self, key: str, block: KVBlock) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define put(key, block)")

    def clear(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define clear()")

    def tier_stats(self) -> list[TierStats]:
        """One TierStats per tier (none by default: a store that counts nothing)."""
        return []

    # ---- lookups ----------------------------------------------------------------------------------------------
    def get_many(self, keys: list[str]) -> list[KVBlock | None]:
        """The blocks of `keys`, in order (None for a miss): one `get` per key unless a tier batches them."""
        return [self.get(key) for key in keys]

    def get_with_source(self, key: str) -> tuple[KVBlock | None, str | None]:
        """The block and the name of the tier that served it; a store of one tier answers with its own name."""
        block = self.get(key)
        return block, (self.name if block is not None else None)

    def get_many_with_source(self, keys: Sequence[str],
                             tiers: str = "all") -> list[tuple[KVBlock | None, str | None]]:
        """`get_with_source` for a request's keys at once, in order. `tiers`: "all", or only the tiers that do not
        outlive the process ("volatile": memory) or those that do ("persistent": disk, Redis); a store of one tier
        is that kind of tier, by its `persistent` attribute, and answers all misses when it is not of the kind
        asked."""
        keys = list(keys)
        if not self._of_kind(tiers):
            return [(None, None)] * len(keys)
        return [(b, self.name if b is not None else None) for b in self.get_many(keys)]

    def find_many_with_source(self, keys: Sequence[str],
                              tiers: str = "all") -> list[tuple[KVBlock | PendingBlock | None, str | None]]:
        """`get_many_with_source`, except that blocks a tier can read straight into the caller's memory come back
        unread, as PendingBlocks for `read_pending` (TieredStore over disk or Redis). By default every block is read."""
        return self.get_many_with_source(keys, tiers)

    def contains(self, key: str) -> bool:
        """Whether a live entry is held, without reading it, counting a hit or a miss, or touching any order. The
        default answers False (a store that cannot tell without reading): a prefetch then loads the block anyway
        and `Engine.explain` reports a miss."""
        return False

    def where(self, keys: Sequence[str], tiers: str = "all") -> list[Held | None]:
        """Which tier holds each key (None: none), by `contains`: nothing is read, counted, promoted or waited for
        (`Engine.explain` asks this)."""
        keys = list(keys)
        if not self._of_kind(tiers):
            return [None] * len(keys)
        return [Held(self.name, self.reads_in_place) if self.contains(key) else None for key in keys]

    @property
    def has_persistent(self) -> bool:
        """Whether the store outlives the process, in part (a TieredStore with a disk or Redis tier) or whole."""
        return self.persistent

    def _of_kind(self, tiers: str) -> bool:
        if tiers not in TIERS:
            raise StoreUsageError(f"unknown tiers {tiers!r}; choose one of {', '.join(TIERS)}")
        return tiers == "all" or (tiers == "persistent") == self.persistent

    # ---- reads into a caller's memory -------------------------------------------------------------------------
    def locate(self, keys: list[str]) -> list[bool]:
        """Whether each key may be read by `read_into` (a tier that reads in place answers without reading)."""
        return [b is not None for b in self.get_many(keys)]

    def read_into(self, keys: list[str], sinks: list[ReadTarget | Callable[[KVBlock], bool]]) -> list[bool]:
        """Reads each block and hands it to its sink (`take(block) -> bool`, True: taken); per key, whether it was
        taken. By default the block is read into memory of its own first (a tier with `reads_in_place` reads it
        into the sink's slots)."""
        return [b is not None and bool(ReadTarget.of(s).take(b))
                for b, s in zip(self.get_many(keys), sinks, strict=True)]

    def read_pending(self, pending: Sequence[PendingBlock], sinks: Sequence) -> list[bool]:
        """`read_into` for the PendingBlocks `find_many_with_source` answered."""
        return self.read_into([p.key for p in pending], list(sinks))

    def reread(self, keys: list[str]) -> list[KVBlock | None]:
        """`get_many` for blocks already served once (`read_into`), wanted in memory of their own: a tier that
        counts its reads does not count these again."""
        return self.get_many(keys)

    def promote(self, pending: Sequence[PendingBlock]) -> None:
        """Puts blocks `read_pending` served into the tiers above theirs; a store of one tier has none."""

    # ---- writes -----------------------------------------------------------------------------------------------
    def put_volatile(self, key: str, block: KVBlock) -> None:
        """`key` into the tiers that do not outlive the process only (a block only this process's index can find);
        a persistent store used alone skips it."""
        if not self.persistent:
            self.put(key, block)

    def put_persistent(self, key: str, block: KVBlock) -> None:
        """`key` into the persistent tiers only (the engine's extents of prefix blocks, whose single blocks memory
        keeps); the engine asks this only of a store with `has_persistent`."""
        if self.persistent:
            self.put(key, block)

    # ---- ahead of a request -----------------------------------------------------------------------------------
    @property
    def can_prefetch(self) -> bool:
        """True when `prefetch` can bring blocks closer (memory over disk or Redis: a TieredStore)."""
        return False

    def prefetch(self, keys: Sequence[str]) -> int:
        """Loads the blocks of `keys` from the persistent tiers into memory; returns how many were brought up."""
        return 0

    def set_device(self, device) -> None:
        """The device blocks read from a lower tier are moved to before they are promoted (TieredStore); a store of
        one tier moves nothing."""


class ForeignStore(Store):
    """A user's store object that does not subclass Store (duck-typed: get, put, clear, tier_stats, name), seen
    through the Store interface: its own `get_many`, `contains`, `persistent` and `name` where it has them, the
    defaults for the rest. Other attributes are read from the object itself."""

    def __init__(self, inner):
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)
        self.persistent = bool(getattr(inner, "persistent", False))

    def get(self, key: str) -> KVBlock | None:
        return self.inner.get(key)

    def put(self, key: str, block: KVBlock) -> None:
        self.inner.put(key, block)

    def clear(self) -> None:
        self.inner.clear()

    def tier_stats(self) -> list[TierStats]:
        return list(self.inner.tier_stats())

    def get_many(self, keys: list[str]) -> list[KVBlock | None]:
        own = getattr(self.inner, "get_many", None)
        if own is None:
            return super().get_many(keys)
        blocks = list(own(keys))
        if len(blocks) != len(keys):
            raise StoreError(f"store {self.name!r}: get_many returned {len(blocks)} results for {len(keys)} keys")
        return blocks

    def contains(self, key: str) -> bool:
        own = getattr(self.inner, "contains", None)
        return bool(own(key)) if own is not None else False

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (copy, pickle): never recurse
            raise AttributeError(name)
        return getattr(self.inner, name)


STORE_METHODS = ("get", "put", "clear", "tier_stats")


def as_store(store) -> Store:
    """`store` itself when it subclasses Store, else the object wrapped in a ForeignStore."""
    return store if isinstance(store, Store) else ForeignStore(store)


def looks_like_store(obj) -> bool:
    """Whether `obj` has the calls every store has (a Store subclass or a duck-typed one)."""
    return isinstance(obj, Store) or all(callable(getattr(obj, m, None)) for m in STORE_METHODS)


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
