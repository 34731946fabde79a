"""Blend (selective recomputation) and scaffolds, against `full` and `modular`.

Blend with ratio 1 recomputes every reused chunk token in context: it must equal full (<= 1e-4 fp32).
Ratio 0 recomputes nothing: it must equal modular exactly. A scaffold group reused in the order it was
declared is exact inside the group: a prompt made of the group equals full.
"""

import pytest
import torch

import pc_rag
from pc_rag import Chunk, Text
from pc_rag.assemble import SELECTIONS, first_tokens, recompute_work, tokens_per_layer


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


@pytest.mark.parametrize("select", SELECTIONS)
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


def test_forward_layers_equals_forward(engine, docs):
    # blend's layer-by-layer forward, with nothing narrowed, is the same forward as HF's (<= 1e-5 fp32): tokens
    # written to scattered slots over a cache that already holds others, the keys and values it writes included.
    ids = engine.segmenter.ids(docs[0] + docs[1])[:60]
    positions = list(range(3, 3 + len(ids)))
    runner = engine.runner
    rest = list(range(1, 60, 3))  # recomputed over a cache whose every slot holds a token's KV
    caches = [runner.new_cache(64), runner.new_cache(64)]
    for c in caches:
        runner.forward(c, ids, positions, list(range(60)))
    want = runner.forward(caches[0], [ids[s] for s in rest], [positions[s] for s in rest], rest)
    got = runner.forward_layers(caches[1], [ids[s] for s in rest], [positions[s] for s in rest], rest)
    assert (got - want).abs().max().item() <= 1e-5
    assert (caches[1].keys[:, :, :, :60] - caches[0].keys[:, :, :, :60]).abs().max().item() <= 1e-5


def test_first_tokens_takes_the_same_number_from_every_chunk():
    spans = [[0, 1, 2], [5, 6], [9, 10, 11, 12]]
    assert first_tokens(spans, 3) == [0, 5, 9]
    assert first_tokens(spans, 5) == [0, 5, 9, 1, 6]
    assert sorted(first_tokens(spans, 9)) == [0, 1, 2, 5, 6, 9, 10, 11, 12]
    assert len(first_tokens(spans, 20)) == 9


def test_tokens_per_layer():
    assert tokens_per_layer("chunk_start", 20, 100, 4) == [20, 20, 20, 20]
    assert tokens_per_layer("deviation", 20, 100, 4) == [100, 20, 20, 20]
    assert tokens_per_layer("progressive", 20, 100, 4) == [100, 60, 40, 20]  # 3x at layer 1, down to 1x
    assert tokens_per_layer("progressive", 20, 100, 8) == [100, 60, 40, 20, 20, 20, 20, 20]
    assert tokens_per_layer("progressive", 20, 100, 2) == [100, 20]  # the last layer keeps the budget
    assert tokens_per_layer("progressive", 50, 100, 4) == [100, 100, 100, 50]
    assert tokens_per_layer("progressive", 0, 100, 4) == [0, 0, 0, 0]
    assert recompute_work("progressive", 0.2, 100, 4) == pytest.approx(0.55)
    assert recompute_work("chunk_start", 0.2, 100, 8) == pytest.approx(0.2)
    assert recompute_work("deviation", 1.0, 100, 8) == 1.0


@pytest.mark.parametrize("select", ["deviation", "progressive", "shift"])
def test_narrowing_keeps_the_budget_in_the_last_layer(warmed, docs, select):
    warmed.blend_selection = select
    gen = warmed.generate(rag(docs, (2, 3, 0)), mode="blend", recompute_ratio=0.25, max_new_tokens=1)
    relocated = sum(s.tokens for s in gen.sources if s.source in ("chunk", "scaffold"))
    # the last layer keeps the budget, in tokens (a separator block encoded by this very request is computed, not
    # reused, so it is not counted)
    assert abs(gen.recomputed_tokens - 0.25 * relocated) <= 0.02 * relocated


