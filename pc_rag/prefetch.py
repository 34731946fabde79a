"""Prefetch on retrieval: the KV of documents a retriever just returned is loaded from disk or Redis into
memory while the framework builds the prompt, so the LLM call finds it there (RAGCache overlaps KV loading
with retrieval in the same spirit).

    retriever returns documents -> framework hook -> text_index.discover(texts) -> for each engine watching
    that Discovery: engine.prefetch(texts) -> its Prefetcher's worker: chunk keys -> store.prefetch(keys)

The hooks cannot know which engine will answer, so every engine watching the Discovery is asked (text_index.py);
an engine whose store has no persistent tier under a memory tier does nothing, and one whose persistent tiers do
not hold the blocks only pays the misses. A request that needs a block still being loaded waits for that load
instead of reading it twice (`TieredStore.prefetch_wait_s`).

Never blocking the caller: the hook only queues the texts. A `Prefetcher` has one worker thread, which does the
tokenizing and the loading (the disk tier reads the files in parallel itself); at most `max_pending` jobs wait,
later ones are dropped (and counted). Engines share the process's `PREFETCHER` unless given their own
(`Engine(prefetcher=...)`). PC_RAG_PREFETCH=0 turns prefetching on discovery off for the process;
`Engine.prefetch_on_discover = False` for one engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

log = logging.getLogger("pc_rag")

MAX_PENDING = 32


class Prefetcher:
    """One background worker for prefetch jobs, with a bounded queue; started on the first job."""

    def __init__(self, max_pending: int = MAX_PENDING):
        self.max_pending = max_pending
        self.dropped = 0  # jobs refused because max_pending were already waiting
        self._lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None
        self._pending = 0

    def submit(self, fn: Callable[[], int]) -> Future:
        """Run `fn` on the worker; never blocks. When `max_pending` jobs are already waiting the job is dropped:
        the returned future is already done, with 0."""
        with self._lock:
            if self._pending >= self.max_pending:
                self.dropped += 1
                done: Future = Future()
                done.set_result(0)
                log.debug("pc_rag prefetch: %d jobs waiting, one dropped", self._pending)
                return done
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pc_rag-prefetch")
            self._pending += 1
            worker = self._worker
        future = worker.submit(fn)
        future.add_done_callback(self._finished)
        return future

    def _finished(self, future: Future) -> None:
        with self._lock:
            self._pending -= 1
        if not future.cancelled() and future.exception() is not None:
            # A failed prefetch costs only the speed-up: the request reads the blocks itself.
            log.warning("pc_rag prefetch failed: %s: %s", type(future.exception()).__name__, future.exception())

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no job is queued or running; False if `timeout` passed first."""
        with self._lock:
            worker = self._worker
        if worker is None:
            return True
        marker = worker.submit(lambda: None)  # one worker: it runs after everything queued before it
        try:
            marker.result(timeout)
        except FutureTimeout:
            return False
        return True


PREFETCHER = Prefetcher()  # the process's default: every Engine uses it unless given its own


def submit(fn: Callable[[], int]) -> Future:
    """`PREFETCHER.submit(fn)`."""
    return PREFETCHER.submit(fn)


def wait_idle(timeout: float | None = None) -> bool:
    """`PREFETCHER.wait_idle(timeout)`: no prefetch job of the default prefetcher is queued or running."""
    return PREFETCHER.wait_idle(timeout)
