"""n replies to one prompt (`n` > 1, pc_rag/choices.py): one prefill, n rows decoding from its KV (rows of the
batched step: the logprobs of batched decoding are tested here).

References: the prefill runs once (counted at `Engine._prefill`); greedy choices equal the one-reply greedy
output token for token (the same logits, decoded as rows of one step: equal within 1e-5, fp32); each choice's
logprobs against the log-softmax of an HF forward (1e-4); seeded choices reproduce and differ from each other;
every choice of a grammar-constrained request matches the grammar."""

import re
from types import SimpleNamespace

import pytest

import pc_rag
from pc_rag import Chunk, Text
from pc_rag.decode import choice_of
from pc_rag.store import MemoryStore

from .test_decode import _assert_logprobs_match


def _prompt(docs):
    return [Text("Answer from the documents.\n\n"), Chunk(docs[0]), Text("\nQuestion: what is it about?\nAnswer:")]


def test_one_prefill_n_rows(engine, docs, monkeypatch):
    prefills = []
    real = engine.assembler.assemble
    monkeypatch.setattr(engine.assembler, "assemble", lambda *a, **k: prefills.append(1) or real(*a, **k))
    single = engine.generate(_prompt(docs), mode="full", max_new_tokens=24)
    got = engine.generate(_prompt(docs), mode="full", max_new_tokens=24, n=3, logprobs=1)
    assert len(prefills) == 2  # one for the single reply, one for the three
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.token_ids for c in got.choices] == [single.token_ids] * 3
    assert got.text == single.text and got.completion_tokens == 3 * len(single.token_ids)
    assert got.prompt_tokens == single.prompt_tokens
    for c in got.choices:
        _assert_logprobs_match(engine, SimpleNamespace(prompt_ids=got.prompt_ids, token_ids=c.token_ids,
                                                       logprobs=c.logprobs), 1)
    assert engine.stats()["decode"]["max_batch_seen"] >= 3  # the three rows shared steps
    assert engine.stats()["decode"]["active"] == 0


def test_seeded_choices_reproduce_and_differ(engine, docs):
    kwargs = dict(max_new_tokens=8, temperature=1.0, seed=11, n=3)
    a = engine.generate(_prompt(docs), **kwargs)
    b = engine.generate(_prompt(docs), **kwargs)
    assert [c.token_ids for c in a.choices] == [c.token_ids for c in b.choices]
    assert len({c.token_ids for c in a.choices}) == 3
    # Choice 0 is seeded with the request's seed: the one-reply request with that seed (same first logits).
    one = engine.generate(_prompt(docs), max_new_tokens=8, temperature=1.0, seed=11)
    assert a.choices[0].token_ids[:1] == one.token_ids[:1]


def test_streamed_choices_interleave_and_stop_on_their_own(engine, docs):
    greedy = engine.generate(_prompt(docs), max_new_tokens=12).text
    stop = greedy[len(greedy) // 2:][:2]
    pieces = list(engine.stream(_prompt(docs), max_new_tokens=12, n=2, stop=[stop]))
    joined = {0: "", 1: ""}
    for p in pieces:
        joined[choice_of(p)] += p
    expected = engine.generate(_prompt(docs), max_new_tokens=12, stop=[stop])
    assert joined == {0: expected.text, 1: expected.text}
    got = engine.generate(_prompt(docs), max_new_tokens=12, n=2, stop=[stop])
    assert [c.finish_reason for c in got.choices] == ["stop", "stop"]


def test_each_choice_keeps_to_the_grammar(engine, docs):
    grammar = pc_rag.Grammar.regex(r"[a-z]{2,6}-[0-9]{2}")
    got = engine.generate(_prompt(docs), max_new_tokens=12, n=4, temperature=1.0, seed=3, grammar=grammar)
    assert all(re.fullmatch(r"[a-z]{2,6}-[0-9]{2}", c.text) for c in got.choices), [c.text for c in got.choices]


def test_n_is_checked_and_the_buffers_go_back(loaded, docs):
    model, tok = loaded
    engine = pc_rag.Engine(model, tok, store=MemoryStore())
    with pytest.raises(pc_rag.OptionError, match="n must be at most"):
        engine.stream(_prompt(docs), n=engine.max_batch + 1)
    stream = engine.stream(_prompt(docs), max_new_tokens=20, n=3)
    next(stream)
    stream.close()  # abandoned mid-reply: every row leaves, every buffer returns
    assert engine.stats()["decode"]["active"] == 0
    assert engine.traffic.running == 0
