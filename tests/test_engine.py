"""Engine modes against references: a plain HF forward, HF generate, and `full` mode.

Tolerances (fp32): 1e-5 for `full` vs a plain HF forward (same math, other kernel order), 1e-4 for
reused KV (copies and relocations add rounding).
"""

import pytest
import torch

import pc_rag
from pc_rag import Chunk, Text

from .conftest import prompt_ids


def rag_prompt(docs, order=(0, 1), question="Question: what does this describe?\nAnswer:"):
    parts = [Text("You answer questions about Python.\n\n")]
    for i in order:
        parts += [Chunk(docs[i]), Text("\n\n")]
    return parts + [Text(question)]


def test_full_equals_plain_hf_forward(engine, docs):
    prompt = rag_prompt(docs)
    ref = engine.runner.reference_logits(prompt_ids(engine, prompt))
    got = engine.next_token_logits(prompt, mode="full")
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-5


def test_full_greedy_equals_hf_generate(engine, docs):
    prompt = rag_prompt(docs)
    ids = prompt_ids(engine, prompt)
    x = torch.tensor([ids])
    hf = engine.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                               eos_token_id=None)[0, len(ids):].tolist()
    gen = engine.generate(prompt, mode="full", max_new_tokens=12)
    assert list(gen.token_ids) == hf[: len(gen.token_ids)]
    assert gen.cached_tokens == 0 and gen.computed_tokens == gen.prompt_tokens == len(ids)


def test_exact_reuses_prefix_and_matches_full(engine, docs):
    engine.generate(rag_prompt(docs, question="First question?"), mode="exact", max_new_tokens=2)
    prompt = rag_prompt(docs, question="A different question entirely?")
    segs = engine.segmenter.segments(prompt)
    gen = engine.generate(prompt, mode="exact", max_new_tokens=16)
    assert gen.computed_tokens == len(segs[-1])  # only the question
    assert gen.cached_tokens + gen.computed_tokens == gen.prompt_tokens == sum(len(s) for s in segs)
    full = engine.generate(prompt, mode="full", max_new_tokens=16)
    assert gen.token_ids == full.token_ids
    diff = (engine.next_token_logits(prompt, "exact") - engine.next_token_logits(prompt, "full")).abs().max()
    assert diff.item() <= 1e-4


def test_prefix_nodes_are_stored_after_the_reply_not_before_its_first_piece(engine, docs):
    # Storing a long prefix (to disk or Redis) between the first and second token would stall the stream;
    # the nodes are stored once the reply is out, and then serve the next request.
    puts = []
    put = engine.store.put
    engine.store.put = lambda key, block: (puts.append(block.meta.get("kind")), put(key, block))[1]
    stream = engine.stream(rag_prompt(docs, question="First question?"), mode="exact", max_new_tokens=4)
    next(stream)
    assert "prefix" not in puts
    rest = list(stream)
    assert len(rest) <= 3 and "prefix" in puts
    prompt = rag_prompt(docs, question="Another question?")
    gen = engine.generate(prompt, mode="exact", max_new_tokens=1)
    assert gen.computed_tokens == len(engine.segmenter.segments(prompt)[-1])
    # an abandoned stream still stores them (the generator's close runs the same path)
    puts.clear()
    stream = engine.stream(rag_prompt(docs, order=(1, 0)), mode="exact", max_new_tokens=4)
    next(stream)
    stream.close()
    assert "prefix" in puts


def test_exact_does_not_reuse_after_a_changed_prefix(engine, docs):
    engine.generate(rag_prompt(docs, order=(0, 1)), mode="exact", max_new_tokens=1)
    gen = engine.generate(rag_prompt(docs, order=(1, 0)), mode="exact", max_new_tokens=1)
    # BOS and the system text are shared; the chunks come in another order, so nothing after is reused.
    segs = engine.segmenter.segments(rag_prompt(docs, order=(1, 0)))
    assert gen.cached_tokens == len(segs[0]) + len(segs[1])


def test_modular_single_chunk_first_equals_full(engine, docs):
    prompt = [Chunk(docs[0]), Text("\n\nQuestion: what is it?")]
    engine.warm([docs[0]], progress=False)
    gen = engine.generate(prompt, mode="modular", max_new_tokens=16)
    assert gen.cached_tokens == len(engine.segmenter.ids(docs[0]))
    full = engine.generate(prompt, mode="full", max_new_tokens=16)
    assert gen.token_ids == full.token_ids
    diff = (engine.next_token_logits(prompt, "modular") - engine.next_token_logits(prompt, "full")).abs().max()
    assert diff.item() <= 1e-4


