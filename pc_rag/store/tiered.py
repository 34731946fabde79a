"""Tiers composed top to bottom (memory over disk over Redis), and the rule that a failing tier is a miss.

get: asks each tier in order; a hit in a lower tier is put into every tier above it (read-through
promotion). `get_many_with_source` does the same for a request's keys at once, asking each tier once for
the keys still missing. put: writes every tier (write-through); `persist=False` writes only the tiers that
do not outlive the process (memory).

A tier that raises is skipped for `retry_after_s`, reads and writes apart: a full or read-only disk still
serves the blocks it holds, and a tier whose reads fail may still take writes. A TierUnavailableError (Redis
down, the cache folder not a folder) pauses both. The first failure of each direction logs one warning on
the "pc_rag.store" logger, recovery logs one info line. No request fails because a tier failed.

`set_placement(fn)`: blocks decoded from a persistent tier are CPU tensors; fn (e.g. a move to the engine's
device) is applied once to each block that did not come from a non-persistent top tier, before it is
promoted and returned, so the memory tier holds placed blocks and the next hit needs no move.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from ..blocks import KVBlock
from .tier import (
    Store,
    StoreUsageError,
    TierStats,
    TierUnavailableError,
    check_block,
    check_key,
    get_many,
    put_block,
)

log = logging.getLogger("pc_rag.store")

READ, WRITE = "reads", "writes"
_DIRECTION = {"get": READ, "put": WRITE, "clear": WRITE}


class TieredStore:
    name = "tiered"

    def __init__(self, tiers: Sequence[Store], retry_after_s: float = 5.0):
        if not tiers:
            raise StoreUsageError("TieredStore needs at least one tier")
        self.tiers = list(tiers)
        self.retry_after_s = retry_after_s
        # Per tier and direction: when to try again after a failure; None while working.
        self._retry_at: list[dict[str, float | None]] = [{READ: None, WRITE: None} for _ in self.tiers]
        self._lock = threading.Lock()
        self._placement: Callable[[KVBlock], KVBlock] | None = None

    def set_placement(self, fn: Callable[[KVBlock], KVBlock] | None) -> None:
        """fn(block) -> block, applied once to every block read from a tier below the top (or from a top tier
        that is persistent: a disk or Redis store used alone) before it is promoted and returned; e.g. a move
        to the engine's device. Persistent upper tiers are given the block as read, so promotion does not
        copy it back. None removes the hook. Errors raised by fn propagate to the caller."""
        if fn is not None and not callable(fn):
            raise StoreUsageError(f"set_placement expects a function KVBlock -> KVBlock or None, got {fn!r}")
        self._placement = fn

    def get(self, key: str) -> KVBlock | None:
        return self.get_with_source(key)[0]

    def get_with_source(self, key: str) -> tuple[KVBlock | None, str | None]:
        """The block and the name of the tier that served it ("memory", "disk", "redis"), or (None, None)."""
        return self.get_many_with_source([key])[0]

    def get_many_with_source(self, keys: Sequence[str]) -> list[tuple[KVBlock | None, str | None]]:
        """(block, tier name) or (None, None) for each key, in order. Each tier is asked once, for the keys
        no tier above it had (one Redis round trip per request); a key repeated in `keys` is looked up once."""
        keys = [check_key(k) for k in keys]
        found: dict[str, tuple[KVBlock, str]] = {}
        missing = list(dict.fromkeys(keys))
        for i, tier in enumerate(self.tiers):
            if not missing:
                break
            if not self._usable(i, READ):
                continue
            try:
                blocks = get_many(tier, missing)
            except Exception as e:  # any tier failure is a miss; the caller recomputes the KV
                self._failed(i, "get", e)
                continue
            self._succeeded(i, READ)
            still = []
            for key, block in zip(missing, blocks, strict=True):
                if block is None:
                    still.append(key)
                else:
                    found[key] = (self._place_and_promote(i, key, block), tier.name)
            missing = still
        return [found.get(key, (None, None)) for key in keys]

    def _place_and_promote(self, i: int, key: str, block: KVBlock) -> KVBlock:
        placed = block
        if self._placement is not None and (i > 0 or _persistent(self.tiers[i])):
            placed = check_block(self._placement(block))
        for upper in range(i):
            self._put_into(upper, key, block if _persistent(self.tiers[upper]) else placed)
        return placed

    def put(self, key: str, block: KVBlock, persist: bool = True) -> None:
        """Writes every tier; with persist=False only the tiers that are not persistent (memory)."""
        check_key(key)
        check_block(block)  # a bad block is the caller's bug: raise it rather than mark tiers down
        for i in range(len(self.tiers)):
            self._put_into(i, key, block, persist)

    def _put_into(self, i: int, key: str, block: KVBlock, persist: bool = True) -> None:
        if not self._usable(i, WRITE):
            return
        try:
            put_block(self.tiers[i], key, block, persist=persist)
        except Exception as e:
            self._failed(i, "put", e)
        else:
            self._succeeded(i, WRITE)

    def retry_now(self) -> None:
        """Ends every pause: each tier is tried on the next call (e.g. once a server is known to be back)."""
        with self._lock:
            for health in self._retry_at:
                health[READ] = health[WRITE] = None

    def _usable(self, i: int, direction: str) -> bool:
        until = self._retry_at[i][direction]
        return until is None or time.monotonic() >= until

    def _failed(self, i: int, op: str, e: Exception) -> None:
        directions = (READ, WRITE) if isinstance(e, TierUnavailableError) else (_DIRECTION[op],)
        retry_at = time.monotonic() + self.retry_after_s
        with self._lock:
            newly_down = [d for d in directions if self._retry_at[i][d] is None]
            for d in directions:
                self._retry_at[i][d] = retry_at
        tier = self.tiers[i].name
        if newly_down:
            log.warning(
                "store tier %r failed on %s (%s: %s); its %s are treated as misses, retrying every %.1f s",
                tier, op, type(e).__name__, e, " and ".join(newly_down), self.retry_after_s,
            )
        else:
            log.debug("store tier %r still failing on %s: %s", tier, op, e)

    def _succeeded(self, i: int, direction: str) -> None:
        if self._retry_at[i][direction] is None:
            return
        with self._lock:
            was_down, self._retry_at[i][direction] = self._retry_at[i][direction] is not None, None
        if was_down:
            log.info("store tier %r: %s work again", self.tiers[i].name, direction)

    def clear(self) -> None:
        for i, tier in enumerate(self.tiers):
            try:
                tier.clear()
            except Exception as e:
                self._failed(i, "clear", e)

    def tier_stats(self) -> list[TierStats]:
        return [s for tier in self.tiers for s in tier.tier_stats()]


def _persistent(tier: Store) -> bool:
    return bool(getattr(tier, "persistent", False))
