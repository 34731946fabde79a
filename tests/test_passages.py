"""Passages: documents an app joins into a plain-string prompt itself are reused at any position (pc_rag/passages.py,
Planner._with_passages, Engine._remember_passages).

References: the cut rule against spans written out by hand; reuse against `full` (a lone passage first: its own
encoding after BOS is exactly its place, <= 1e-4 in fp32) and against the same prompt given as registered-style
`Chunk` segments with the same token ids (the path a registered chunk takes, <= 1e-4: the header's KV comes from the
exact prefix in one, a fresh forward in the other); "nothing changes before a passage repeats" against an engine
with passages off (equal logits); token ids against the tokenizer's own ids for the joined string.
"""

import random
import time
from pydoc_data.topics import topics

import pytest
import torch

import pc_rag
from pc_rag import Chunk, Text
from pc_rag.errors import PCRagError
from pc_rag.passages import MIN_PASSAGE_CHARS, PassageIndex, passage_spans
from pc_rag.store import MemoryStore

KEYS = sorted(topics)
# Five documentation topics of ~600 characters, flattened to single paragraphs (a retriever's chunks).
DOCS = [" ".join(topics[k].split())[:600] for k in KEYS[10:15]]
HEADER = "You are a helpful assistant. Answer the question from the documents below only.\n\n"


def rag(order, question, sep="\n\n"):
    return HEADER + sep.join(DOCS[i] for i in order) + f"\n\nQuestion: {question}\nAnswer:"


def passages_of(text):
    return [text[a:b] for a, b in passage_spans(text)]


def new_engine(loaded, **kw):
    model, tok = loaded
    return pc_rag.Engine(model, tok, store=MemoryStore(), **kw)


def kinds(gen):
    return [(s.kind, s.origin) for s in gen.sources if s.kind in ("passage", "chunk")]


# ---- the cut rule -------------------------------------------------------------------------------------------
A = "Decorators wrap a function in another function, returning a new callable that adds behaviour."
B = "A generator function yields its values one at a time, suspending its frame between them."


@pytest.mark.parametrize("layout", [
    "Context:\n\n{a}\n\n{b}\n\nQuestion: why?",  # LangChain's stuff chain
    "{a}\n---\n{b}",
    "{a}\n\n---\n\n{b}\n",
    "[1] {a}\n[2] {b}",
    "[1]: {a}\n\n[2]: {b}",
    "<doc id=1>{a}</doc>\n<doc id=2>{b}</doc>",
    "<doc id=\"1\">\n{a}\n</doc>\n<doc id=\"2\">\n{b}\n</doc>",
    "<document index=\"1\">\n<source>a.txt</source>\n<document_content>\n{a}\n</document_content>\n</document>\n"
    "<document index=\"2\">\n<document_content>{b}</document_content>\n</document>",
    "Document 1: {a}\nDocument 2: {b}",
    "Source 1:\n{a}\n\nSource 2:\n{b}",
    "file_path: /docs/a.txt\n\n{a}\n\nfile_path: /docs/b.txt\n\n{b}",  # LlamaIndex's metadata lines
    "Context information is below.\n---------------------\n{a}\n\n{b}\n---------------------\nQuery: x\nAnswer: ",
    "<|start_header_id|>user<|end_header_id|>\n\n{a}<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n{b}<|eot_id|>",
    "{a}\r\n\r\n{b}\r\n",
])
def test_documents_are_passages_whatever_joins_them(layout):
    # Reference: the documents' own texts, in order: the rule's bounds depend on a document's characters and its
    # seams, not on where it lands.
    assert passages_of(layout.format(a=A, b=B)) == [A, B]
    assert passages_of(layout.format(a=B, b=A)) == [B, A]


def test_a_paragraph_keeps_its_single_newlines_and_short_lines_stay_text():
    wrapped = "Decorators wrap a function\nin another function, returning\na new callable that adds behaviour."
    text = f"Title\n\n{wrapped}\n\nShort line.\n\n{A}"
    assert passages_of(text) == [wrapped, A]
    assert all(len(p) >= MIN_PASSAGE_CHARS for p in passages_of(text))


def test_overlapping_windows_and_passages_that_contain_one_another():
    words = A.split() + B.split()
    first, second = " ".join(words[:18]), " ".join(words[10:])  # a text splitter's windows, 8 words shared
    assert passages_of(f"{first}\n\n{second}") == [first, second]
    assert passages_of(f"{A}\n\n{A} {B}") == [A, f"{A} {B}"]


