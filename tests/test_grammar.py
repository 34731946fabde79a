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


# ---- grammars that cannot finish (issue 56): a reply under a grammar is accepted by it, cut by the budget
# ("length"), refused at compile, or finished with "error" saying why; never "stop" and invalid ---------------------
def _string_schema(pattern: str, **extra) -> dict:
    return {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern, **extra}}, "required": ["a"]}


@pytest.mark.parametrize("grammar, words", [
    (Grammar.json_schema(_string_schema("^a$", minLength=3)), "does not compile: Unsatisfiable schema"),
    (Grammar.json_schema(_string_schema(r"^[^\s\S]$")), "does not compile: Unsatisfiable schema"),
    (Grammar.json_schema({"type": "string", "minLength": 10, "maxLength": 5}), "does not compile: Unsatisfiable"),
    (Grammar.json_schema({"type": "integer", "minimum": 10, "maximum": 5}), "does not compile: Unsatisfiable"),
    (Grammar.regex(r"[^\s\S]"), "cannot be completed: no token can continue the reply"),
    (Grammar.lark('start: "a" b\nb: b "x"'), "cannot be completed: no token can continue the reply"),
])
def test_unsatisfiable_grammars_are_refused_at_compile(engine, grammar, words):
    """Reference: the grammar's kind and llguidance's reason in an OptionError (a 400 at the server) before any
    work; those past the forced text's first dead end (the regex, the Lark rule) used to end the reply at once
    with finish_reason "stop" and an empty or one-token text."""
    with pytest.raises(OptionError, match=f"the {grammar.kind} grammar {words}"):
        engine.generate("x", grammar=grammar, max_new_tokens=4)
    assert engine.stats()["tiers"][0]["entries"] == 0  # refused before the prefill


@pytest.mark.parametrize("grammar", [
    Grammar.json_schema(_string_schema("^a{1000000}$")),
    Grammar.json_schema(_string_schema("^((a{100}){100}){100}$")),
    Grammar.regex("a{1000000}"),
])
def test_huge_repetitions_are_refused_at_compile(engine, grammar):
    """The issue's case: `^a{1000000}$` came back as `"` (or `{`) with finish_reason "stop". llguidance builds the
    string's automaton when the parse reaches it, past its lexer's limits; the compile probe walks the forced text
    ('{"a": "') to it."""
    with pytest.raises(OptionError, match=f"the {grammar.kind} grammar cannot be completed: lexer error: too many "
                                          f"expressions constructed"):
        engine.generate("x", grammar=grammar, max_new_tokens=4)


def test_a_repetition_within_the_limits_is_cut_by_the_budget(engine):
    """`a{100000}` compiles (within llguidance's limits): the reply is its forced prefix, reported as "length"."""
    got = engine.generate("x", grammar=Grammar.json_schema(_string_schema("^a{100000}$")), max_new_tokens=8)
    assert got.finish_reason == "length" and got.error is None
    assert re.fullmatch(r'\{"a": "a*', got.text), got.text


@pytest.mark.parametrize("grammar, words", [
    (Grammar.lark('start: "a" | "b" c\nc: c "x"'), "no token can continue the reply"),
    (Grammar.lark('start: "a" | "b" /x{1000000}/'), "lexer error: too many expressions constructed"),
    (Grammar.json_schema({"anyOf": [{"type": "integer"}, {"type": "string", "pattern": "^a{1000000}$"}]}),
     "lexer error: too many expressions constructed"),
])
def test_a_grammar_that_fails_while_decoding_finishes_with_error_not_stop(engine, grammar, words):
    """A branch the compile probe cannot reach (the model chooses it: pushed there by logit_bias) fails while
    decoding: finish_reason "error" and `error` saying why, for every choice and streamed alike (the same text and
    error as the first time). Reference: the branch that can finish, which does."""
    def pushed(text: str, **kwargs):
        token = engine.tokenizer(text, add_special_tokens=False)["input_ids"][0]
        return engine.generate("x", grammar=grammar, max_new_tokens=8, logit_bias={token: 100.0}, **kwargs)

    failing, finishing = ("b", "a") if grammar.kind == "lark" else ('"', "7")
    got = pushed(failing)
    assert got.text.startswith(failing) and got.finish_reason == "error", got
    assert got.error.startswith("the grammar could not be completed: ") and words in got.error
    # The branch that can finish still does after the failure (Grammars.forget: the failed copy's lexer is not
    # shared with the next request's).
    ok = pushed(finishing)
    assert ok.text.startswith(finishing) and ok.error is None and ok.finish_reason in ("stop", "length"), ok
    if grammar.kind == "lark":
        assert (ok.text, ok.finish_reason) == ("a", "stop")
    several = pushed(failing, n=2)
    assert [c.finish_reason for c in several.choices] == ["error", "error"]
    assert all(words in c.error for c in several.choices)
    token = engine.tokenizer(failing, add_special_tokens=False)["input_ids"][0]
    *_, streamed = engine.stream_generation("x", grammar=grammar, max_new_tokens=8, logit_bias={token: 100.0})
    assert (streamed.finish_reason, streamed.text, streamed.error) == ("error", got.text, got.error)


