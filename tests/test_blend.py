"""Blend (selective recomputation) and scaffolds, against `full` and `modular`.

Blend with ratio 1 recomputes every reused chunk token in context: it must equal full (<= 1e-4 fp32).
Ratio 0 recomputes nothing: it must equal modular exactly. A scaffold group reused in the order it was
declared is exact inside the group: a prompt made of the group equals full.
"""

import pytest
import torch

import pc_rag
from pc_rag import Chunk, Text


def rag(docs, order, q="Question: what is described?"):
    parts = [Text("Answer from the documents.\n\n")]
    for i in order:
        parts += [Chunk(docs[i]), Text("\n\n")]
    return parts + [Text(q)]


def kl(lf, lm):
    return float(torch.sum(lf.softmax(-1) * (lf.log_softmax(-1) - lm.log_softmax(-1))))


@pytest.fixture
def warmed(engine, docs):
    engine.warm(docs, progress=False)
    return engine


@pytest.mark.parametrize("select", ["deviation", "chunk_start"])
def test_blend_ratio_one_equals_full(warmed, docs, select):
    warmed.blend_selection = select
    prompt = rag(docs, (2, 0, 1))
    lf = warmed.next_token_logits(prompt, "full")
    lb = warmed.next_token_logits(prompt, "blend", recompute_ratio=1.0)
    assert (lb - lf).abs().max().item() <= 1e-4
    gen = warmed.generate(prompt, mode="blend", recompute_ratio=1.0, max_new_tokens=12)
    assert gen.token_ids == warmed.generate(prompt, mode="full", max_new_tokens=12).token_ids
    # every relocated token (chunks and the separators between them) was recomputed
    relocated = sum(s.tokens for s in gen.sources if s.source in ("chunk", "scaffold"))
    assert relocated >= sum(len(warmed.segmenter.ids(docs[i])) for i in (2, 0, 1))
    assert gen.recomputed_tokens == relocated


@pytest.mark.parametrize("layer", [0, 1])  # the tiny model has 2 layers
def test_probe_keys_equal_a_full_prefill(engine, docs, layer):
    # The deviation probe runs `layer` layers and then only the key projection: its keys must be the ones
    # a plain HF prefill stores for that layer (<= 1e-5 fp32), at shifted positions too.
    ids = engine.segmenter.ids(docs[0] + docs[1])[:80]
    positions = list(range(7, 7 + len(ids)))
    out = engine.runner.model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]), use_cache=True)
    want = out.past_key_values.layers[layer].keys[0]  # [H_kv, T, D]
    with torch.inference_mode():
        got = engine.runner.probe_keys(ids, positions, layer)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5


def test_blend_ratio_zero_equals_modular(warmed, docs):
    prompt = rag(docs, (1, 2))
    lm = warmed.next_token_logits(prompt, "modular")
    lb = warmed.next_token_logits(prompt, "blend", recompute_ratio=0.0)
    # The same KV; only float rounding may differ: the first call computed the leading text and the question in
    # one forward, the second reuses the leading text (automatic prefix reuse) and computes the question alone.
    assert (lb - lm).abs().max().item() <= 1e-5


@pytest.mark.parametrize("select", ["deviation", "chunk_start"])
def test_blend_partial_is_between_and_counts_tokens(warmed, docs, select, record_property):
    warmed.blend_selection = select
    prompt = rag(docs, (3, 1, 2, 0))
    lf = warmed.next_token_logits(prompt, "full")
    kl_modular = kl(lf, warmed.next_token_logits(prompt, "modular"))
    kl_blend = kl(lf, warmed.next_token_logits(prompt, "blend", recompute_ratio=0.3))
    record_property(f"kl_modular_{select}", kl_modular)
    record_property(f"kl_blend_0.3_{select}", kl_blend)
    gen = warmed.generate(prompt, mode="blend", recompute_ratio=0.3, max_new_tokens=4)
    relocated = sum(s.tokens for s in gen.sources if s.source in ("chunk", "scaffold"))
    assert abs(gen.recomputed_tokens - 0.3 * relocated) <= 8  # rounding per block for chunk_start
    assert gen.cached_tokens + gen.computed_tokens == gen.prompt_tokens
    assert kl_blend < kl_modular  # recomputing in context moves the output towards full


def test_blend_works_with_relocated_gqa_keys_in_bf16(tiny_path, docs):
    engine = pc_rag.Engine.from_pretrained(tiny_path, dtype="bfloat16", store="memory")
    engine.warm(docs[:2], progress=False)
    gen = engine.generate(rag(docs, (1, 0)), mode="blend", max_new_tokens=4)
    assert gen.recomputed_tokens > 0 and len(gen.token_ids) == 4


def test_bad_ratio(engine, docs):
    with pytest.raises(pc_rag.PCRagError, match="recompute_ratio"):
        engine.generate(rag(docs, (0,)), mode="blend", recompute_ratio=1.5)


def test_scaffold_group_reused_in_order_equals_full(engine, docs):
    engine.add_scaffold([docs[0], docs[1]])
    group = [Chunk(docs[0]), Text("\n\n"), Chunk(docs[1]), Text("\n\nQuestion: how are they related?")]
    first = engine.generate(group, max_new_tokens=8)
    assert [s.kind for s in first.sources] == ["bos", "scaffold", "text"]
    again = engine.generate(group, max_new_tokens=8)
    assert again.sources[1].origin == "memory"
    assert again.token_ids == engine.generate(group, mode="full", max_new_tokens=8).token_ids
    lf = engine.next_token_logits(group, "full")
    assert (engine.next_token_logits(group, "modular") - lf).abs().max().item() <= 1e-4


def test_scaffold_is_closer_to_full_than_independent_chunks(engine, docs, record_property):
    prompt = rag(docs, (2, 0, 1))
    lf = engine.next_token_logits(prompt, "full")
    independent = kl(lf, engine.next_token_logits(prompt, "modular"))
    engine.add_scaffold([docs[2], docs[0], docs[1]])
    scaffolded = kl(lf, engine.next_token_logits(prompt, "modular"))
    record_property("kl_independent", independent)
    record_property("kl_scaffolded", scaffolded)
    assert scaffolded < independent
    # a different order is not the declared group: the chunks are used one by one
    gen = engine.generate(rag(docs, (0, 2, 1)), max_new_tokens=1)
    assert "scaffold" not in [s.kind for s in gen.sources]