def test_bounded_on_hostile_text():
    # 10^5 tiny paragraphs, a huge line of half tags, separators and labels only: linear, nothing to reuse.
    for text in ("a\n\n" * 100_000, "</" * 200_000 + ">", "---\n" * 50_000, "[1] " * 100_000,
                 "<" + "x" * 100_000 + ">", "\n" * 200_000, "<a>" * 50_000):
        t0 = time.perf_counter()
        spans = passage_spans(text)
        assert time.perf_counter() - t0 < 5, text[:20]
        for a, b in spans:
            assert 0 <= a < b <= len(text) and text[a:b] == text[a:b].strip()


def test_spans_are_in_order_inside_the_text_and_stripped_on_random_text():
    rng = random.Random(0)
    pieces = ["\n", "\n\n", "---", "[3] ", "<doc>", "</doc>", " ", "\t", "\u00a0", "\u2028", "é", "日本",
              "🙂", "\r\n", A, B, "word", "Document 4: "]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        spans = passage_spans(text)
        assert spans == sorted(spans)
        assert all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:], strict=False))
        for a, b in spans:
            assert text[a:b] == text[a:b].strip() and b - a >= MIN_PASSAGE_CHARS


# ---- the index of passages sent ------------------------------------------------------------------------------
def key(i):
    return f"chunk-{i:040x}"


def test_index_is_bounded_per_namespace_least_recently_sent_first():
    index = PassageIndex(max_passages=3, kv_bytes_per_token=10, max_kv_bytes=10_000)
    index.add("a", [(key(i), 10) for i in range(3)])
    index.add("a", [(key(0), 10)])  # sent again: most recent
    index.add("a", [(key(3), 10)])
    assert [index.seen("a", key(i)) for i in range(4)] == [True, False, True, True]
    assert not index.seen("b", key(0)) and not index.seen(None, key(0))  # another namespace learns nothing
    index.add("a", [(key(4), 995)])  # 9,950 bytes of KV: the others no longer fit beside it
    assert index.seen("a", key(4)) and not index.seen("a", key(3)) and len(index) <= 2
    with pytest.raises(PCRagError):
        PassageIndex(max_passages=0)


def test_index_forgets_the_least_recently_active_namespace():
    index = PassageIndex(max_namespaces=2)
    for ns in ("a", "b", "c"):
        index.add(ns, [(key(1), 5)])
    assert not index.seen("a", key(1)) and index.seen("b", key(1)) and index.seen("c", key(1))


def test_index_is_bounded_over_every_namespace_the_least_recently_active_giving_first():
    """Reference: the entries each namespace added, counted by hand. Without a bound over all namespaces, each of
    4096 tenants could hold 100,000 entries (a server's memory growing with its tenants)."""
    index = PassageIndex(max_total=5)
    index.add("a", [(key(i), 1) for i in range(3)])
    index.add("b", [(key(i), 1) for i in range(3)])  # 6 entries: a's oldest goes
    assert len(index) == 5 and not index.seen("a", key(0)) and index.seen("a", key(1))
    index.add("c", [(key(i), 1) for i in range(4)])  # a gives its last two, then b its oldest
    assert len(index) == 5 and index.stats()["namespaces"] == 2
    assert [index.seen("b", key(i)) for i in range(3)] == [False, False, True]
    assert all(index.seen("c", key(i)) for i in range(4))
    index.clear()
    index.add("d", [(key(i), 1) for i in range(5)])  # the count starts again from nothing
    assert len(index) == 5 and all(index.seen("d", key(i)) for i in range(5))


