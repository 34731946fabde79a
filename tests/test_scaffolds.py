"""Co-retrieval counting (plain bookkeeping) and automatic scaffolding through the engine."""

import pytest

from pc_rag import Chunk, Text
from pc_rag.scaffolds import CoRetrievalCounter

A, B, C = (1, 2), (3, 4), (5,)


def test_counter_promotes_once_at_threshold():
    c = CoRetrievalCounter(3)
    assert [c.observe((A, B)) for _ in range(5)] == [False, False, True, False, False]
    assert c.observe((B, A)) is False  # another order is another group
    assert c.observe((A,)) is False  # a single chunk is no group


def test_counter_is_bounded():
    c = CoRetrievalCounter(2, max_groups=10)
    for i in range(100):
        c.observe(((i,), (i + 1,)))
    assert len(c._counts) <= 10
    with pytest.raises(ValueError):
        CoRetrievalCounter(0)


def test_engine_auto_scaffolds_frequent_groups(loaded, docs):
    import pc_rag

    model, tok = loaded
    engine = pc_rag.Engine(model, tok, store="memory", auto_scaffold_after=2)
    prompt = [Text("Docs:\n"), Chunk(docs[0]), Text("\n\n"), Chunk(docs[1]), Text("\n\nQ?")]
    for _ in range(2):
        assert "scaffold" not in [s.kind for s in engine.generate(prompt, max_new_tokens=1).sources]
    engine.wait_for_background(timeout=60)
    gen = engine.generate(prompt, max_new_tokens=8)
    # BOS and the leading text come from the automatic prefix reuse (the earlier requests computed them)
    assert [s.kind for s in gen.sources] == ["prefix", "scaffold", "text"]
    assert engine.stats()["scaffolds"] == {"groups": 1, "bytes": engine.stats()["scaffolds"]["bytes"]}
    assert engine.stats()["scaffolds"]["bytes"] > 0
