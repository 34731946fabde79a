"""The memory tier: blocks kept as tensors (on whatever device they were put), bounded by bytes.

Which block leaves when the budget is full (`policy`):
- "lru": the least recently used.
- "gdsf": Greedy-Dual-Size-Frequency (RAGCache's PGDSF without its GPU/host split): each block's priority is
  L + frequency x cost / size, the lowest leaves, and L rises to the priority of each block that left, so blocks
  used long ago age out however often they were used then. cost is what a miss costs (tokens x layers to
  recompute), size its bytes. For KV blocks of one model both grow with the tokens, so cost / size is the same for
  every block and the policy ranks by frequency, aged: a document asked for often outlives one asked for once,
  even when the latter was asked more recently. A block's count outlives it for a while (a block that comes back
  starts from what it had earned).
The default is "gdsf": on a RAG trace with Zipf document popularity and the tier at 20% of the corpus' KV it kept
61% / 81% of the chunk tokens asked for (alpha 0.8 / 1.1) where LRU kept 56% / 77%, and keeping the truly most
popular chunks for good would keep 65% / 83% (`python -m benchmarks.serving`, docs/results.md).
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

from ..blocks import KVBlock
from .tier import Store, StoreUsageError, TierStats, check_key

POLICIES = ("lru", "gdsf")


class MemoryStore(Store):
    """Bounded by bytes (not entries): chunk KV sizes vary by orders of magnitude; `policy` says which block leaves
    first (module docstring).

    `ttl_s`: an entry older than this (since its last put) is a miss and is dropped. Blocks are held by
    reference: callers must not modify a block's tensors after putting or getting it.
    """

    name = "memory"
    persistent = False

    def __init__(
        self,
        max_bytes: int = 4 << 30,
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        policy: str = "gdsf",
    ):
        if max_bytes < 0 or (ttl_s is not None and ttl_s <= 0):
            raise StoreUsageError(f"MemoryStore needs max_bytes >= 0 and ttl_s > 0, got {max_bytes}, {ttl_s}")
        if policy not in POLICIES:
            raise StoreUsageError(f"unknown memory policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.policy = policy
        self._clock = clock
        self._blocks: OrderedDict[str, tuple[KVBlock, float]] = OrderedDict()  # key -> (block, expiry time)
        self._lock = threading.Lock()
        self.stats = TierStats(self.name)
        # gdsf: key -> (uses, priority); a heap of (priority, tiebreak, key), stale entries skipped when popped
        self._uses: dict[str, tuple[int, float]] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._ties = itertools.count()
        self._floor = 0.0  # L: the priority of the last block that left
        self._gone: OrderedDict[str, int] = OrderedDict()  # the use counts of blocks that left, oldest first

    def get(self, key: str) -> KVBlock | None:
        check_key(key)
        t0 = time.perf_counter()
        with self._lock:
            entry = self._blocks.get(key)
            if entry is not None and self._clock() >= entry[1]:
                self._drop(key)
                self.stats.evictions += 1
                entry = None
            if entry is None:
                self.stats.misses += 1
                return None
            self._blocks.move_to_end(key)
            self._used(key, entry[0])
            self.stats.hits += 1
            self.stats.load_s += time.perf_counter() - t0
            return entry[0]

    def get_many(self, keys: list[str]) -> list[KVBlock | None]:
        return [self.get(key) for key in keys]

    def contains(self, key: str) -> bool:
        """Whether a live entry is held, without counting a hit or a miss or touching its use order (the
        prefetcher asks before loading a block from a lower tier)."""
        with self._lock:
            entry = self._blocks.get(key)
            return entry is not None and self._clock() < entry[1]

    def put(self, key: str, block: KVBlock) -> None:
        check_key(key)
        if block.nbytes > self.max_bytes:
            return  # larger than the whole budget: keeping it would evict everything and still not fit
        expiry = math.inf if self.ttl_s is None else self._clock() + self.ttl_s
        with self._lock:
            uses = self._uses.get(key, (self._gone.pop(key, 0), 0.0))[0]
            self._drop(key)
            self._blocks[key] = (block, expiry)
            self.stats.bytes_held += block.nbytes
            if self.policy == "gdsf":
                self._uses[key] = (uses, 0.0)
                self._used(key, block)  # a put counts as a use (a block put again keeps its count)
            while self.stats.bytes_held > self.max_bytes:
                self._drop(self._victim())
                self.stats.evictions += 1
            self.stats.entries = len(self._blocks)

    def _used(self, key: str, block: KVBlock) -> None:
        if self.policy != "gdsf":
            return
        uses = self._uses.get(key, (0, 0.0))[0] + 1
        layers, tokens = block.keys.shape[0], block.num_tokens
        priority = self._floor + uses * layers * tokens / max(1, block.nbytes)
        self._uses[key] = (uses, priority)
        heapq.heappush(self._heap, (priority, next(self._ties), key))

    def _victim(self) -> str:
        """The key to drop next: the least recently used, or (gdsf) the lowest priority, which becomes L."""
        if self.policy == "lru":
            return next(iter(self._blocks))
        while True:
            priority, _, key = heapq.heappop(self._heap)
            if key in self._blocks and self._uses.get(key, (0, None))[1] == priority:
                self._floor = priority
                # Its count outlives it for a while: a block that comes back (popular, evicted by a burst of
                # others) starts from what it had earned, not from one use.
                self._gone[key] = self._uses[key][0]
                while len(self._gone) > max(1024, 4 * len(self._blocks)):
                    self._gone.pop(next(iter(self._gone)))
                return key

    def _drop(self, key: str) -> None:
        entry = self._blocks.pop(key, None)
        self._uses.pop(key, None)
        if entry is not None:
            self.stats.bytes_held -= entry[0].nbytes
            self.stats.entries = len(self._blocks)
        if len(self._heap) > 4 * len(self._blocks) + 64:  # stale entries: rebuild from the live ones
            self._heap = [(p, next(self._ties), k) for k, (_, p) in self._uses.items()]
            heapq.heapify(self._heap)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._uses.clear()
            self._heap.clear()
            self._gone.clear()
            self._floor = 0.0
            self.stats.bytes_held = 0
            self.stats.entries = 0

    def tier_stats(self) -> list[TierStats]:
        with self._lock:
            return [replace(self.stats)]