@pytest.mark.parametrize("select", SELECTIONS)
def test_blend_ratio_zero_equals_modular(warmed, docs, select):
    warmed.blend_selection = select
    prompt = rag(docs, (1, 2))
    lm = warmed.next_token_logits(prompt, "modular")
    lb = warmed.next_token_logits(prompt, "blend", recompute_ratio=0.0)
    # The same KV; only float rounding may differ: the first call computed the leading text and the question in
    # one forward, the second reuses the leading text (automatic prefix reuse) and computes the question alone.
    assert (lb - lm).abs().max().item() <= 1e-5


@pytest.mark.parametrize("select", SELECTIONS)
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
    assert abs(gen.recomputed_tokens - 0.3 * relocated) <= 0.02 * relocated  # the share is counted in tokens
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


# ---- a quality target instead of a fixed ratio (assemble.Recompute.target) ------------------------------------
def _reordered(docs):
    return [Text("You answer questions about Python.\n\n"), Chunk(docs[2]), Text("\n\n"), Chunk(docs[0]),
            Text("\n\n"), Chunk(docs[1]), Text("\n\nQuestion: what do they say?\nAnswer:")]


@pytest.fixture(params=["progressive", "shift"])
def probed_by(request, engine):
    """A target read from layer 1's key deviation (any selection but shift) or from the cheap probe (shift)."""
    before = engine.blend_selection
    engine.blend_selection = request.param
    yield request.param
    engine.blend_selection = before


def test_a_quality_target_spans_modular_to_full(engine, docs, probed_by):
    """References: target 0 recomputes nothing and gives modular's logits, target 1 recomputes every token that
    deviates (all of them) and gives full's, within 1e-4 (fp32); in between, a higher target never recomputes
    fewer tokens; the probe's deviation is reported."""
    prompt = _reordered(docs)
    engine.warm(docs[:3], progress=False)
    modular = engine.next_token_logits(prompt, "modular")
    full = engine.next_token_logits(prompt, "full")
    assert (engine.next_token_logits(prompt, "blend", recompute_target=0.0) - modular).abs().max().item() <= 1e-4
    assert (engine.next_token_logits(prompt, "blend", recompute_target=1.0) - full).abs().max().item() <= 1e-4
    counts = [engine.generate(prompt, mode="blend", max_new_tokens=1, recompute_target=t).recomputed_tokens
              for t in (0.0, 0.5, 0.8, 0.95, 1.0)]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] > 0
    gen = engine.generate(prompt, mode="blend", max_new_tokens=1, recompute_target=0.8)
    assert gen.deviation is not None and gen.deviation > 0
    assert engine.measured_deviation["shift" if probed_by == "shift" else "keys"] > 0


def test_an_easy_prompt_costs_modulars_work(engine, docs, probed_by):
    """A lone chunk first sits where it was encoded: its keys do not deviate, so a target recomputes nothing
    (reference: full, which a lone chunk first equals), where the same target on reordered chunks recomputes some."""
    engine.warm(docs[:3], progress=False)
    lone = [Chunk(docs[0]), Text("\n\nQuestion: what is it?")]
    easy = engine.generate(lone, mode="blend", max_new_tokens=4, recompute_target=0.9)
    assert easy.recomputed_tokens == 0 and easy.deviation < 1e-3
    assert easy.token_ids == engine.generate(lone, mode="full", max_new_tokens=4).token_ids
    hard = engine.generate(_reordered(docs), mode="blend", max_new_tokens=1, recompute_target=0.9)
    assert hard.recomputed_tokens > 0 and hard.deviation > easy.deviation
    with pytest.raises(pc_rag.OptionError):
        engine.generate(lone, mode="blend", recompute_target=1.5)


def _layer0_attention(runner, ids, positions):
    """HF's own layer-0 attention output (after o_proj) for every token: the reference for `context_shift`."""
    got = []
    handle = runner.model.model.layers[0].self_attn.register_forward_hook(lambda m, a, out: got.append(out[0]))
    try:
        with torch.inference_mode():
            runner.model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]))
    finally:
        handle.remove()
    return got[0][0].float()


