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


# ---- OpenAI's penalties and logit bias, logprobs, token texts ---------------------------------------------------
def test_penalties_and_logit_bias_follow_openais_formula():
    """Reference: OpenAI's documented formula, mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty +
    bias[j], c[j] being how often j was generated before, computed here by hand at every step; the sampler (greedy)
    must choose its argmax, and its recorded logprobs must be the log-softmax of the adjusted logits."""
    torch.manual_seed(0)
    steps = [torch.randn(50) * 3 for _ in range(12)]
    bias = {7: 2.5, 11: -100.0, 3: 1.0}
    sampler = Sampler(Sampling(presence_penalty=0.7, frequency_penalty=1.3, logit_bias=bias, logprobs=3))
    counts: dict[int, int] = {}
    for k, logits in enumerate(steps):
        expected = logits.clone()
        for j, b in bias.items():
            expected[j] += b
        for j, c in counts.items():
            expected[j] -= c * 1.3 + 0.7
        token = sampler(logits)
        assert token == int(torch.argmax(expected)), k
        counts[token] = counts.get(token, 0) + 1
        record = sampler.logprobs(k + 1)[k]
        reference = torch.log_softmax(expected, -1)
        assert record.logprob == pytest.approx(float(reference[token]), abs=1e-5)
        values, order = torch.topk(reference, 3)
        assert [t.token_id for t in record.top] == order.tolist()
        assert [t.logprob for t in record.top] == pytest.approx(values.tolist(), abs=1e-5)
        assert torch.equal(logits, steps[k])  # the caller's row (a batched step's tensor) is left as it was
    assert 11 not in counts  # banned by -100
    assert len(counts) > 3  # the penalties moved the choice off a token once it was chosen


def test_no_logprobs_no_pieces_and_the_computed_ahead_token_is_left_out():
    sampler = Sampler(Sampling())
    token = sampler(torch.tensor([0.0, 5.0, 1.0]))
    assert token == 1 and sampler.logprobs(1) is None
    assert type(sampler.piece("text", 1)) is str  # plain text: nothing changes for callers that never asked
    recording = Sampler(Sampling(logprobs=0))
    for _ in range(3):
        recording(torch.tensor([0.0, 5.0, 1.0]))
    # The decode loop may choose a token the request never takes (it computes ahead): `upto` says what it took.
    assert len(recording.logprobs(2)) == 2 and recording.logprobs(2)[0].top == ()
    piece = recording.piece("ab", 2)
    assert piece == "ab" and len(piece.logprobs) == 2 and recording.piece("", 3) == ""
    assert len(recording.piece("c", 3).logprobs) == 1
    assert len(recording.gaps(3)) == 2 and all(g >= 0 for g in recording.gaps(3))


@pytest.mark.parametrize("kwargs, name", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {5: 101}}, r"logit_bias\[5\]"),
    ({"logit_bias": [1, 2]}, "logit_bias"), ({"logit_bias": "5"}, "logit_bias"), ({"n": 0}, "n"),
])
def test_token_options_are_checked_naming_them(kwargs, name):
    with pytest.raises(pc_rag.PCRagError, match=name):
        pc_rag.GenerationOptions(**kwargs)
    if "n" not in kwargs:
        with pytest.raises(pc_rag.PCRagError, match=name):
            Sampling(**kwargs)


def test_token_texts_are_the_tokens_bytes(loaded):
    """Reference: the tokenizer's own encoding of a text; the tokens' bytes, joined, are the text's UTF-8 bytes
    (multi-byte characters split over tokens included), so a client that joins `bytes` gets the text back."""
    from pc_rag.decode import TokenTexts

    _, tok = loaded
    text = "naïve café — 日本語 and ascii"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    texts = TokenTexts(tok)
    assert b"".join(texts(i)[1] for i in ids) == text.encode()
    assert texts(tok.eos_token_id)[0] == tok.eos_token


def test_token_texts_of_a_sentencepiece_vocabulary():
    """SentencePiece writes a space as U+2581 and a byte as <0xNN> (Llama 2, Mistral, Gemma)."""
    from pc_rag.decode import TokenTexts

    class Vocab:
        all_special_ids = [0]
        pieces = {0: "<s>", 1: "\u2581the", 2: "<0xE2>", 3: "ing"}

        def convert_ids_to_tokens(self, i):
            return self.pieces.get(i)

    texts = TokenTexts(Vocab())
    assert [texts(i)[1] for i in range(5)] == [b"<s>", b" the", b"\xe2", b"ing", b""]
    assert texts(2)[0] == "\ufffd"


