"""Tiers composed top to bottom (memory over disk over Redis), and the rule that a failing tier is a miss.

get: asks each tier in order; a hit in a lower tier is put into every tier above it (read-through
promotion). put: writes every tier (write-through). A tier that raises (disk full, read-only directory,
Redis down) is skipped for `retry_after_s`; the first failure of an outage logs one warning on the
"pc_rag.store" logger, recovery logs one info line. No request fails because a tier failed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from ..blocks import KVBlock
from .tier import Store, StoreUsageError, TierStats, check_block, check_key

log = logging.getLogger("pc_rag.store")


class TieredStore:
    name = "tiered"

    def __init__(self, tiers: Sequence[Store], retry_after_s: float = 5.0):
        if not tiers:
            raise StoreUsageError("TieredStore needs at least one tier")
        self.tiers = list(tiers)
        self.retry_after_s = retry_after_s
        self._down_until: list[float | None] = [None] * len(self.tiers)  # None: tier is up
        self._lock = threading.Lock()

    def get(self, key: str) -> KVBlock | None:
        return self.get_with_source(key)[0]

    def get_with_source(self, key: str) -> tuple[KVBlock | None, str | None]:
        """The block and the name of the tier that served it ("memory", "disk", "redis"), or (None, None)."""
        check_key(key)
        for i, tier in enumerate(self.tiers):
            if not self._usable(i):
                continue
            try:
                block = tier.get(key)
            except Exception as e:  # any tier failure is a miss; the caller recomputes the KV
                self._failed(i, "get", e)
                continue
            self._succeeded(i)
            if block is not None:
                for upper in range(i):
                    self._put_into(upper, key, block)
                return block, tier.name
        return None, None

    def put(self, key: str, block: KVBlock) -> None:
        check_key(key)
        check_block(block)  # a bad block is the caller's bug: raise it rather than mark tiers down
        for i in range(len(self.tiers)):
            self._put_into(i, key, block)

    def _put_into(self, i: int, key: str, block: KVBlock) -> None:
        if not self._usable(i):
            return
        try:
            self.tiers[i].put(key, block)
        except Exception as e:
            self._failed(i, "put", e)
        else:
            self._succeeded(i)

    def _usable(self, i: int) -> bool:
        until = self._down_until[i]
        return until is None or time.monotonic() >= until

    def _failed(self, i: int, op: str, e: Exception) -> None:
        with self._lock:
            first = self._down_until[i] is None
            self._down_until[i] = time.monotonic() + self.retry_after_s
        tier = self.tiers[i].name
        if first:
            log.warning(
                "store tier %r failed on %s (%s: %s); treating it as a miss and retrying every %.1f s",
                tier, op, type(e).__name__, e, self.retry_after_s,
            )
        else:
            log.debug("store tier %r still failing on %s: %s", tier, op, e)

    def _succeeded(self, i: int) -> None:
        if self._down_until[i] is None:
            return
        with self._lock:
            was_down, self._down_until[i] = self._down_until[i] is not None, None
        if was_down:
            log.info("store tier %r is working again", self.tiers[i].name)

    def clear(self) -> None:
        for i, tier in enumerate(self.tiers):
            try:
                tier.clear()
            except Exception as e:
                self._failed(i, "clear", e)

    def tier_stats(self) -> list[TierStats]:
        return [s for tier in self.tiers for s in tier.tier_stats()]