def test_modular_reordered_chunks_are_cached_and_divergence_is_recorded(engine, docs, record_property):
    engine.generate(rag_prompt(docs, order=(0, 1, 2)), mode="modular", max_new_tokens=2)
    prompt = rag_prompt(docs, order=(2, 3, 0))  # docs[3] is new, the others are reused at new positions
    gen = engine.generate(prompt, mode="modular", max_new_tokens=16)
    reused = sum(len(engine.segmenter.ids(docs[i])) for i in (2, 0))
    new = len(engine.segmenter.ids(docs[3]))
    assert gen.cached_tokens >= reused  # plus BOS and system text from the exact-prefix trie
    assert gen.computed_tokens >= new  # encoded by this request: computed, not reused
    assert gen.cached_tokens + gen.computed_tokens == gen.prompt_tokens
    origins = [s.origin for s in gen.sources if s.kind == "chunk"]
    assert origins == ["memory", "computed", "memory"]
    assert len(gen.token_ids) == 16 and isinstance(gen.text, str)
    again = engine.generate(prompt, mode="modular", max_new_tokens=16)
    assert again.token_ids == gen.token_ids  # reuse is deterministic
    lf = engine.next_token_logits(prompt, "full")
    lm = engine.next_token_logits(prompt, "modular")
    kl = torch.sum(lf.softmax(-1) * (lf.log_softmax(-1) - lm.log_softmax(-1))).item()
    record_property("modular_vs_full_kl", kl)
    record_property("modular_vs_full_max_logit_diff", (lf - lm).abs().max().item())
    assert kl >= 0.0 and torch.isfinite(lm).all()


def test_modular_chunk_text_only_prompt_recomputes_last_token(engine, docs):
    prompt = [Chunk(docs[0]), Chunk(docs[1])]
    engine.warm(docs[:2], progress=False)
    gen = engine.generate(prompt, mode="modular", max_new_tokens=4)
    assert gen.computed_tokens >= 1  # the last token is recomputed to get its logits
    assert gen.cached_tokens + gen.computed_tokens == gen.prompt_tokens


def test_explicit_positions_match_full_with_same_positions(engine, docs):
    # PML places modules at fixed, non-contiguous positions: a chunk encoded where it is used needs no
    # relocation, and the reference is a plain forward with the same position ids.
    n0 = len(engine.segmenter.ids(docs[0]))
    prompt = [Chunk(docs[0], position=1, encode_position=1), Text("\nQ?", position=n0 + 200)]
    segs = engine.segmenter.segments(prompt)
    ids = [t for s in segs for t in s.token_ids]
    pos = [p for s in segs for p in range(s.start, s.end)]
    ref = engine.runner.reference_logits(ids, pos)
    got = engine.next_token_logits(prompt, "modular")
    assert (got - ref).abs().max().item() <= 1e-4


def test_decode_tokens_match_a_step_by_step_reference(engine, docs):
    prompt = rag_prompt(docs)
    ids = prompt_ids(engine, prompt)
    gen = engine.generate(prompt, mode="full", max_new_tokens=6)
    seq = list(ids)
    for t in gen.token_ids:
        assert int(torch.argmax(engine.runner.reference_logits(seq))) == t
        seq.append(t)


@pytest.mark.parametrize("bad", [[], [Text("")], "", Text("a lone segment"), [42]])
def test_bad_prompts_raise_clear_errors(engine, bad):
    with pytest.raises(pc_rag.PromptError):
        engine.generate(bad)


def test_plain_string_is_one_text_segment(engine, docs):
    ref = engine.next_token_logits([Text(docs[0])], "full")
    assert torch.equal(engine.next_token_logits(docs[0], "full"), ref)


def test_unknown_mode(engine):
    with pytest.raises(pc_rag.PromptError, match="unknown mode 'fast'"):
        engine.generate([Text("hi")], mode="fast")


def test_prompt_longer_than_context(engine):
    with pytest.raises(pc_rag.PromptError, match="context of 2048"):
        engine.generate([Text("word " * 3000)])


def test_non_llama_architecture_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(tmp_path)
    with pytest.raises(pc_rag.UnsupportedModelError, match="gpt2"):
        pc_rag.Engine.from_pretrained(tmp_path)


# ---- limits and background work ----------------------------------------------------------------------------
def _spy_capacities(engine, monkeypatch):
    """Records every buffer capacity the engine asks for, and refuses (before allocating) any beyond the
    model's context: the reference is `shape.max_positions`, the most slots a request can ever fill."""
    asked, real, limit = [], engine.runner.acquire_cache, engine.runner.shape.max_positions

    def acquire(capacity, wanted=()):
        asked.append(capacity)
        if capacity > limit:
            raise MemoryError(f"asked for a {capacity}-slot buffer, beyond the context of {limit}")
        return real(capacity, wanted)

    monkeypatch.setattr(engine.runner, "acquire_cache", acquire)
    return asked


