"""Constrained decoding (pc_rag.grammar): every output matches its grammar on the random-weight tiny model, whose
unconstrained text is never valid JSON, so validity can only come from the per-step mask."""

import json
import re
import sys
import threading

import jsonschema
import pytest

import pc_rag
from pc_rag import Chunk, Grammar, Text
from pc_rag.errors import OptionError, OptionTypeError
from pc_rag.grammar import Grammars
from pc_rag.store import MemoryStore

# Bounded strings and numbers: a random model never closes a free string by itself (it ran past 200 tokens in 3
# of 20 samples), so the schemas a random model must finish bound what it may write.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "alerts": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["city", "days", "unit"],
}


def test_json_schema_outputs_validate_100_of_100(engine):
    grammar = Grammar.json_schema(WEATHER)
    texts = [engine.generate("The weather, as JSON:", max_new_tokens=120, grammar=grammar, temperature=1.0,
                             seed=seed).text for seed in range(100)]
    for text in texts:
        jsonschema.validate(json.loads(text), WEATHER)
    assert len(set(texts)) > 50  # sampled: these are 100 different outputs, not one repeated
    assert engine.grammars.compiles == 1  # compiled once for the 100 requests


def test_free_decoding_of_the_same_prompts_is_not_json(engine):
    """The reference the test above is measured against: without the grammar the model writes no JSON."""
    texts = [engine.generate("The weather, as JSON:", max_new_tokens=40, temperature=1.0, seed=seed).text
             for seed in range(10)]
    assert not any(_is_json(t) for t in texts)


def _is_json(text):
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_greedy_constrained_tokens_are_the_argmax_of_the_allowed_ones(engine):
    """Reference: the grammar's matcher replayed by hand (llguidance's own mask, one byte per token) over the engine's
    own next-token logits at each step."""
    import torch

    grammar = Grammar.json_schema(WEATHER)
    prompt = [Text("The weather, as JSON:")]
    got = engine.generate(prompt, max_new_tokens=60, grammar=grammar, mode="full")
    matcher = engine.grammars.compiled(grammar).deep_copy()
    vocab = engine.grammars.vocab_size
    prompt_ids = list(got.prompt_ids)
    for i, token in enumerate(got.token_ids):
        logits = engine.runner.reference_logits(prompt_ids + list(got.token_ids[:i])).clone()
        allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)[:vocab] > 0
        logits[:vocab][~allowed] = float("-inf")
        assert int(torch.argmax(logits)) == token, i
        assert matcher.consume_token(token)
    assert matcher.is_stopped()  # it ended with EOS, where the grammar ends


def test_json_object_output_is_an_object(engine):
    finished = 0
    for seed in range(20):
        gen = engine.generate("JSON:", max_new_tokens=150, grammar=Grammar.json_object(), temperature=1.0, seed=seed)
        if gen.finish_reason == "stop":  # any object: free strings may run past max_new_tokens
            assert isinstance(json.loads(gen.text), dict)
            finished += 1
        else:
            assert gen.text.startswith("{")
    assert finished >= 5


def test_choice_and_regex(engine):
    choices = ["yes", "no", "it depends"]
    for seed in range(20):
        assert engine.generate("Well?", max_new_tokens=10, grammar=Grammar.choice(choices), temperature=1.0,
                               seed=seed).text in choices
        text = engine.generate("Code:", max_new_tokens=12, grammar=Grammar.regex(r"[A-Z]{2}-[0-9]{3}"),
                               temperature=1.0, seed=seed).text
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", text), text


def test_streamed_pieces_join_to_the_constrained_text(engine):
    pieces = list(engine.stream("Weather:", max_new_tokens=120, grammar=Grammar.json_schema(WEATHER)))
    jsonschema.validate(json.loads("".join(pieces)), WEATHER)


def _questions(docs, n):
    return [[Text("Answer from the documents.\n\n"), Chunk(docs[i % 4]), Text(f"\n\nQuestion {i}: as JSON?\n")]
            for i in range(n)]


