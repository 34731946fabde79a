"""RoPE relocation: a chunk encoded at one position and rotated to p equals encoding it at p (<= 1e-4, fp32)."""

import pytest
import torch

import pc_rag
from pc_rag import Chunk, Text
from pc_rag.store import MemoryStore

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}


def encode_at(engine, ids, start):
    """Reference: run BOS + chunk directly at positions start-1, start, ...; return the chunk's keys [L,H,T,D].

    The whole sequence moves, so every relative distance (the sink's included) is what it was at 1.
    """
    seq = [engine.segmenter.bos_id, *ids]
    cache = engine.runner.new_cache(len(seq))
    engine.runner.forward(cache, seq, list(range(start - 1, start - 1 + len(seq))), list(range(len(seq))))
    return cache.block_views(1, len(seq))[0].clone()


@pytest.fixture(scope="module", params=[None, LLAMA3, YARN], ids=["default", "llama3", "yarn"])
def rope_engine(request, tmp_path_factory, loaded):
    if request.param is None:
        model, tok = loaded
        return pc_rag.Engine(model, tok, store=MemoryStore())
    path = pc_rag.testing.build_tiny_llama(tmp_path_factory.mktemp("rope"), rope_scaling=request.param)
    return pc_rag.Engine.from_pretrained(path)


@pytest.mark.parametrize("target", [5, 300, 1500])
def test_rotated_keys_equal_direct_encoding(rope_engine, docs, target):
    ids = rope_engine.segmenter.ids(docs[1])
    at_one = encode_at(rope_engine, ids, 1)
    direct = encode_at(rope_engine, ids, target)
    moved = torch.empty_like(at_one)
    rope_engine.runner.relocate(moved, at_one, target - 1)
    assert (moved - direct).abs().max().item() <= 1e-4
    # and relocation is not a no-op: the positions really differ
    assert (at_one - direct).abs().max().item() > 1e-2


def test_modular_single_chunk_with_scaled_rope_equals_full(rope_engine, docs):
    prompt = [Chunk(docs[2]), Text("\nWhat?")]
    lm = rope_engine.next_token_logits(prompt, "modular")
    lf = rope_engine.next_token_logits(prompt, "full")
    assert (lm - lf).abs().max().item() <= 1e-4


def test_dynamic_ntk_refuses_modular_but_runs_exact(tmp_path, docs):
    engine = pc_rag.Engine.from_pretrained(pc_rag.testing.build_tiny_llama(tmp_path, rope_scaling=DYNAMIC))
    prompt = [Text("Intro. "), Chunk(docs[0]), Text("\nWhat?")]
    with pytest.raises(pc_rag.UnsupportedModelError, match="dynamic"):
        engine.generate(prompt, mode="modular")
    engine.generate(prompt, mode="exact", max_new_tokens=2)
    lf = engine.next_token_logits(prompt, "full")
    assert (engine.next_token_logits(prompt, "exact") - lf).abs().max().item() <= 1e-4