# ---- the engine ---------------------------------------------------------------------------------------------
def test_nothing_changes_before_a_passage_repeats(loaded):
    engine, plain = new_engine(loaded), new_engine(loaded)
    plain.reuse_passages = False
    prompt = rag([0, 1, 2], "what is described?")
    ref = plain.generate(prompt, max_new_tokens=8)
    got = engine.generate(prompt, max_new_tokens=8)
    assert got.prompt_ids == ref.prompt_ids == (engine.tokenizer.bos_token_id,) + tuple(
        engine.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert got.token_ids == ref.token_ids and got.cached_tokens == ref.cached_tokens == 0
    assert not kinds(got)
    other = rag([3, 4], "and this?")  # nothing of it sent before: logits as with passages off
    assert torch.equal(engine.next_token_logits(other), plain.next_token_logits(other))


def test_reordered_passages_are_reused_as_chunks_with_the_same_tokens(loaded):
    engine = new_engine(loaded)
    engine.generate(rag([0, 1, 2], "what is x?"), max_new_tokens=4)
    assert engine.stats()["passages"]["encoded_after_reply"] >= 3  # the documents (and the header)
    prompt = rag([3, 1, 0], "what is y?")
    gen = engine.generate(prompt, max_new_tokens=8)
    assert kinds(gen) == [("passage", "memory"), ("passage", "memory")]
    assert gen.prompt_ids[1:] == tuple(engine.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    reused = sum(s.tokens for s in gen.sources if s.kind == "passage")
    header = next(s.tokens for s in gen.sources if s.source == "prefix")
    assert reused >= 2 * 100 and gen.cached_tokens >= reused + header
    # Reference: the same token ids as a list of segments, the reused passages as registered-style chunks, on an
    # engine that has seen nothing (its chunks are encoded on their own, as the passages were).
    segments = engine.split(prompt)
    as_chunks = [Chunk(s.text, token_ids=s.token_ids) if s.passage and s.text in (DOCS[0], DOCS[1])
                 else Text(s.text, token_ids=s.token_ids) for s in segments]
    ref_engine = new_engine(loaded)
    ref = ref_engine.generate(as_chunks, max_new_tokens=8)
    assert ref.prompt_ids == gen.prompt_ids
    assert [s.kind for s in ref.sources if s.kind == "chunk"] == ["chunk", "chunk"]
    diff = (engine.next_token_logits(prompt) - ref_engine.next_token_logits(as_chunks)).abs().max().item()
    assert diff <= 1e-4
    assert gen.token_ids == ref.token_ids


def test_a_lone_passage_first_equals_full(loaded):
    engine = new_engine(loaded)
    engine.generate(HEADER + DOCS[2] + "\n\nQuestion: first?\nAnswer:", max_new_tokens=2)
    prompt = DOCS[2] + "\n\nQuestion: and now what does it say?\nAnswer:"
    gen = engine.generate(prompt, max_new_tokens=12)
    assert kinds(gen) == [("passage", "memory")]
    full = engine.generate(prompt, mode="full", max_new_tokens=12)
    assert gen.token_ids == full.token_ids
    diff = (engine.next_token_logits(prompt) - engine.next_token_logits(prompt, mode="full")).abs().max().item()
    assert diff <= 1e-4


def test_exact_and_full_never_use_passages(loaded):
    engine = new_engine(loaded)
    engine.generate(rag([0, 1, 2], "q1?"), max_new_tokens=2)
    prompt = rag([2, 0], "q2?")
    exact = engine.generate(prompt, mode="exact", max_new_tokens=8)
    assert not kinds(exact)
    diff = (engine.next_token_logits(prompt, "exact") - engine.next_token_logits(prompt, "full")).abs().max()
    assert diff.item() <= 1e-4
    blend = engine.generate(rag([1, 2], "q3?"), mode="blend", max_new_tokens=2)  # blend does reuse them
    assert kinds(blend) == [("passage", "memory")] * 2 and blend.recomputed_tokens > 0


def test_the_exact_prefix_wins_over_passages(loaded):
    engine = new_engine(loaded)
    engine.generate(rag([0, 1, 2], "q1?"), max_new_tokens=2)
    # The same documents in the same order: all of it is the exact prefix, nothing is relocated.
    gen = engine.generate(rag([0, 1, 2], "another question?"), max_new_tokens=2)
    assert not kinds(gen) and gen.cached_tokens >= gen.prompt_tokens - 12


def test_a_passage_that_tokenizes_otherwise_is_not_reused(loaded):
    engine = new_engine(loaded)
    engine.generate(rag([0, 1], "q1?"), max_new_tokens=2)
    # "[n] " before each document: its first token takes the space (" The" where it was "The"), so its tokens,
    # and its key, differ: it stays text and is computed with the prompt.
    prompt = HEADER + "\n".join(f"[{n}] {DOCS[i]}" for n, i in enumerate([1, 0], 1)) + "\n\nQuestion: q?\nAnswer:"
    segments = [s for s in engine.split(prompt) if s.passage and s.text.strip() in (DOCS[0], DOCS[1])]
    old = [s for s in engine.split(rag([0, 1], "q1?")) if s.passage and s.text in (DOCS[0], DOCS[1])]
    assert {s.token_ids for s in segments}.isdisjoint({s.token_ids for s in old})
    gen = engine.generate(prompt, max_new_tokens=2)
    assert not kinds(gen)
    assert gen.prompt_ids[1:] == tuple(engine.tokenizer(prompt, add_special_tokens=False)["input_ids"])


def test_passages_are_reused_only_in_the_namespace_that_sent_them(loaded):
    engine = new_engine(loaded)
    engine.generate(rag([0, 1, 2], "q1?"), max_new_tokens=2, cache_salt="alice")
    prompt = rag([2, 1], "q2?")
    assert not kinds(engine.generate(prompt, max_new_tokens=2, cache_salt="bob"))
    assert not kinds(engine.generate(prompt, max_new_tokens=2))
    assert kinds(engine.generate(prompt, max_new_tokens=2, cache_salt="alice")) == [("passage", "memory")] * 2


def test_a_busy_engine_encodes_passages_when_they_repeat(loaded):
    engine = new_engine(loaded)
    engine.traffic.running += 1  # another request in flight: no speculative encodes after the reply
    try:
        engine.generate(rag([0, 1], "q1?"), max_new_tokens=2)
        assert engine.stats()["passages"]["encoded_after_reply"] == 0
        second = engine.generate(rag([1, 0], "q2?"), max_new_tokens=2)
    finally:
        engine.traffic.running -= 1
    assert kinds(second) == [("passage", "computed"), ("passage", "computed")]  # sent before: encoded now
    assert engine.stats()["passages"]["encoded"] == 2
    third = engine.generate(rag([3, 0, 1], "q3?"), max_new_tokens=2)
    assert kinds(third) == [("passage", "memory"), ("passage", "memory")]


def test_passages_from_first_sight_are_encoded_on_their_own_at_once(loaded):
    """`passages_from_first_sight`: a new passage is encoded on its own and reused in its first prompt, as a marked
    document is: the reply equals the same token ids given with the passages as registered-style chunks."""
    engine = new_engine(loaded)
    engine.passages_from_first_sight = True
    prompt = rag([0, 1], "q1?")
    explained = [(r.kind, r.tier) for r in engine.explain(prompt).rows if r.kind == "passage"]
    gen = engine.generate(prompt, max_new_tokens=8)
    assert kinds(gen) == [("passage", "computed")] * 3  # the header and the two documents
    assert [k for k, _ in explained] == ["passage"] * 3
    assert engine.stats()["passages"]["encoded"] == 3 and engine.stats()["passages"]["encoded_after_reply"] == 0
    first = new_engine(loaded)
    first.passages_from_first_sight = True
    logits = first.next_token_logits(prompt)
    as_chunks = [Chunk(s.text, token_ids=s.token_ids) if s.passage else Text(s.text, token_ids=s.token_ids)
                 for s in engine.split(prompt)]
    ref_engine = new_engine(loaded)
    ref = ref_engine.generate(as_chunks, max_new_tokens=8)
    assert ref.prompt_ids == gen.prompt_ids and gen.token_ids == ref.token_ids
    assert (logits - ref_engine.next_token_logits(as_chunks)).abs().max().item() <= 1e-4
    again = engine.generate(rag([3, 0, 1], "q3?"), max_new_tokens=2)  # the header was a passage too
    assert kinds(again) == [("passage", "memory"), ("passage", "computed"), ("passage", "memory"),
                            ("passage", "memory")]
    engine.passages_from_first_sight = False  # off: a new passage is text again (documents 0, 1 are stored)
    off = engine.generate(rag([4, 1, 0], "q4?"), max_new_tokens=2)
    assert kinds(off) == [("passage", "memory")] * 3


QUESTION = "Question 123456: what does this documentation say about item 7 of the list above?"


def test_the_text_a_reply_answers_is_never_a_passage():
    # Reference: the question's characters, written out; the documents before it stay passages.
    markers = pc_rag.passages.marker_pattern(["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"])
    chat = (f"<|start_header_id|>system<|end_header_id|>\n\n{A}\n\n{B}<|eot_id|><|start_header_id|>user"
            f"<|end_header_id|>\n\n{QUESTION}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    for text, answered in [(chat, QUESTION), (f"Documents:\n\n{A}\n\n{B}\n\n{QUESTION}", QUESTION),
                           (f"{A}\n\n{B}\n\n{QUESTION}\nAnswer:", f"{QUESTION}\nAnswer:"),
                           (f"{A}\n\n{B}\n\nWhy?\n\nAnswer:", "Why?"),  # short: no passage to drop, A and B stay
                           (f"<|im_start|>user\n{A}\n\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n", QUESTION)]:
        a, b = pc_rag.passages.answered_span(text, 0, len(text), markers)
        assert text[a:b] == answered
        spans = pc_rag.text_index.with_passages(text, [], markers)
        found = [text[s.start:s.end].removeprefix("system\n").removeprefix("user\n") for s in spans]
        assert found == ([A, B] if B in text else [A])
    assert passages_of(f"{A}\n\n{QUESTION}") == [A, QUESTION]  # the cut rule alone knows no question


@pytest.mark.parametrize("first_sight", [False, True])
@pytest.mark.parametrize("mode", ["modular", "blend"])
def test_the_question_is_computed_in_context(loaded, mode, first_sight):
    """The question (sent before, or new with first sight) is never reused as a passage: its KV equals a forward
    over its tokens after the very cache the request built before it (<= 1e-4, fp32), and so do the logits. Before
    the rule it was a passage encoded alone (it never saw the documents it asks about)."""
    from pc_rag.options import GenerationOptions
    from pc_rag.request import prefill

    engine = new_engine(loaded)
    engine.passages_from_first_sight = first_sight
    question = f"Question: {QUESTION}\nAnswer:"
    engine.generate(HEADER + DOCS[0] + "\n\n" + DOCS[1] + "\n\n" + question, max_new_tokens=2)
    prompt = HEADER + DOCS[1] + "\n\n" + DOCS[0] + "\n\n" + question
    asm = prefill(engine, prompt, GenerationOptions(mode=mode))
    try:
        assert kinds_of(asm.pieces).count("passage") >= 2  # the documents
        ids, positions = asm.plan.ids, asm.plan.positions
        q0 = max(s for s in range(len(ids)) if engine.tokenizer.decode(ids[s:]).strip() == question)
        cache = engine.runner.new_cache(len(ids))
        for dst, src in zip(cache.block_views(0, q0), asm.cache.read(0, q0), strict=True):
            dst.copy_(src)
        cache.length = q0
        logits = engine.runner.forward(cache, list(ids[q0:]), list(positions[q0:]), list(range(q0, len(ids))))
        for got, ref in zip(asm.cache.read(q0, len(ids)), cache.read(q0, len(ids)), strict=True):
            assert (got - ref).abs().max().item() <= 1e-4
        assert (asm.logits - logits).abs().max().item() <= 1e-4
        assert asm.pieces[-1].source == "fresh"
    finally:
        engine.runner.release_cache(asm.cache)


def kinds_of(pieces):
    return [p.kind for p in pieces if p.kind in ("passage", "chunk")]


def test_a_passage_twice_in_one_prompt_and_explain(loaded):
    engine = new_engine(loaded)
    engine.generate(rag([0, 1], "q1?"), max_new_tokens=2)
    prompt = rag([1, 3, 1], "q2?")
    before = engine.stats()["passages"]
    explained = engine.explain(prompt)
    rows = [(r.kind, r.tier) for r in explained.rows if r.kind == "passage"]
    assert rows == [("passage", "memory"), ("passage", "memory")]
    assert engine.stats()["passages"] == before  # explaining remembers and encodes nothing
    gen = engine.generate(prompt, max_new_tokens=4)
    assert kinds(gen) == rows
    assert [s.kind for s in gen.sources] == [r.kind for r in explained.rows]


def test_unusual_unicode_and_whitespace_keep_the_joined_tokens(loaded):
    engine = new_engine(loaded)
    odd = ["Ünïcödé ☃ text — with “quotes” and \u00a0spaces,\ttabs and emoji 🙂🙂 repeated " * 2,
           "line one\r\nline two\u2028line three, long enough to be a passage on its own here.",
           "日本語のテキストも文書として使われることがあります。" * 3]
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        prompt = "Docs:\n\n" + "\n\n".join(odd[i] for i in order) + "\n\nQ?"
        gen = engine.generate(prompt, max_new_tokens=2)
        assert gen.prompt_ids[1:] == tuple(engine.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        assert "".join(s.text for s in engine.split(prompt)) == prompt
    assert engine.stats()["passages"]["reused"] >= 1
