"""Automatic exact prefix reuse (pc_rag/prefix.py and its use by the engine).

References: `full` mode on the same prompt (its logits equal a plain HF forward, see test_engine.py). Reused KV
must give the same greedy tokens and next-token logits within 1e-4 (fp32: the reused blocks were computed in
other forward passes than the reference, so only float rounding may differ)."""

from __future__ import annotations

import pytest
import torch

import pc_rag
from pc_rag import Chunk, Text
from pc_rag.prefix import BLOCK_TOKENS, PrefixIndex, run_blocks
from pc_rag.store import DiskStore, MemoryStore, TieredStore
from pc_rag.text_index import DISCOVERY, ChunkIndex, discover

TOL = 1e-4


def system_text():
    from pydoc_data.topics import topics

    return topics["for"][:1500]


def ids_of(engine, text):
    """A string prompt's token ids as the engine lays them out (BOS first)."""
    return tuple(t for s in engine.segmenter.segments(engine.split(text)) for t in s.token_ids)


def lcp(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def check_equals_full(engine, prompt, mode, max_new_tokens=8):
    """Generate in `mode` after whatever the store holds; compare to `full` on the same prompt."""
    got = engine.generate(prompt, mode=mode, max_new_tokens=max_new_tokens)
    ref = engine.generate(prompt, mode="full", max_new_tokens=max_new_tokens)
    assert got.prompt_ids == ref.prompt_ids
    assert got.token_ids == ref.token_ids
    diff = (engine.next_token_logits(prompt, mode) - engine.next_token_logits(prompt, "full")).abs().max().item()
    assert diff <= TOL
    return got


# ---- plain bookkeeping ---------------------------------------------------------------------------------
def test_block_keys_chain_tokens_and_positions():
    ids, pos = list(range(100)), list(range(100))
    a = run_blocks("fp", "root", ids, pos, 0, 100, with_tail=False)
    assert [(r.start, r.end) for r in a] == [(0, 32), (32, 64), (64, 96)]
    assert [r.parent for r in a[1:]] == [r.key for r in a[:-1]]
    tail = run_blocks("fp", "root", ids, pos, 0, 100, with_tail=True)
    assert (tail[-1].start, tail[-1].end) == (96, 100)
    changed = run_blocks("fp", "root", [7] + ids[1:], pos, 0, 100, with_tail=False)
    assert all(x.key != y.key for x, y in zip(a, changed, strict=True))  # a change early changes every later key
    shifted = run_blocks("fp", "root", ids, [p + 1 for p in pos], 0, 100, with_tail=False)
    assert shifted[0].key != a[0].key  # same tokens at other positions: other KV
    assert run_blocks("fp2", "root", ids, pos, 0, 100, with_tail=False)[0].key != a[0].key


def test_prefix_index_longest_common_prefix_and_bounds():
    index = PrefixIndex(max_blocks=3, max_children=2)
    index.add("p", "k1", [1, 2, 3, 4], [0, 1, 2, 3])
    index.add("p", "k2", [1, 2, 9, 9], [0, 1, 2, 3])
    assert index.longest("p", [1, 2, 3, 7], [0, 1, 2, 3]) == ("k1", 3)
    assert index.longest("p", [1, 2, 9], [0, 1, 2]) == ("k2", 3)
    assert index.longest("p", [1, 2, 3], [5, 6, 7]) is None  # same tokens, other positions
    assert index.longest("q", [1], [0]) is None
    assert index.longest("p", [1, 2, 3], [0, 1, 2]) == ("k1", 3)
    index.add("p", "k3", [5], [0])  # a third child: the least recently used one (k2; k1 was used since) goes
    assert index.longest("p", [1, 2, 9], [0, 1, 2]) == ("k1", 2)
    index.add("r", "k4", [1], [0])
    index.add("s", "k5", [1], [0])
    assert len(index) == 3


def test_chunk_index_is_bounded_least_recently_used_first():
    index = ChunkIndex(max_texts=8)
    index.add_many(f"document number {i}" for i in range(8))
    assert index.spans("see document number 0 here")  # a match counts as use
    index.add("document number 8")
    assert len(index) <= 8
    assert "document number 0" in index and "document number 8" in index
    assert "document number 1" not in index  # the least recently used went first
    assert index.spans("document number 1") == []
    byte_bound = ChunkIndex(max_chars=100)
    byte_bound.add_many(["x" * 40, "y" * 40, "z" * 40])
    assert sum(map(len, ["x" * 40, "y" * 40, "z" * 40])) > 100 >= sum(len(k) for k in byte_bound._keys)


# ---- the engine ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["exact", "modular"])
def test_prefix_cut_mid_segment_is_reused_and_equals_full(engine, mode):
    base = system_text()
    first = engine.generate(base + "\n\nQuestion: what does the else clause do?", mode=mode, max_new_tokens=4)
    assert first.cached_tokens == 0 and first.stored_tokens == first.prompt_tokens
    prompt = base + "\n\nQuestion: when is the loop left early?"
    shared = lcp(first.prompt_ids, ids_of(engine, prompt))
    got = check_equals_full(engine, prompt, mode)
    assert shared % BLOCK_TOKENS != 0  # the shared prefix ends inside a block: reuse is token-exact anyway
    assert got.cached_tokens == shared
    assert got.sources[0].source == "prefix" and got.stored_tokens == got.prompt_tokens - shared


@pytest.mark.parametrize("mode", ["exact", "modular"])
def test_prefix_cut_mid_message_is_reused_and_equals_full(engine, mode):
    tok = engine.tokenizer
    messages = [{"role": "system", "content": system_text()},
                {"role": "user", "content": "Tell me about loops and the else clause in them."}]
    engine.generate(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), mode=mode,
                    max_new_tokens=4)
    messages[-1]["content"] = "Tell me about loops and why break skips the else clause."
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    got = check_equals_full(engine, prompt, mode)
    assert got.cached_tokens > len(ids_of(engine, system_text()))


