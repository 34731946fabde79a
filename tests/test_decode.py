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


def _reference_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The distribution sampled from, by the whole sort: probabilities outside the nucleus zeroed, renormalized."""
    sorted_p, order = torch.sort(probs, descending=True)
    drop = (torch.cumsum(sorted_p, -1) - sorted_p) >= top_p
    drop[0] = False
    sorted_p[drop] = 0.0
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return kept / kept.sum()


@pytest.mark.parametrize("vocab,spread,top_p", [(6, 1.0, 1.0), (6, 1.0, 0.7), (300, 1.0, 0.9), (300, 6.0, 0.9),
                                                (300, 2.0, 1.0)])
def test_sampled_tokens_follow_the_softmax_and_the_nucleus(vocab, spread, top_p):
    """Frequencies over 20,000 draws against the probabilities (temperature 0.8): every token within 5 standard
    errors of its probability (plus 2e-3), none drawn outside the nucleus. vocab 300 with a flat spread has its
    nucleus past the first candidates (the whole sort); with spread 6 it lies among them (topk)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(vocab, generator=g) * spread
    want = _reference_nucleus(torch.softmax(logits / 0.8, -1), top_p)
    sampler = Sampler(Sampling(temperature=0.8, top_p=top_p, seed=5))
    n = 20_000
    counts = torch.bincount(torch.tensor([sampler(logits) for _ in range(n)]), minlength=vocab).double()
    got = counts / n
    assert torch.all(got[want == 0] == 0)
    error = 5 * torch.sqrt(want * (1 - want) / n) + 2e-3
    assert torch.all((got - want).abs() <= error), (got - want).abs().max()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_sampling_from_logits_with_nan_or_inf_is_an_error_not_a_token(bad):
    logits = torch.zeros(50)
    logits[7] = bad
    for top_p in (1.0, 0.9):
        with pytest.raises(RuntimeError, match="cannot sample"):
            Sampler(Sampling(temperature=1.0, top_p=top_p, seed=0))(logits)


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
