"""Decoding: stop strings, streaming that never cuts a character, sampling controls."""

import pytest
import torch

import pc_rag
from pc_rag import Chunk, Text
from pc_rag.decode import Sampler, Sampling, TextStream


def test_stream_never_emits_partial_characters(loaded):
    _, tok = loaded
    text = "naïve café — 日本語 ☃ and ascii"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # multi-byte characters are split over several byte tokens
    stream = TextStream(tok, stop=None)
    pieces = [stream.push(i) for i in ids] + [stream.finish()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


@pytest.mark.parametrize("stop", ["日本", "é —", "and asc"])
def test_stop_strings_spanning_tokens(loaded, stop):
    _, tok = loaded
    text = "naïve café — 日本語 ☃ and ascii"
    stream = TextStream(tok, stop=[stop, "never-appears"])
    out = ""
    for i in tok(text, add_special_tokens=False)["input_ids"]:
        out += stream.push(i)
        if stream.stopped:
            break
    out += stream.finish()
    assert stream.stopped
    assert out == text[: text.index(stop)]


def test_engine_stop_string_and_stream_agree(engine, docs):
    prompt = [Chunk(docs[0]), Text("\nAnswer:")]
    free = engine.generate(prompt, max_new_tokens=20)
    assert len(free.text) > 4
    stop = free.text[2:4]  # a string the model will produce
    gen = engine.generate(prompt, max_new_tokens=20, stop=[stop])
    assert gen.finish_reason == "stop"
    assert gen.text == free.text[: free.text.index(stop)]
    assert "".join(engine.stream(prompt, max_new_tokens=20, stop=[stop])) == gen.text


def test_max_new_tokens_and_finish_reason(engine, docs):
    gen = engine.generate([Text(docs[0])], max_new_tokens=5)
    assert len(gen.token_ids) == 5 and gen.finish_reason == "length"
    items = list(engine.stream_generation([Text(docs[0])], max_new_tokens=5))
    assert isinstance(items[-1], pc_rag.Generation) and "".join(items[:-1]) == gen.text


def test_eos_stops_generation(engine, docs):
    prompt = [Text(docs[1])]
    first = engine.generate(prompt, max_new_tokens=1).token_ids[0]
    engine.eos_ids = frozenset({first})  # pretend the model's first choice is EOS
    gen = engine.generate(prompt, max_new_tokens=10)
    assert gen.token_ids == (first,) and gen.finish_reason == "stop" and gen.text == ""


def test_sampling_seed_is_reproducible_and_top_p_tiny_is_greedy(engine, docs):
    prompt = [Text(docs[2])]
    a = engine.generate(prompt, temperature=1.0, seed=7, max_new_tokens=12)
    b = engine.generate(prompt, temperature=1.0, seed=7, max_new_tokens=12)
    assert a.token_ids == b.token_ids
    greedy = engine.generate(prompt, max_new_tokens=12)
    nucleus = engine.generate(prompt, temperature=1.0, top_p=1e-6, seed=3, max_new_tokens=12)
    assert nucleus.token_ids == greedy.token_ids


def test_sampling_arguments_are_checked():
    with pytest.raises(pc_rag.PCRagError, match="top_p"):
        Sampler(Sampling(temperature=1.0, top_p=0.0))
    with pytest.raises(pc_rag.PCRagError, match="temperature"):
        Sampling(temperature=-1.0)


def test_incremental_decoding_equals_a_whole_decode(loaded):
    """Reference: tokenizer.decode of all ids at once; the stream decodes each token once (DecodeStream)."""
    _, tok = loaded
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        ids = torch.randint(0, len(tok), (300,), generator=g).tolist()
        stream = TextStream(tok, stop=None)
        out = "".join(stream.push(i) for i in ids) + stream.finish()
        assert out == tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
