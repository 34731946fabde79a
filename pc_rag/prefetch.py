"""Prefetch on retrieval: the KV of documents a retriever just returned is loaded from disk or Redis into
memory while the framework builds the prompt, so the LLM call finds it there (RAGCache overlaps KV loading
with retrieval in the same spirit).

    retriever returns documents -> framework hook -> find.discover(texts) -> notify(texts)
    -> for each live Engine: engine.prefetch(texts) -> one background worker: chunk keys -> store.prefetch(keys)

The hooks cannot know which engine will answer, so every live engine (kept in a weak set: an engine that is
no longer used is never kept alive by this module) is asked; an engine whose store has no persistent tier
under a memory tier does nothing, and one whose persistent tiers do not hold the blocks only pays the misses.
A request that needs a block still being loaded waits for that load instead of reading it twice
(`TieredStore.prefetch_wait_s`).

Never blocking the caller: the hook only queues the texts. One worker thread does the tokenizing and the
loading (the disk tier reads the files in parallel itself); at most MAX_PENDING jobs wait, later ones are
dropped (and counted). PC_RAG_PREFETCH=0 turns prefetching off for the process; `Engine.prefetch_on_discover
= False` for one engine.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

log = logging.getLogger("pc_rag")

MAX_PENDING = 32

_ENGINES: weakref.WeakSet = weakref.WeakSet()
_lock = threading.Lock()
_worker: ThreadPoolExecutor | None = None
_pending = 0
dropped = 0  # jobs refused because MAX_PENDING were already waiting


def enabled() -> bool:
    return os.environ.get("PC_RAG_PREFETCH", "1").strip().lower() not in ("0", "false", "no", "off")


def watch(engine) -> None:
    """Ask `engine` to prefetch whenever documents are discovered (Engine.__init__ calls this)."""
    with _lock:
        _ENGINES.add(engine)


def notify(texts: list[str]) -> list[Future]:
    """Documents were discovered: each live engine that wants it starts loading their KV into memory.
    Returns the jobs' futures (each resolves to the number of blocks brought into memory)."""
    if not texts or not enabled():
        return []
    with _lock:
        engines = list(_ENGINES)
    return [engine.prefetch(texts) for engine in engines if getattr(engine, "prefetch_on_discover", False)]


def submit(fn: Callable[[], int]) -> Future:
    """Run `fn` on the prefetch worker; never blocks. When MAX_PENDING jobs are already waiting the job is
    dropped: the returned future is already done, with 0."""
    global _worker, _pending, dropped
    with _lock:
        if _pending >= MAX_PENDING:
            dropped += 1
            done: Future = Future()
            done.set_result(0)
            log.debug("pc_rag prefetch: %d jobs waiting, one dropped", _pending)
            return done
        if _worker is None:
            _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pc_rag-prefetch")
        _pending += 1
    future = _worker.submit(fn)
    future.add_done_callback(_finished)
    return future


def _finished(future: Future) -> None:
    global _pending
    with _lock:
        _pending -= 1
    if not future.cancelled() and future.exception() is not None:
        # A failed prefetch costs only the speed-up: the request reads the blocks itself.
        log.warning("pc_rag prefetch failed: %s: %s", type(future.exception()).__name__, future.exception())


def wait_idle(timeout: float | None = None) -> bool:
    """Wait until no prefetch job is queued or running; False if `timeout` passed first."""
    with _lock:
        worker = _worker
    if worker is None:
        return True
    marker = worker.submit(lambda: None)  # one worker: it runs after everything queued before it
    try:
        marker.result(timeout)
    except FutureTimeout:
        return False
    return True