@pytest.mark.parametrize("mode", ["exact", "modular"])
def test_the_reply_is_reused_by_the_next_turn_and_equals_full(engine, mode):
    prompt1 = system_text() + "\n\nUser: say something\nAssistant:"
    g1 = engine.generate(prompt1, mode=mode, max_new_tokens=12)
    assert g1.text
    # The next turn carries the reply as text; its generated tokens are given back (the tokenizer may cut the
    # text otherwise), so everything the first request fed to the model is reused: prompt and reply.
    prompt2 = prompt1 + g1.text + "\nUser: and more?\nAssistant:"
    got = check_equals_full(engine, prompt2, mode)
    assert got.cached_tokens == g1.prompt_tokens + len(g1.token_ids) - 1
    # cut mid-reply: a prompt that keeps half the reply, then goes elsewhere
    half = g1.text[: len(g1.text) // 2]
    got = check_equals_full(engine, prompt1 + half + " no", mode)
    assert got.cached_tokens >= g1.prompt_tokens


def test_chat_turns_reuse_the_previous_prompt(engine):
    tok = engine.tokenizer
    messages = [{"role": "system", "content": system_text()}]
    previous = None
    for question in ["hello", "what about for loops?", "and else?"]:
        messages.append({"role": "user", "content": question})
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if previous is not None:
            reply = next(s for s in engine.split(text) if s.text == previous.text.strip())
            written = len(reply.token_ids if reply.token_ids is not None else engine.segmenter.ids(reply.text))
        g = engine.generate(text, max_new_tokens=10)
        if previous is not None:
            # The template trims the reply it writes back; when that changes its tokens (a reply that began with
            # a space), the engine ran the trimmed reply over the prompt once the reply was out, so the turn
            # still reuses the previous prompt and the reply as written back (all but a last token never fed).
            assert g.cached_tokens >= previous.prompt_tokens + written - 1
        messages.append({"role": "assistant", "content": g.text})
        previous = g


def test_modular_reuses_what_follows_the_same_chunks(engine, docs):
    def prompt(tail):
        return [Text("Answer from the documents.\n\n"), Chunk(docs[0]), Text("\n\n"), Chunk(docs[1]), Text(tail)]

    g1 = engine.generate(prompt("\n\nQuestion: what is shown?\nAnswer:"), mode="modular", max_new_tokens=6)
    second = prompt("\n\nQuestion: what is shown?\nAnswer:" + g1.text + "\nQuestion: why?\nAnswer:")
    got = engine.generate(second, mode="modular", max_new_tokens=6)
    # Everything the first request fed to the model, as far as the second prompt's tokens agree with it.
    assert got.cached_tokens == lcp(g1.prompt_ids + g1.token_ids[:-1], got.prompt_ids) > g1.prompt_tokens - 12
    assert [s.source for s in got.sources][-2:] == ["prefix", "fresh"]
    # The reused blocks hold exactly what modular mode computes for this prompt from its chunks alone.
    fresh = pc_rag.Engine(engine.model, engine.tokenizer, store=MemoryStore())
    fresh.warm([docs[0], docs[1], "\n\n"], progress=False)
    reference = fresh.next_token_logits(second, "modular")
    assert (engine.next_token_logits(second, "modular") - reference).abs().max().item() <= TOL


def test_blend_reuses_only_the_text_before_the_first_chunk(engine, docs):
    prompt = [Text("Answer from the documents.\n\n"), Chunk(docs[0]), Text("\n\nQ?")]
    engine.generate(prompt, mode="blend", max_new_tokens=2)
    got = engine.generate(prompt, mode="blend", max_new_tokens=2)
    sources = [s.source for s in got.sources]
    assert sources[0] == "prefix" and sources[1] == "chunk" and "prefix" not in sources[2:]


def test_prefix_blocks_persist_on_disk_for_another_engine(loaded, tmp_path):
    model, tok = loaded
    prompt = system_text() + "\n\nQuestion: x?"
    a = pc_rag.Engine(model, tok, store=TieredStore([MemoryStore(), DiskStore(tmp_path)]))
    first = a.generate(prompt, mode="exact", max_new_tokens=4)
    b = pc_rag.Engine(model, tok, store=TieredStore([MemoryStore(), DiskStore(tmp_path)]))
    got = b.generate(prompt, mode="exact", max_new_tokens=4)
    # Whole blocks only: a request's short tail stays in the memory of the process that computed it.
    assert got.cached_tokens == (first.prompt_tokens // BLOCK_TOKENS) * BLOCK_TOKENS
    assert {s.origin for s in got.sources if s.source == "prefix"} == {"disk"}
    assert got.token_ids == first.token_ids


def test_prefix_blocks_respect_the_memory_budget(loaded):
    model, tok = loaded
    store = MemoryStore(max_bytes=200_000)
    engine = pc_rag.Engine(model, tok, store=store)
    for i in range(4):
        engine.generate(system_text()[i * 50:] + f" question {i}?", mode="exact", max_new_tokens=4)
        assert store.tier_stats()[0].bytes_held <= 200_000
    assert store.tier_stats()[0].evictions > 0


def test_next_token_logits_leaves_its_prefix_behind(engine):
    context = system_text() + "\n\nWhich answer fits best?"
    first = engine.next_token_logits(context + " (a) the loop", "exact")
    assert first.shape[-1] == engine.model.config.vocab_size
    got = engine.generate(context + " (b) the else clause", mode="exact", max_new_tokens=1)
    assert got.cached_tokens >= len(ids_of(engine, context)) - 1


def test_a_plain_string_starting_with_prompt_is_plain_text(engine):
    engine.add_schema('<schema name="s"><module name="m">x</module></schema>')
    text = "<prompt> is an HTML-like tag; explain it"
    got = engine.generate(text, max_new_tokens=2)
    assert got.prompt_ids[1:] == tuple(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_chunk_boundaries_keep_the_tokens_of_the_joined_text(engine):
    doc = "The for statement is used to iterate over the elements of a sequence."
    engine.register([doc])
    text = "Context: " + doc + "\n\nQuestion: what is it?"
    segments = engine.split(text)
    assert [type(s).__name__ for s in segments] == ["Text", "Chunk", "Text"]
    joined = tuple(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert ids_of(engine, text)[1:] == joined  # after BOS
    assert segments[1].text.startswith(" The")  # the chunk carries the space the joined text attaches to "The"
    got = engine.generate(text, mode="full", max_new_tokens=1)
    assert got.prompt_ids[1:] == joined and "chunk" in [s.kind for s in got.sources]


def test_discovered_documents_become_chunks_and_can_be_turned_off(engine, docs, monkeypatch):
    DISCOVERY.index.clear()
    text = "Documents:\n\n" + docs[2] + "\n\nQuestion?"
    assert discover([docs[2]]) == 1
    assert any(isinstance(s, Chunk) for s in engine.split(text))
    assert not any(isinstance(s, Chunk) for s in engine.split(text, discovered=False))
    monkeypatch.setenv("PC_RAG_DISCOVERY", "0")
    assert not any(isinstance(s, Chunk) for s in engine.split(text))
    assert discover([docs[3]]) == 0 and docs[3].strip() not in DISCOVERY.index
    monkeypatch.delenv("PC_RAG_DISCOVERY")
    assert any(isinstance(s, Chunk) for s in engine.split(text, chunk_texts=[docs[2]], discovered=False))
    DISCOVERY.index.clear()


def test_sources_and_counts_add_up(engine, docs):
    prompt = [Text("Docs:\n\n"), Chunk(docs[0]), Text("\n\nQ?")]
    for _ in range(2):
        g = engine.generate(prompt, mode="modular", max_new_tokens=3)
        assert sum(s.tokens for s in g.sources) == g.prompt_tokens == len(g.prompt_ids)
        assert g.cached_tokens + g.computed_tokens == g.prompt_tokens
    assert torch.is_tensor(engine.next_token_logits(prompt, "modular"))


def test_a_reply_cuts_a_prompt_only_after_the_prompt_it_answered(engine):
    prompt1 = system_text()[:400] + "\nAssistant:"
    g1 = engine.generate(prompt1, mode="exact", max_new_tokens=12)
    assert g1.text.strip()
    # the same words elsewhere: plain text, the joined string's tokens
    other = "Someone once said:" + g1.text + " and that was all."
    assert ids_of(engine, other)[1:] == tuple(engine.tokenizer(other, add_special_tokens=False)["input_ids"])
    assert all(s.token_ids is None or not isinstance(s, Text) or s.text != g1.text for s in engine.split(other))
    # after the prompt it answered: a cut, and the reply keeps its generated tokens
    follow = prompt1 + g1.text + "\nUser: ok"
    pieces = engine.split(follow)
    cut = [s.text for s in pieces].index(g1.text)  # the prompt before it may be cut at passages
    assert "".join(s.text for s in pieces[:cut]) == prompt1
    assert pieces[cut].token_ids == g1.token_ids[: len(pieces[cut].token_ids)]
