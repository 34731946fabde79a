"""Engine.explain: the plan a request would make, as rows, with no forward pass and the store left as it is.

References: what `generate` then reports for the same prompt (its `sources`: kind, tokens, source and the tier
that served each piece), and the store's counters, memory contents and disk files before the call (unchanged,
exactly). The model's forward is replaced by one that raises, so a forward pass would fail the test."""

from __future__ import annotations

import pytest

import pc_rag
from pc_rag.store import DiskStore, MemoryStore, RedisStore, TieredStore, block_files


def rag_prompt(docs):
    return [pc_rag.Text("Answer from the documents.\n\n"), pc_rag.Chunk(docs[0]), pc_rag.Text("\n\n"),
            pc_rag.Chunk(docs[1]), pc_rag.Text("\n\nQuestion: what do they say?")]


def snapshot(engine, memory: MemoryStore, folder):
    held = sorted(memory._blocks)  # the memory tier's keys, in LRU order
    return [vars(s).copy() for s in engine.store.tier_stats()], held, block_files(folder), engine.stats()["prefix"]


def no_forward(engine, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("explain ran the model")

    for name in ("forward", "forward_layers", "decode_batch"):
        monkeypatch.setattr(engine.runner, name, refuse)


@pytest.mark.parametrize("mode", ["modular", "exact"])
def test_explain_matches_the_request_and_changes_nothing(loaded, tmp_path, docs, mode, monkeypatch):
    model, tok = loaded
    prompt = rag_prompt(docs)
    pc_rag.Engine(model, tok, store=TieredStore([MemoryStore(), DiskStore(tmp_path)])).generate(
        prompt, mode=mode, max_new_tokens=2)
    memory = MemoryStore()
    engine = pc_rag.Engine(model, tok, store=TieredStore([memory, DiskStore(tmp_path)]))  # a new process
    before = snapshot(engine, memory, tmp_path)
    with monkeypatch.context() as m:
        no_forward(engine, m)
        explained = engine.explain(prompt, mode)
    assert snapshot(engine, memory, tmp_path) == before
    assert {r.tier for r in explained.rows if r.source != "fresh"} == {"disk"}
    assert all(r.load == "read" for r in explained.rows if r.source != "fresh")  # straight into the buffer
    got = engine.generate(prompt, mode=mode, max_new_tokens=2)
    assert [(r.kind, r.tokens, r.source, r.tier) for r in explained.rows] == [
        (s.kind, s.tokens, s.source, s.origin) for s in got.sources]
    last_reused = explained.rows[-1].source != "fresh"  # the prompt's last token is computed for its logits
    assert got.cached_tokens == explained.reused_tokens - last_reused
    assert sum(r.tokens for r in explained.rows) == got.prompt_tokens == len(explained.plan.ids)


def test_explain_on_a_cold_store_plans_encodes_and_forgets_nothing(engine, docs, monkeypatch):
    prompt = rag_prompt(docs)
    no_forward(engine, monkeypatch)
    explained = engine.explain(prompt, "modular")
    chunks = [r for r in explained.rows if r.source == "chunk"]
    assert [r.kind for r in chunks] == ["chunk", "sep", "chunk"]
    assert all(r.load == "encode" and r.kv == "miss: encoded and stored" for r in chunks)
    assert explained.reused_tokens == 0 and explained.encoded_tokens == sum(r.tokens for r in chunks)
    assert explained.computed_tokens + explained.encoded_tokens == len(explained.plan.ids)
    assert engine.store.tier_stats()[0].misses == 0 and engine.stats()["prefix"]["blocks_indexed"] == 0
    text = str(explained)
    assert text.splitlines()[0].split()[:3] == ["kind", "tokens", "slots"]
    assert f"modular: {len(explained.plan.ids)} prompt tokens; 0 from the store" in text.splitlines()[-1]


def test_explain_after_a_request_shows_memory_hits(engine, docs):
    prompt = rag_prompt(docs)
    engine.generate(prompt, mode="modular", max_new_tokens=2)
    before = [vars(s).copy() for s in engine.store.tier_stats()]
    explained = engine.explain(prompt, "modular")
    assert [vars(s) for s in engine.store.tier_stats()] == before
    assert {r.kv for r in explained.rows if r.source != "fresh"} == {"memory hit"}
    assert explained.rows[0].source == "prefix"  # the text before the first chunk: the prefix chain


def test_explain_asks_redis_without_counting(loaded, docs):
    fakeredis = pytest.importorskip("fakeredis")
    server = fakeredis.FakeServer()
    model, tok = loaded
    prompt = rag_prompt(docs)

    def store():
        return TieredStore([MemoryStore(), RedisStore(client=fakeredis.FakeRedis(server=server))])

    pc_rag.Engine(model, tok, store=store()).generate(prompt, mode="modular", max_new_tokens=1)
    engine = pc_rag.Engine(model, tok, store=store())
    before = [vars(s).copy() for s in engine.store.tier_stats()]
    explained = engine.explain(prompt, "modular")
    assert [vars(s) for s in engine.store.tier_stats()] == before
    assert {r.tier for r in explained.rows if r.source == "chunk"} == {"redis"}


def test_explain_checks_its_arguments_as_generate_does(engine):
    with pytest.raises(pc_rag.PromptError, match="unknown mode"):
        engine.explain("hello", "fast")


@pytest.mark.parametrize("mode", ["full", "exact", "modular", "blend"])
def test_the_plan_that_ran_is_the_plan_explained(loaded, docs, mode):
    """Reference: `explain` made just before the request. A request without faults carries out exactly that plan
    (`Generation.plan`, no events): a system prompt from the prefix cache, registered chunks reused or encoded, a
    repeated separator, passages of a plain string."""
    model, tok = loaded
    engine = pc_rag.Engine(model, tok, store=MemoryStore())
    engine.register(docs[:2])
    system = "You answer questions about Python.\n\n"
    first = system + f"{docs[0]}\n\n{docs[2]}\n\nQuestion: what is it?\nAnswer:"
    engine.generate(first, mode=mode, max_new_tokens=2)
    for prompt in (system + f"{docs[2]}\n\n{docs[1]}\n\n{docs[0]}\n\nQuestion: and now?\nAnswer:",
                   [pc_rag.Text(system), pc_rag.Chunk(docs[3]), pc_rag.Text("\n\n"), pc_rag.Chunk(docs[0]),
                    pc_rag.Text("\n\nQ?")]):
        explained = engine.explain(prompt, mode)
        gen = engine.generate(prompt, mode=mode, max_new_tokens=2)
        assert gen.plan == explained.plan and not gen.plan.events
        assert gen.cached_tokens + gen.computed_tokens == len(gen.plan.ids)