def _hf_logprobs(engine, generation, top: int):
    """The reference: per generated token, the log-softmax of an HF forward (the model's own, no pc_rag cache) over
    the prompt and the reply before it; the token's value and the `top` most likely."""
    ids = list(generation.prompt_ids)
    out = []
    for k, token in enumerate(generation.token_ids):
        ref = torch.log_softmax(engine.runner.reference_logits(ids + list(generation.token_ids[:k])), dim=-1)
        values, order = torch.topk(ref, top)
        out.append((float(ref[token]), order.tolist(), values.tolist()))
    return out


def _assert_logprobs_match(engine, generation, top):
    assert len(generation.logprobs) == len(generation.token_ids)
    for entry, token, (value, order, values) in zip(generation.logprobs, generation.token_ids,
                                                    _hf_logprobs(engine, generation, top), strict=True):
        assert entry.token_id == token and entry.logprob == pytest.approx(value, abs=1e-4)
        assert [t.logprob for t in entry.top] == pytest.approx(values, abs=1e-4)
        assert [t.token_id for t in entry.top] == order or sorted(values) != values[::-1]


@pytest.mark.parametrize("mode", ["full", "exact"])
def test_logprobs_equal_the_log_softmax_of_an_hf_forward(engine, docs, mode):
    """Greedy, so the logits the sampler used are the model's: every token's logprob and its top 5 against the
    reference within 1e-4 (fp32), streamed pieces carrying the same entries in order."""
    prompt = [Text("Answer from the documents.\n\n"), Chunk(docs[0]), Text("\nQuestion: what is it?\nAnswer:")]
    engine.generate(prompt, mode="exact", max_new_tokens=2)  # a cached prefix for the exact run
    got = engine.generate(prompt, mode=mode, max_new_tokens=10, logprobs=5)
    _assert_logprobs_match(engine, got, 5)
    assert got.logprobs[0].token == engine.tokenizer.decode(got.token_ids[:1])
    pieces = list(engine.stream(prompt, mode=mode, max_new_tokens=10, logprobs=5))
    assert "".join(pieces) == got.text
    streamed = [e for p in pieces for e in p.logprobs]
    assert [e.token_id for e in streamed] == list(got.token_ids[: len(streamed)])
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in got.logprobs[: len(streamed)]])


def test_logprobs_with_bias_and_penalties_are_those_of_the_adjusted_logits(engine, docs):
    """The logits the sampler used: the HF forward's, plus the bias, minus the penalties of the tokens generated
    before (OpenAI's formula), log-softmaxed."""
    prompt = [Chunk(docs[1]), Text("\nAnswer:")]
    bias = {5: 3.0, 17: -2.0}
    got = engine.generate(prompt, max_new_tokens=8, logprobs=2, logit_bias=bias, presence_penalty=0.5,
                          frequency_penalty=0.8)
    ids, counts = list(got.prompt_ids), {}
    for k, token in enumerate(got.token_ids):
        logits = engine.runner.reference_logits(ids + list(got.token_ids[:k])).clone()
        for j, b in bias.items():
            logits[j] += b
        for j, c in counts.items():
            logits[j] -= c * 0.8 + 0.5
        reference = torch.log_softmax(logits, -1)
        assert token == int(torch.argmax(reference))
        assert got.logprobs[k].logprob == pytest.approx(float(reference[token]), abs=1e-4)
        counts[token] = counts.get(token, 0) + 1


def test_logprobs_of_concurrent_requests_equal_the_reference(loaded, docs):
    """Requests at the same time, their first tokens and the rest chosen in the shared step (batch.py) when they
    overlap: each one's logprobs against its own reference. (That they overlap depends on the machine's load: rows
    of one batch for certain, n > 1: tests/test_choices.py.)"""
    import threading

    model, tok = loaded
    engine = pc_rag.Engine(model, tok, store=pc_rag.store.MemoryStore())
    prompts = [[Chunk(docs[i]), Text(f"\nQuestion {i}: why?\nAnswer:")] for i in range(3)]
    got = [None] * 3

    def run(i):
        got[i] = engine.generate(prompts[i], max_new_tokens=12, logprobs=2)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for g in got:
        _assert_logprobs_match(engine, g, 2)
