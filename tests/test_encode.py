"""Chunks encoded in one batched pass (`Assembler.encode_chunks`, `LlamaRunner.encode_apart`: a block-diagonal
prefill) against each chunk encoded alone.

Reference: each chunk through a forward of its own after the sink, what a chunk's encode ran before (and what
`Engine.warm` runs): keys, values and the last token's logits within 1e-5 (fp32: a product over more rows may round
differently in the last bits), through pc_rag's prefill kernel and through sdpa; split into forwards of the prefill
chunk while other requests decode, a chunk longer than that through `forward`'s own chunks. At the engine, a
prompt's new chunks cost one encode forward, and its logits equal those of the same prompt over chunks warmed one
at a time.
"""

import pytest

import pc_rag
from pc_rag import Chunk, Text
from pc_rag.store import MemoryStore

TOLERANCE = 1e-5


def pieces(engine, docs, lengths=(3, 17, 40, 64, 121)):
    """Sequences as the assembler encodes them: the sink (BOS) at 0, then a chunk's tokens from position 1."""
    ids = [t for d in docs for t in engine.segmenter.ids(d)]
    bos = list(engine.planner.sink_ids)
    out, at = [], 0
    for n in lengths:
        out.append(bos + ids[at: at + n])
        at += n
    return out, [list(range(len(bos))) + list(range(len(bos), len(p))) for p in out]


def alone(runner, ids, positions):
    """Each sequence in a forward of its own: (cache, logits) each."""
    out = []
    for t, p in zip(ids, positions, strict=True):
        cache = runner.new_cache(len(t))
        out.append((cache, runner.forward_layers(cache, t, p, list(range(len(t))))))
    return out


def assert_same_kv(got, want):
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.read(0, g.length), w.read(0, w.length), strict=True):
            assert a.shape == b.shape and (a - b).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("native", [True, False])  # pc_rag's prefill kernel where it runs, and sdpa
def test_one_batched_pass_equals_each_chunk_alone(engine, docs, native):
    runner = engine.runner
    ids, positions = pieces(engine, docs)
    try:
        runner.choose_backends(native)
        want = alone(runner, ids, positions)
        caches, forwards = runner.encode_apart(ids, positions)
        assert forwards == 1
        assert_same_kv(caches, [c for c, _ in want])
        # the same forward's logits, one row per chunk (what encode_apart leaves unused)
        logits = runner.forward_rows([runner.new_cache(len(t)) for t in ids], ids, positions,
                                     [list(range(len(t))) for t in ids])
        for row, (_, ref) in zip(logits, want, strict=True):
            assert (row - ref).abs().max().item() <= TOLERANCE * max(1.0, ref.abs().max().item())
    finally:
        runner.choose_backends(True)


def test_while_others_decode_forwards_hold_a_prefill_chunk_at_most(engine, docs):
    runner = engine.runner
    ids, positions = pieces(engine, docs, lengths=(20, 30, 10, 150, 40))
    want = alone(runner, ids, positions)
    chunk, busy = runner.prefill_chunk_tokens, runner.others_decoding
    runs = []
    forward_rows = runner.forward_rows
    runner.forward_rows = lambda caches, ids, *a, **k: runs.append(sum(map(len, ids))) or forward_rows(
        caches, ids, *a, **k)
    try:
        runner.prefill_chunk_tokens, runner.others_decoding = 64, lambda: True
        caches, forwards = runner.encode_apart(ids, positions)
    finally:
        runner.prefill_chunk_tokens, runner.others_decoding = chunk, busy
        del runner.forward_rows
    # 21 + 31 + 11 together, then 151 alone in forward's chunks of 64, then 41: in order, each <= 64 tokens
    assert forwards == 3 and runs == [63, 64, 64, 23, 41]
    assert_same_kv(caches, [c for c, _ in want])


def test_a_prompts_new_chunks_are_one_encode_forward(loaded, docs):
    model, tok = loaded
    prompt = [Text("Answer from the documents.\n\n")]
    for d in docs:
        prompt += [Chunk(d), Text("\n\n")]
    prompt.append(Text("Question: what do they say?\nAnswer:"))
    engine = pc_rag.Engine(model, tok, store=MemoryStore())
    logits = engine.next_token_logits(prompt)
    encodes = engine.stats()["encodes"]
    # every chunk and the separator between them ("\n\n" reused as a block): one forward
    assert encodes["request"] == {"forwards": 1, "chunks": len(docs) + 1, "tokens": encodes["request"]["tokens"]}
    warmed = pc_rag.Engine(model, tok, store=MemoryStore())
    warmed.warm([c for c in prompt if isinstance(c, Chunk)])  # one forward per chunk
    assert warmed.stats()["encodes"]["other"]["forwards"] == len(docs)
    ref = warmed.next_token_logits(prompt)
    assert (logits - ref).abs().max().item() <= 1e-4
