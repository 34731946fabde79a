"""Prefetch on retrieval: documents the hooks discover are loaded from disk into the memory tier in the
background. References: the memory tier's own contents (contains), the tiers' hit counters, and the sources
a later request reports (every chunk served by "memory")."""

from __future__ import annotations

import threading
import time

import pytest

import pc_rag
from pc_rag import prefetch
from pc_rag.store import DiskStore, MemoryStore, TieredStore
from pc_rag.text_index import discover

WAIT_S = 30.0  # generous: the machine is shared; a pass takes milliseconds


@pytest.fixture
def docs(docs):
    return [d.strip() for d in docs]  # as a retriever returns them; a chunk's key is its stripped text's


@pytest.fixture
def disk_engine(loaded, tmp_path):
    model, tok = loaded
    return pc_rag.Engine(model, tok, store=TieredStore([MemoryStore(), DiskStore(tmp_path)]))


def string_prompt(docs) -> str:
    # What a RAG chain sends: documents after a newline, joined with blank lines.
    return "Answer from the documents.\n\n" + "\n\n".join(d.strip() for d in docs) + "\n\nQuestion: what?\nAnswer:"


def chunk_keys(engine, docs) -> list[str]:
    from pc_rag.segments import TokenSegment

    return engine.planner.chunk_keys([TokenSegment("chunk", engine.segmenter.ids(d.strip()), 0) for d in docs])


def test_discovered_documents_are_loaded_into_memory(disk_engine, docs):
    # A worker of its own: the process's is shared by every engine alive, and past MAX_PENDING jobs from one
    # discover call (a full test run keeps dozens of engines) it drops the rest, this engine's among them.
    disk_engine.prefetcher = prefetch.Prefetcher()
    memory = disk_engine.store.tiers[0]
    disk_engine.warm(docs[:3], progress=False)
    memory.clear()
    keys = chunk_keys(disk_engine, docs[:3])
    assert not any(memory.contains(k) for k in keys)
    discover(docs[:3])
    assert disk_engine.prefetcher.wait_idle(WAIT_S)
    assert all(memory.contains(k) for k in keys)
    disk_hits = disk_engine.store.tiers[1].tier_stats()[0].hits
    # the request then finds every chunk in memory: the prefetch keys are the keys a prompt string uses
    gen = disk_engine.generate(string_prompt(docs[:3]), max_new_tokens=2)
    assert [s.origin for s in gen.sources if s.kind == "chunk"] == ["memory"] * 3
    assert disk_engine.store.tiers[1].tier_stats()[0].hits == disk_hits


def test_prefetch_future_counts_blocks_and_skips_those_in_memory(disk_engine, docs):
    memory = disk_engine.store.tiers[0]
    disk_engine.warm(docs[:2], progress=False)
    memory.clear()
    assert disk_engine.prefetch(docs[:2]).result(WAIT_S) == 2
    assert disk_engine.prefetch(docs[:2]).result(WAIT_S) == 0  # already in memory: nothing read
    assert disk_engine.store.tiers[1].tier_stats()[0].hits == 2


def test_nothing_on_disk_or_no_disk_tier_does_nothing(loaded, disk_engine, docs):
    assert disk_engine.prefetch(docs).result(WAIT_S) == 0
    assert disk_engine.store.tiers[0].tier_stats()[0].entries == 0
    model, tok = loaded
    memory_only = pc_rag.Engine(model, tok, store=MemoryStore())
    assert memory_only.prefetch(docs).result(WAIT_S) == 0
    assert memory_only.store.tier_stats()[0].entries == 0


def test_engine_can_opt_out(disk_engine, docs, monkeypatch):
    disk_engine.warm(docs[:1], progress=False)
    disk_engine.store.tiers[0].clear()
    disk_engine.prefetch_on_discover = False
    discover(docs[:1])
    assert prefetch.wait_idle(WAIT_S)
    assert disk_engine.store.tiers[0].tier_stats()[0].entries == 0
    disk_engine.prefetch_on_discover = True
    monkeypatch.setenv("PC_RAG_PREFETCH", "0")
    discover(docs[:1])
    assert prefetch.wait_idle(WAIT_S)
    assert disk_engine.store.tiers[0].tier_stats()[0].entries == 0


def test_request_waits_for_a_prefetch_in_flight_instead_of_reading_twice(disk_engine, docs, monkeypatch):
    disk = disk_engine.store.tiers[1]
    disk_engine.warm(docs[:2], progress=False)
    disk_engine.store.tiers[0].clear()
    started, release = threading.Event(), threading.Event()
    read = DiskStore.get_many

    def slow_get_many(self, keys):
        started.set()
        release.wait(WAIT_S)
        return read(self, keys)

    monkeypatch.setattr(DiskStore, "get_many", slow_get_many)
    job = disk_engine.prefetch(docs[:2])
    assert started.wait(WAIT_S)
    threading.Timer(0.2, release.set).start()
    gen = disk_engine.generate(string_prompt(docs[:2]), max_new_tokens=2)
    assert job.result(WAIT_S) == 2
    assert [s.origin for s in gen.sources if s.kind == "chunk"] == ["memory", "memory"]
    assert disk.tier_stats()[0].hits == 2  # each block read once, by the prefetch


def test_discover_never_blocks_and_drops_jobs_past_the_bound(disk_engine, docs, monkeypatch):
    release = threading.Event()
    blocker = prefetch.submit(lambda: release.wait(WAIT_S) and 0)
    try:
        monkeypatch.setattr(prefetch.PREFETCHER, "max_pending", 2)
        dropped = prefetch.PREFETCHER.dropped
        t0 = time.perf_counter()
        for _ in range(5):
            discover(docs[:2])
        assert time.perf_counter() - t0 < 1.0
        assert prefetch.PREFETCHER.dropped > dropped
    finally:
        release.set()
    blocker.result(WAIT_S)
    assert prefetch.wait_idle(WAIT_S)
