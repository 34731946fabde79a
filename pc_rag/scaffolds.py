"""Scaffolds: groups of chunks encoded jointly, declared by the user or built automatically.

`CoRetrievalCounter`: plain bookkeeping, no tensors: each prompt's chunks are reported in order; a group seen
`threshold` times is returned once. Groups are ordered: joint KV is only exact for the order it was encoded in.
`ScaffoldBuilder`: the engine's collaborator that declares groups to its planner and, with automatic scaffolds
on, counts each prompt's group and encodes a frequent one jointly in a background thread.

Automatic scaffolds are counted, encoded and used per cache namespace (the request's `cache_salt`): prompts of
one namespace never make a group for another, whose requests would otherwise show, by planning the group, that
someone retrieved those chunks together. Declared groups apply to every namespace, each keyed in its own.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .plan import Planner
from .segments import TokenSegment

if TYPE_CHECKING:  # the type only: scaffolds.py stays free of the model code assemble.py imports
    from .assemble import Assembler

log = logging.getLogger("pc_rag")

Group = tuple[tuple[int, ...], ...]  # the chunks' token ids, in prompt order


class CoRetrievalCounter:
    def __init__(self, threshold: int, max_groups: int = 100_000):
        if threshold < 1:
            raise ValueError(f"auto_scaffold_after must be >= 1, got {threshold}")
        self.threshold = threshold
        self.max_groups = max_groups  # bounded: an LRU of counts, so memory stays flat under any traffic
        self._counts: OrderedDict[tuple[str | None, Group], int] = OrderedDict()  # by (namespace, group)
        self._promoted: set[tuple[str | None, Group]] = set()
        self._lock = threading.Lock()

    def observe(self, group: Group, namespace: str | None = None) -> bool:
        """Count one sighting in `namespace`; True exactly once per namespace, when the group reaches the
        threshold there."""
        if len(group) < 2:
            return False
        seen = (namespace, group)
        with self._lock:
            if seen in self._promoted:
                return False
            n = self._counts.pop(seen, 0) + 1
            if n >= self.threshold:
                self._promoted.add(seen)
                return True
            self._counts[seen] = n
            if len(self._counts) > self.max_groups:
                self._counts.popitem(last=False)
            return False


class ScaffoldBuilder:
    """Declared and automatic scaffolds of one engine. `assembler.ensure_stored(want)` stores a group's joint block
    (encoding it when no tier holds it); `tokenizer` words a group for the log (`describe`).

    `after`: with automatic scaffolds (`Engine(auto_scaffold_after=n)`), a group of chunks seen together in n
    prompts is encoded jointly in the background and declared only once its KV is stored, so no request waits
    for the encode. A failed build costs only the speed-up: it is logged and counted, never raised into the
    thread. `lock` guards the planner's scaffold dict against snapshots (`stats()` iterating it while a build
    added a group raised "dictionary changed size during iteration"), the thread list and the failure count."""

    def __init__(self, planner: Planner, assembler: Assembler, tokenizer,
                 after: int | None = None):
        self.planner = planner
        self.assembler = assembler
        self.tokenizer = tokenizer
        self.counter = CoRetrievalCounter(after) if after else None
        self.lock = threading.Lock()
        self.failed = 0  # automatic builds that raised (logged on the "pc_rag" logger)
        self._threads: list[threading.Thread] = []

    def declare(self, group: Sequence[tuple[int, ...]]) -> None:
        with self.lock:
            self.planner.add_scaffold(group)

    def snapshot(self) -> tuple[list, int]:
        """(the groups, declared and automatic, per first chunk; failed builds), consistent while builds go on."""
        with self.lock:
            automatic = [g for groups in self.planner.auto_scaffolds.values() for g in groups.values()]
            return list(self.planner.scaffolds.values()) + automatic, self.failed

    def describe(self, group: Group) -> str:
        """A group in words for the log: each chunk's first words and its length."""
        def preview(ids):
            try:
                text = self.tokenizer.decode(list(ids[:12]), skip_special_tokens=True)
            except Exception:  # describing the failure must not fail in turn
                text = f"token ids {list(ids[:6])}"
            return f"{text!r}... ({len(ids)} tokens)"

        return f"{len(group)} chunks: " + ", ".join(preview(ids) for ids in group)

    def observe(self, segments: Sequence[TokenSegment], namespace: str | None = None) -> None:
        """Count the prompt's group of chunks (its chunks in order, at consecutive positions) in its cache
        `namespace`; start a background build when it reaches the threshold there."""
        if self.counter is None:
            return
        idx = [i for i, s in enumerate(segments) if s.kind == "chunk"]
        if len(idx) < 2:
            return
        span = segments[idx[0]: idx[-1] + 1]
        if any(b.start != a.end for a, b in zip(span, span[1:], strict=False)):
            return  # a group is only reusable where its segments sit at consecutive positions
        group = tuple(s.token_ids for s in span if s.kind == "chunk")
        if self.counter.observe(group, namespace):
            t = threading.Thread(target=self._build, args=(span, group, namespace), name="pc_rag-scaffold",
                                 daemon=True)
            with self.lock:
                self._threads = [b for b in self._threads if b.is_alive()]  # finished ones are dropped
                self._threads.append(t)
            t.start()

    def _build(self, span: Sequence[TokenSegment], group: Group, namespace: str | None) -> None:
        try:
            self.assembler.ensure_stored(self.planner.scaffold_wanted(span, 0, namespace))
            with self.lock:
                self.planner.add_scaffold(group, namespace, automatic=True)
        except Exception:
            with self.lock:
                self.failed += 1
            log.exception("pc_rag: automatic scaffold of %s failed; requests keep using each chunk's own KV",
                          self.describe(group))

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the background builds to finish."""
        with self.lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout)
        with self.lock:
            self._threads = [t for t in self._threads if t.is_alive()]