@pytest.mark.parametrize("mode", ["full", "modular"])
def test_huge_max_new_tokens_asks_for_no_more_than_the_context(engine, docs, monkeypatch, mode):
    asked = _spy_capacities(engine, monkeypatch)
    limit = engine.runner.shape.max_positions
    # The question sits 8 positions before the end of the context, so decoding runs out of positions quickly.
    prompt = [Chunk(docs[0]), Text("Question?", position=limit - 8)]
    gen = engine.generate(prompt, mode=mode, max_new_tokens=10**9)
    end = limit - 8 + len(engine.segmenter.ids("Question?"))
    assert gen.finish_reason == "length" and len(gen.token_ids) == limit - end + 1  # every position used
    assert max(asked) <= limit
    assert next(engine.stream(prompt, mode=mode, max_new_tokens=10**9))  # the stream path too
    assert max(asked) <= limit


def test_a_failing_background_scaffold_is_logged_and_counted(loaded, docs, monkeypatch, caplog):
    model, tok = loaded
    engine = pc_rag.Engine(model, tok, store="memory", auto_scaffold_after=1)
    crashed = []
    monkeypatch.setattr("threading.excepthook", crashed.append)  # what an uncaught thread exception reaches

    def broken(want):
        raise RuntimeError("disk full")

    monkeypatch.setattr(engine.assembler, "ensure_stored", broken)
    prompt = [Text("Docs:\n"), Chunk(docs[0]), Text("\n\n"), Chunk(docs[1]), Text("\n\nQ?")]
    with caplog.at_level("ERROR", logger="pc_rag"):
        engine.generate(prompt, max_new_tokens=1)
        engine.wait_for_background(timeout=60)
    assert crashed == []
    assert engine.stats()["scaffolds"] == {"groups": 0, "bytes": 0, "failed": 1}
    [record] = [r for r in caplog.records if r.name == "pc_rag"]
    assert "automatic scaffold of 2 chunks" in record.getMessage() and record.exc_info[1].args == ("disk full",)
    # The request path is unaffected: the group's prompts still run from each chunk's own KV.
    assert "scaffold" not in [s.kind for s in engine.generate(prompt, max_new_tokens=1).sources]


def test_stats_while_scaffolds_are_built(loaded, monkeypatch):
    """stats() iterated the scaffold dict while background builds added groups to it ("dictionary changed
    size during iteration"). Reference: no exception in either thread, and every group counted at the end."""
    import sys
    import threading

    from pc_rag.segments import TokenSegment

    model, tok = loaded
    engine = pc_rag.Engine(model, tok, store="memory", auto_scaffold_after=1)
    monkeypatch.setattr(engine.assembler, "ensure_stored", lambda want: None)  # no encode: only the dict
    for i in range(3000):  # a large dict, so one stats() spans many thread switches
        engine.planner.scaffolds[(10**6 + i,)] = {((10**6 + i,), (0,))}
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the race shows within a few calls
    errors, done = [], threading.Event()

    def poll():
        while not done.is_set():
            try:
                engine.stats()
            except Exception as e:  # the failure under test
                errors.append(e)
                return

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for i in range(300):
            engine.scaffolds.observe([TokenSegment("chunk", (i, 1), 0), TokenSegment("chunk", (i, 2), 2)])
        engine.wait_for_background(timeout=60)
    finally:
        done.set()
        poller.join()
        sys.setswitchinterval(old_interval)
    assert errors == []
    assert engine.stats()["scaffolds"]["groups"] == 3000 + 300


def test_engines_given_their_own_discovery_share_nothing(loaded):
    """Reference: the segments each engine cuts the same string into: only the engine watching the Discovery that
    holds the document makes it a Chunk."""
    from pc_rag.prefetch import Prefetcher
    from pc_rag.text_index import Discovery

    model, tok = loaded
    own = Discovery()
    mine = pc_rag.Engine(model, tok, store="memory", discovery=own, prefetcher=Prefetcher())
    shared = pc_rag.Engine(model, tok, store="memory")
    doc = "A document that only one engine's own discovery registry holds, about owls and lighthouses."
    own.discover([doc])
    text = "Context:\n" + doc + "\n\nQuestion: what is it about?"
    assert [type(s).__name__ for s in mine.split(text)].count("Chunk") == 1
    assert not any(isinstance(s, Chunk) for s in shared.split(text))
    assert mine.prefetcher.wait_idle(30)  # its prefetch ran on its own worker (memory only: nothing to load)