def test_a_stop_string_is_stop_only_where_the_grammar_accepts_the_text_it_left(engine):
    """The matcher took the stop string's tokens too, so the text a stop string leaves is judged on its own:
    "alpha" is one of ["alpha", "alpha beta"] but not of ["alpha beta"]. EOS is pushed away so the model writes
    " beta" where it may stop."""
    eos = {t: -100.0 for t in engine.eos_ids}
    accepted = engine.generate("x", grammar=Grammar.choice(["alpha", "alpha beta"]), stop=[" beta"],
                               logit_bias=eos, max_new_tokens=8)
    assert (accepted.text, accepted.finish_reason, accepted.error) == ("alpha", "stop", None)
    cut = engine.generate("x", grammar=Grammar.choice(["alpha beta"]), stop=[" beta"], max_new_tokens=8)
    assert (cut.text, cut.finish_reason) == ("alpha", "error")
    assert cut.error == "a stop string ended the reply before its grammar was complete"


@pytest.mark.parametrize("schema", [
    {"enum": [f"value-{i}" for i in range(5000)]},  # a large enum: a large lexer, within the limits
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 3, "maxItems": 3},
    {"type": "object", "properties": {f"k{i}": {"type": "boolean"} for i in range(200)}},  # 200 optional keys
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(x|yy|zzz){2,40}$"}}, "required": ["a"]},
    {"type": "string", "maxLength": 0},
    json.loads('{"type": "object", "properties": {"a": ' * 30 + '{"type": "integer"}' + "}}" * 30),
])
def test_schemas_at_the_engines_limits_finish_valid_or_cut_never_stop_and_invalid(engine, schema):
    """Reference: jsonschema (independent of llguidance) on every reply that says "stop"; the others are "length".
    Sampled, 8 seeds each."""
    grammar = Grammar.json_schema(schema)
    for seed in range(8):
        got = engine.generate("JSON:", grammar=grammar, max_new_tokens=40, temperature=1.0, seed=seed)
        assert got.finish_reason in ("stop", "length") and got.error is None, got
        if got.finish_reason == "stop":
            jsonschema.validate(json.loads(got.text), schema)


def test_a_schema_past_the_compilers_limits_is_an_option_error(engine):
    deep = json.loads('{"type": "object", "properties": {"a": ' * 200 + '{"type": "integer"}' + "}}" * 200)
    with pytest.raises(OptionError, match="json_schema grammar does not compile: recursion limit exceeded"):
        engine.generate("x", grammar=Grammar.json_schema(deep), max_new_tokens=4)


def test_a_refused_grammar_is_refused_again_without_compiling(engine, monkeypatch):
    """A client resending a schema past the limits costs a lookup: the same OptionError, no second compile.
    Reference: the calls to the compiler, counted."""
    grammar = Grammar.regex("a{1000000}")
    calls = []
    compile_once = Grammars._compile
    monkeypatch.setattr(Grammars, "_compile", staticmethod(lambda *a: calls.append(1) or compile_once(*a)))
    errors = []
    for _ in range(3):
        with pytest.raises(OptionError, match="cannot be completed") as e:
            engine.grammars.compiled(grammar)
        errors.append(str(e.value))
    assert len(calls) == 1 and len(set(errors)) == 1
    assert engine.grammars.compiled(Grammar.regex("ab")) is engine.grammars.compiled(Grammar.regex("ab"))
    assert len(calls) == 2
