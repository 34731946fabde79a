"""Counting which chunks are retrieved together, to encode frequent groups jointly (automatic scaffolding).

Plain bookkeeping, no tensors: the engine reports each prompt's chunks in order; a group seen
`threshold` times is returned once, and the engine then encodes it jointly in the background. Groups are
ordered: joint KV is only exact for the order it was encoded in.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

Group = tuple[tuple[int, ...], ...]  # the chunks' token ids, in prompt order


class CoRetrievalCounter:
    def __init__(self, threshold: int, max_groups: int = 100_000):
        if threshold < 1:
            raise ValueError(f"auto_scaffold_after must be >= 1, got {threshold}")
        self.threshold = threshold
        self.max_groups = max_groups  # bounded: an LRU of counts, so memory stays flat under any traffic
        self._counts: OrderedDict[Group, int] = OrderedDict()
        self._promoted: set[Group] = set()
        self._lock = threading.Lock()

    def observe(self, group: Group) -> bool:
        """Count one sighting; True exactly once, when the group reaches the threshold."""
        if len(group) < 2:
            return False
        with self._lock:
            if group in self._promoted:
                return False
            n = self._counts.pop(group, 0) + 1
            if n >= self.threshold:
                self._promoted.add(group)
                return True
            self._counts[group] = n
            if len(self._counts) > self.max_groups:
                self._counts.popitem(last=False)
            return False