def test_constrained_and_free_rows_in_one_batch_equal_each_alone(loaded, docs):
    """Reference: the same requests one at a time on an engine that never batches; here they run concurrently, so
    constrained rows and free rows share decode steps (max_batch_seen >= 2), each with its own grammar state."""
    model, tok = loaded
    prompts = _questions(docs, 6)
    # A small schema, so that its rows finish inside max_new_tokens and their text can be checked whole.
    flag = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
            "required": ["ok", "n"]}
    grammars = [Grammar.json_schema(flag), None, Grammar.choice(["alpha", "beta"]), None,
                Grammar.regex(r"[a-z]{3,8}"), Grammar.json_schema(flag)]
    kwargs = [dict(grammar=g, max_new_tokens=40) for g in grammars]
    kwargs[3].update(temperature=0.9, seed=3)
    serial = pc_rag.testing.one_at_a_time(pc_rag.Engine(model, tok, store=MemoryStore()))
    expected = [serial.generate(p, **k) for p, k in zip(prompts, kwargs, strict=True)]
    batched = pc_rag.Engine(model, tok, store=MemoryStore())
    got = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def run(i):
        start.wait()
        got[i] = batched.generate(prompts[i], **kwargs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert batched.stats()["decode"]["max_batch_seen"] >= 2
    jsonschema.validate(json.loads(got[0].text), flag)
    assert got[2].text in ("alpha", "beta")


def test_compiled_once_per_grammar_and_bounded(engine):
    grammars = Grammars(engine.tokenizer, engine.grammars.vocab_size, engine.eos_ids, max_compiled=2)
    a, b, c = Grammar.choice(["a"]), Grammar.choice(["b"]), Grammar.choice(["c"])
    first = grammars.compiled(a)
    assert grammars.compiled(Grammar.choice(["a"])) is first and grammars.compiles == 1  # equal grammars: one entry
    grammars.compiled(b)
    grammars.compiled(a)  # a is now the most recently used
    grammars.compiled(c)  # evicts b
    assert len(grammars) == 2 and grammars.compiles == 3
    grammars.compiled(b)
    assert grammars.compiles == 4


def test_grammar_values_are_checked():
    with pytest.raises(OptionError, match="kind"):
        Grammar("yaml", "")
    with pytest.raises(OptionError, match="not JSON"):
        Grammar.json_schema("{not json")
    with pytest.raises(OptionTypeError):
        Grammar.json_schema(["a list"])
    with pytest.raises(OptionTypeError):
        Grammar.choice("yes")
    with pytest.raises(OptionError):
        Grammar.choice([])
    with pytest.raises(OptionTypeError, match="grammar"):
        pc_rag.GenerationOptions(grammar={"type": "object"})
    assert Grammar.json_schema('{"type": "object", "b": 1, "a": 2}').source.index('"b"') < \
        Grammar.json_schema({"type": "object", "b": 1, "a": 2}).source.index('"a"')  # key order is kept


def test_a_pydantic_model_is_a_schema():
    from pydantic import BaseModel

    class Answer(BaseModel):
        answer: str
        score: int

    assert json.loads(Grammar.json_schema(Answer).source)["required"] == ["answer", "score"]


def test_a_schema_that_does_not_compile_is_an_option_error(engine):
    with pytest.raises(OptionError, match="regex grammar does not compile"):
        engine.generate("x", grammar=Grammar.regex("(unclosed"))


def test_without_llguidance_the_error_says_how_to_install_it(engine, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance raises ImportError
    fresh = Grammars(engine.tokenizer, engine.grammars.vocab_size, engine.eos_ids)
    with pytest.raises(OptionError, match=r"pip install \"llguidance"):
        fresh.compiled(Grammar.json_object())
    assert engine.generate("no grammar needs no llguidance", max_new_tokens=2).token_ids