def test_context_shift_is_layer_zeros_move_in_context(engine, docs):
    # The cheap probe of the "shift" selection: for each reused token, |o_proj(attention in context - attention
    # as its block was encoded)| at layer 0, from the ids alone. Against HF's own layer-0 attention in two
    # forwards (the whole prompt; the sink and the chunk at its encoded positions), 1e-4 of the largest shift, fp32.
    runner, sink = engine.runner, list(engine.planner.sink_ids)
    text = list(engine.segmenter.ids(docs[1])[:30])
    chunk = list(engine.segmenter.ids(docs[2])[:25])
    ids = sink + text + chunk
    positions = list(range(len(ids)))
    first = len(sink) + len(text)  # the chunk's first slot (and position)
    encoded_at = len(sink)  # where Engine encodes a chunk: right after the sink
    in_context = _layer0_attention(runner, ids, positions)[first:]
    alone = _layer0_attention(runner, sink + chunk, list(range(len(sink))) + list(range(encoded_at,
                                                                                      encoded_at + len(chunk))))
    want = (in_context - alone[len(sink):]).norm(dim=-1)
    rows = list(range(first, len(ids)))
    assert want.max() > 0.1  # the text before the chunk moves it
    other = list(range(len(sink), first))
    try:
        for native in (True, False):  # attention through pc_rag's prefill kernel where it runs, and through sdpa
            runner.choose_backends(native)
            got = runner.context_shift(ids, positions, rows, [(first, first - encoded_at)] * len(rows), sink)
            assert (got - want).abs().max() <= 1e-4 * want.max(), native
            # a block's later rows only, beside a second block: each row against its own block
            got = runner.context_shift(ids, positions, [*other, *rows[5:]], [(len(sink), 0)] * len(other)
                                       + [(first, first - encoded_at)] * len(rows[5:]), sink)
            assert (got[len(other):] - want[5:]).abs().max() <= 1e-4 * want.max(), native
            assert got[: len(other)].abs().max() <= 1e-4 * want.max()  # a block at its own place: exact
    finally:
        runner.choose_backends(True)


def test_shift_computes_layer_zero_for_what_its_probe_picked_only():
    assert tokens_per_layer("shift", 20, 100, 4) == [60, 60, 40, 20]
    assert tokens_per_layer("shift", 50, 100, 4) == [100, 100, 100, 50]  # 3 x 50 > 100: all of them
    # the probe costs `probe` of a layer per candidate, only where it picks (below 3 x the share)
    assert recompute_work("shift", 0.2, 100, 4, probe=0.2) == pytest.approx((180 + 20) / 400)
    assert recompute_work("shift", 0.5, 100, 4, probe=0.2) == pytest.approx(350 / 400)
    # a target read from the probe ran it whatever it chose, nothing included
    assert recompute_work("shift", 0.5, 100, 4, probe=0.2, target=True) == pytest.approx((350 + 20) / 400)
    assert recompute_work("shift", 0.0, 100, 4, probe=0.2, target=True) == pytest.approx(20 / 400)


def test_many_scattered_rows_equal_a_plain_forward(engine, docs):
    # Blend's first layers recompute most slots, scattered: pc_rag's prefill kernel takes each row's slot where it
    # runs; without it, from 2 x ROWS_PER_BLOCK rows on, that masked attention runs in blocks of rows, each over the
    # keys up to its last slot. Both ways, the last token's logits against HF's plain forward over the whole
    # sequence (the other slots hold their exact KV), 1e-4 fp32.
    from pc_rag.model.attention import ROWS_PER_BLOCK

    ids = [t for d in docs for t in engine.segmenter.ids(d)] * 3
    ids = ids[: 2 * ROWS_PER_BLOCK + 200]
    runner = engine.runner
    rows = [s for s in range(len(ids)) if s % 7 != 3]  # every slot but a seventh, the last included
    assert len(rows) >= 2 * ROWS_PER_BLOCK and rows[-1] == len(ids) - 1
    want = runner.reference_logits(ids)
    try:
        for native in (True, False):
            runner.choose_backends(native)
            cache = runner.new_cache(len(ids))
            runner.forward(cache, ids, list(range(len(ids))), list(range(len(ids))))
            got = runner.forward_layers(cache, [ids[s] for s in rows], rows, rows)
            assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item(), native
    finally:
        runner.choose_backends(True)
