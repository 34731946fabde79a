"""Tiers composed top to bottom (memory over disk over Redis), and the rule that a failing tier is a miss.

get: asks each tier in order; a hit in a lower tier is put into every tier above it (read-through
promotion). `get_many_with_source` does the same for a request's keys at once, asking each tier once for
the keys still missing. put: writes every tier (write-through); `persist=False` writes only the tiers that
do not outlive the process (memory).

A tier that raises is skipped for `retry_after_s`, reads and writes apart: a full or read-only disk still
serves the blocks it holds, and a tier whose reads fail may still take writes. A TierUnavailableError (Redis
down, the cache folder not a folder) pauses both. The first failure of each direction logs one warning on
the "pc_rag.store" logger, recovery logs one info line. No request fails because a tier failed.

`set_device(device)`: blocks decoded from a persistent tier are CPU tensors; each block that did not come from a
non-persistent top tier is moved to `device` (the engine's) once, before it is promoted and returned, so the memory
tier holds blocks where they are used and the next hit needs no move.

`find_many_with_source(keys)` and `read_pending(pending, sinks)`: as `get_many_with_source`, except that a
tier able to read a block straight into the caller's memory (disk and Redis: `locate`, `read_into`) is only asked
whether it holds each key; its blocks come back as PendingBlocks, which `read_pending` later reads into the caller's
buffer (the engine: the request's KV buffer), so a request's disk blocks need no memory of their own. Nothing is
promoted: the caller decides what to keep (the engine puts such blocks in memory after the reply, with
`promote(pending)`, which reads them again without counting them twice).

Lookups can be limited to the tiers that do not outlive the process (`tiers="volatile"`: memory) or to those that
do (`tiers="persistent"`), and `put_persistent` writes only the latter: the engine keeps an exact prefix's single
blocks in memory and groups of them (extents, pc_rag.prefix) in the persistent tiers.

`prefetch(keys)`: loads blocks from the persistent tiers into the non-persistent ones above them (memory)
without returning them, for a background thread that knows a request is coming (pc_rag.prefetch: documents a
retriever just returned). A request that asks for a key a prefetch is loading waits for that load (at most
`prefetch_wait_s`) instead of reading the same bytes again, then finds the block in memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import torch

from ..blocks import KVBlock
from ..errors import StoreError
from .tier import (
    READ,
    TIERS,
    WRITE,
    Held,
    Pauses,
    PendingBlock,
    Store,
    StoreUsageError,
    TierStats,
    as_store,
    check_block,
    check_key,
)

log = logging.getLogger("pc_rag.store")

class TieredStore(Store):
    name = "tiered"

    def __init__(self, tiers: Sequence[Store], retry_after_s: float = 5.0):
        if not tiers:
            raise StoreUsageError("TieredStore needs at least one tier")
        self.tiers = [as_store(t) for t in tiers]  # a user's duck-typed tier is seen through the Store interface
        self._pauses = Pauses(retry_after_s)  # per tier index and direction
        self._lock = threading.Lock()
        self._device: torch.device | None = None
        self._loading: dict[str, threading.Event] = {}  # keys a prefetch is loading -> set when done
        self.prefetch_wait_s = 2.0

    def set_device(self, device: torch.device | str | None) -> None:
        """Where blocks read from a tier below the top (or from a top tier that is persistent: a disk or Redis store
        used alone) are moved before they are promoted and returned: the device their reader computes on (None:
        left where they are read, the CPU). Persistent upper tiers are given the block as read."""
        self._device = None if device is None else torch.device(device)

    def get(self, key: str) -> KVBlock | None:
        return self.get_with_source(key)[0]

    def get_many(self, keys: list[str]) -> list[KVBlock | None]:
        return [block for block, _ in self.get_many_with_source(keys)]

    def contains(self, key: str) -> bool:
        return self.where([key])[0] is not None

    def get_with_source(self, key: str) -> tuple[KVBlock | None, str | None]:
        """The block and the name of the tier that served it ("memory", "disk", "redis"), or (None, None)."""
        return self.get_many_with_source([key])[0]

    def get_many_with_source(self, keys: Sequence[str], tiers: str = "all") -> list[tuple[KVBlock | None, str | None]]:
        """(block, tier name) or (None, None) for each key, in order. Each tier is asked once, for the keys
        no tier above it had (one Redis round trip per request); a key repeated in `keys` is looked up once.
        `tiers`: "all", or only the "volatile" tiers (memory) or the "persistent" ones (disk, Redis): the engine
        asks memory for single prefix blocks and the persistent tiers for the groups they hold them in."""
        return self._answer(keys, pending=False, tiers=tiers)

    def find_many_with_source(self, keys: Sequence[str],
                              tiers: str = "all") -> list[tuple[KVBlock | PendingBlock | None, str | None]]:
        """As `get_many_with_source`, but a key held by a tier that can read into the caller's memory (disk) comes
        back as a PendingBlock (not read, not promoted), for `read_pending`."""
        return self._answer(keys, pending=True, tiers=tiers)

    def _answer(self, keys: Sequence[str], pending: bool,
                tiers: str = "all") -> list[tuple[KVBlock | PendingBlock | None, str | None]]:
        keys = [check_key(k) for k in keys]
        first, end = self._range(tiers)
        self._wait_for_prefetch(keys)
        found = self._lookup(list(dict.fromkeys(keys)), first, pending=pending, end=end)
        return [found.get(key, (None, None)) for key in keys]

    def _range(self, tiers: str) -> tuple[int, int | None]:
        """The tiers a lookup limited to `tiers` asks: (first, end excluded)."""
        if tiers not in TIERS:
            raise StoreUsageError(f"unknown tiers {tiers!r}; choose one of {', '.join(TIERS)}")
        top = self._volatile_top()
        return {"all": (0, None), "volatile": (0, top), "persistent": (top, None)}[tiers]

    def where(self, keys: Sequence[str], tiers: str = "all") -> list[Held | None]:
        """Which tier holds each key, the first from the top (the one a lookup would read), by each tier's `where`:
        nothing is read, counted, promoted or waited for, and a tier that fails here is a miss (not paused)."""
        keys = [check_key(k) for k in keys]
        first, end = self._range(tiers)
        out: list[Held | None] = [None] * len(keys)
        for i, tier in enumerate(self.tiers[first:end], start=first):
            missing = [j for j, held in enumerate(out) if held is None]
            if not missing:
                break
            if not self._usable(i, READ):
                continue
            try:
                answers = tier.where([keys[j] for j in missing])
            except Exception:  # explaining a request must not fail, nor pause the tier, where a lookup would miss
                continue
            for j, held in zip(missing, answers, strict=True):
                out[j] = held
        return out

    @property
    def has_persistent(self) -> bool:
        """True when some tier outlives the process (disk, Redis)."""
        return self._volatile_top() < len(self.tiers)

    def read_pending(self, pending: Sequence[PendingBlock], sinks: Sequence) -> list[bool]:
        """Reads each pending block and hands it to its sink, `sink(block) -> bool` (True: taken), in the tier's
        reader threads; the block's tensors are valid only during that call (see DiskStore.read_into). Returns,
        per block, whether its sink took it. A block gone or damaged since it was found is False, counted by
        its tier as a miss (and corrupt); a failing tier is False for the blocks it could not read, counted
        and paused as in `get`. What a sink raises propagates."""
        taken = [False] * len(pending)
        by_tier: dict[int, list[int]] = {}
        for j, p in enumerate(pending):
            by_tier.setdefault(p.tier_index, []).append(j)
        for i, js in by_tier.items():
            if not self._usable(i, READ):
                continue
            try:
                got = self.tiers[i].read_into([pending[j].key for j in js], [sinks[j] for j in js])
            except StoreError as e:  # the tier failed (a sink's own error is not a StoreError: it propagates)
                self._failed(i, "get", e)
                got = getattr(e, "loaded", None) or [False] * len(js)
            else:
                self._succeeded(i, READ)
            for j, ok in zip(js, got, strict=True):
                taken[j] = ok
        return taken

    def promote(self, pending: Sequence[PendingBlock]) -> None:
        """Reads blocks that `read_pending` already served into a caller's buffer again, into memory of their own
        (from the page cache by then), and puts them into the tiers above theirs: not counted twice as lookups.
        A tier that fails is skipped, as for any read."""
        by_tier: dict[int, list[str]] = {}
        for p in pending:
            by_tier.setdefault(p.tier_index, []).append(p.key)
        for i, keys in by_tier.items():
            tier = self.tiers[i]
            if not self._usable(i, READ):
                continue
            keys = list(dict.fromkeys(keys))
            try:
                blocks = tier.reread(keys)
            except Exception as e:
                self._failed(i, "get", e)
                continue
            for key, block in zip(keys, blocks, strict=True):
                if block is not None:
                    self._place_and_promote(i, key, block)

    def _lookup(self, missing: list[str], first: int, pending: bool = False,
                end: int | None = None) -> dict[str, tuple[KVBlock | PendingBlock, str]]:
        """Asks the tiers from `first` down (to `end`, excluded), each once, for the keys no tier above had; places
        and promotes the hits. Returns {key: (block, tier name)} for the keys found. `pending`: a tier that can
        read into the caller's memory is only asked which keys it holds; those come back as PendingBlocks."""
        found: dict[str, tuple[KVBlock | PendingBlock, str]] = {}
        for i, tier in enumerate(self.tiers[first:end], start=first):
            if not missing:
                break
            if not self._usable(i, READ):
                continue
            direct = pending and tier.reads_in_place
            try:
                blocks = tier.locate(missing) if direct else tier.get_many(missing)
            except Exception as e:  # any tier failure is a miss; the caller recomputes the KV
                self._failed(i, "get", e)
                continue
            self._succeeded(i, READ)
            still = []
            for key, block in zip(missing, blocks, strict=True):  # `locate` answers True/False, not blocks
                if direct and block:
                    found[key] = (PendingBlock(key, tier.name, i), tier.name)
                elif not direct and block is not None:
                    found[key] = (self._place_and_promote(i, key, block), tier.name)
                else:
                    still.append(key)
            missing = still
        return found

    @property
    def can_prefetch(self) -> bool:
        """True when the top tiers do not outlive the process and some tier below them does (memory over
        disk or Redis): only then can a prefetch bring anything closer."""
        top = self._volatile_top()
        return 0 < top < len(self.tiers)

    def _volatile_top(self) -> int:
        """How many tiers, from the top, are not persistent (the tiers a prefetch fills)."""
        n = 0
        while n < len(self.tiers) and not self.tiers[n].persistent:
            n += 1
        return n

    def prefetch(self, keys: Sequence[str]) -> int:
        """Loads the blocks of `keys` found in the persistent tiers into the tiers above them (memory); keys
        already held there, or being loaded by another prefetch, are skipped. Returns how many blocks were
        brought up. Meant for a background thread; counted in the lower tiers' hits and misses like any read."""
        if not self.can_prefetch:
            return 0
        top = self._volatile_top()
        keys = [check_key(k) for k in dict.fromkeys(keys)]
        keys = [k for k in keys if not any(tier.contains(k) for tier in self.tiers[:top])]
        with self._lock:
            keys = [k for k in keys if k not in self._loading]
            for k in keys:
                self._loading[k] = threading.Event()
        try:
            return len(self._lookup(keys, top)) if keys else 0
        finally:
            with self._lock:
                done = [self._loading.pop(k) for k in keys]
            for event in done:
                event.set()

    def _wait_for_prefetch(self, keys: list[str]) -> None:
        """Waits (at most prefetch_wait_s in all) for the prefetches loading any of `keys`."""
        with self._lock:
            events = [self._loading[k] for k in keys if k in self._loading]
        deadline = time.monotonic() + self.prefetch_wait_s
        for event in events:
            if not event.wait(max(0.0, deadline - time.monotonic())):
                log.debug("store: a prefetch is still loading after %.1f s; reading directly", self.prefetch_wait_s)
                return

    def _place_and_promote(self, i: int, key: str, block: KVBlock) -> KVBlock:
        placed = block
        if self._device is not None and (i > 0 or self.tiers[i].persistent) and block.keys.device != self._device:
            placed = KVBlock(block.keys.to(self._device), block.values.to(self._device), block.token_ids, block.start,
                             block.meta)
        for upper in range(i):
            self._put_into(upper, key, block if self.tiers[upper].persistent else placed)
        return placed

    def put(self, key: str, block: KVBlock, persist: bool = True) -> None:
        """Writes every tier; with persist=False only the tiers that are not persistent (memory)."""
        check_key(key)
        check_block(block)  # a bad block is the caller's bug: raise it rather than mark tiers down
        for i in range(len(self.tiers)):
            self._put_into(i, key, block, persist)

    def put_volatile(self, key: str, block: KVBlock) -> None:
        """Writes only the tiers that do not outlive the process (memory)."""
        self.put(key, block, persist=False)

    def put_persistent(self, key: str, block: KVBlock) -> None:
        """Writes only the persistent tiers (disk, Redis): an entry memory would hold twice (an extent of prefix
        blocks, whose single blocks memory keeps)."""
        check_key(key)
        check_block(block)
        for i in range(self._volatile_top(), len(self.tiers)):
            self._put_into(i, key, block)

    def _put_into(self, i: int, key: str, block: KVBlock, persist: bool = True) -> None:
        if not self._usable(i, WRITE):
            return
        tier = self.tiers[i]
        try:
            if persist:
                tier.put(key, block)
            else:
                tier.put_volatile(key, block)
        except Exception as e:
            self._failed(i, "put", e)
        else:
            self._succeeded(i, WRITE)

    @property
    def retry_after_s(self) -> float:
        return self._pauses.retry_after_s

    def retry_now(self) -> None:
        """Ends every pause: each tier is tried on the next call (e.g. once a server is known to be back)."""
        self._pauses.clear()

    def _usable(self, i: int, direction: str) -> bool:
        return self._pauses.usable(i, direction)

    def _failed(self, i: int, op: str, e: Exception) -> None:
        self._pauses.failed(i, self.tiers[i].name, op, e)

    def _succeeded(self, i: int, direction: str) -> None:
        self._pauses.succeeded(i, self.tiers[i].name, direction)

    def clear(self) -> None:
        for i, tier in enumerate(self.tiers):
            try:
                tier.clear()
            except Exception as e:
                self._failed(i, "clear", e)

    def tier_stats(self) -> list[TierStats]:
        return [s for tier in self.tiers for s in tier.tier_stats()]

