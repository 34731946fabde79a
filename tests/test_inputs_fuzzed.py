"""Every public entry that takes text, fed what a fuzzer builds from text, PML and chat messages: a reply, or a
`PCRagError` naming the input, never another exception (a TypeError from inside the tokenizer, a KeyError or
AttributeError from a malformed message, a template's own error).

Reference: the exception family (`pc_rag.PCRagError`), and for a reply its own accounting (every prompt token
cached or computed). Texts hold any code point, lone surrogates included (what a broken client or a bad decode
produces), chat templates' special tokens, and documents long enough to be passages (pc_rag.passages), so the
passage path of `Engine.split` runs. `PC_RAG_FUZZ_EXAMPLES` raises the number of examples per test (the issue's
10-minute run: docs/design.md, "Reliability").
"""

from __future__ import annotations

import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as hst  # noqa: E402

import pc_rag  # noqa: E402
from pc_rag import Chunk, Text  # noqa: E402
from pc_rag.adapters import GenerationOptions, chat_request, completion_prompt, stream_chat  # noqa: E402
from pc_rag.store import MemoryStore  # noqa: E402

EXAMPLES = int(os.environ.get("PC_RAG_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="PC_RAG_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])

DOC = ("The for statement is used to iterate over the elements of a sequence (such as a string, tuple or list) "
       "or other iterable object.")
# Pieces a prompt string is made of: seams of passages, labels, chat templates' markers, a document (a passage once
# joined with blank lines), and characters a tokenizer or an XML parser cares about.
PIECES = ["\n\n", "\n", "---", "[1] ", "Document 2: ", "<doc id=3>", "</doc>", "<|eot_id|>", "<|begin_of_text|>",
          "<|end_of_text|>", "<|start_header_id|>user<|end_header_id|>", DOC, DOC[:40], " ", "\x00", "😀", "\u2028",
          "&", "<", ">"]
SURROGATES = ["\ud800", "\udfff", "\udc80"]
VALID = hst.lists(hst.one_of(hst.text(alphabet=hst.characters(exclude_categories=("Cs",)), max_size=12),
                             hst.sampled_from(PIECES)), max_size=8).map("".join)
# Valid text two times in three: an example with one lone surrogate anywhere ends at the first check.
TEXT = hst.one_of(VALID, VALID, hst.lists(hst.one_of(hst.text(alphabet=hst.characters(exclude_categories=()),
                                                              max_size=12), hst.sampled_from(PIECES + SURROGATES)),
                                          max_size=8).map("".join))
SCHEMA = ('<schema name="s"><system>Answer from the documents.</system><user><module name="doc">' + DOC +
          '</module><module name="q"><parameter name="p" length="8"/></module></user></schema>')
PML_PIECES = ["<doc/>", '<q p="hi"/>', "<q/>", "<user>", "</user>", "<assistant>", "</assistant>", "<system>",
              "</system>", "&amp;", "&#xD800;", "&#0;", "<x/>", "<![CDATA[<doc/>]]>"]
PML_BODY = hst.lists(hst.one_of(TEXT, hst.sampled_from(PML_PIECES)), max_size=6).map("".join)
JUNK = hst.recursive(hst.none() | hst.booleans() | hst.integers() | TEXT,
                     lambda inner: hst.lists(inner, max_size=3) | hst.dictionaries(TEXT, inner, max_size=3),
                     max_leaves=5)
TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a term up.", "parameters": {
    "type": "object", "properties": {"term": {"type": "string"}}, "required": ["term"]}}}
ROLE = hst.sampled_from(["system", "user", "assistant", "tool"])
CALL = {"function": {"name": "lookup", "arguments": '{"term": "x"}'}}
# Well-formed messages with any text, most of the time, so that most examples reach the tokenizer and the decode
# loop; junk in any field the rest of the time.
MESSAGE = hst.one_of(
    *[hst.fixed_dictionaries({"role": ROLE, "content": TEXT}, optional={"tool_calls": hst.just([CALL])})] * 3,
    hst.fixed_dictionaries({"role": ROLE | TEXT | JUNK}, optional={
        "content": TEXT | hst.none() | JUNK, "tool_calls": JUNK | hst.just([CALL]), "reasoning_content": TEXT}))
MESSAGES = hst.one_of(*[hst.lists(MESSAGE, min_size=1, max_size=4)] * 3, hst.lists(MESSAGE | JUNK, max_size=4), JUNK)
TOOLS = hst.one_of(hst.none(), hst.none(), hst.just([TOOL]), hst.just([TOOL]),
                   hst.lists(hst.dictionaries(TEXT, JUNK, max_size=2), max_size=2).map(lambda junk: [TOOL, *junk]),
                   hst.just([{"function": {"name": "f", "description": "\ud800"}}]))
OPTIONS = hst.fixed_dictionaries({"mode": hst.sampled_from(["modular", "exact", "blend", "full"]),
                                  "max_new_tokens": hst.integers(1, 3),
                                  "stop": hst.none() | hst.lists(TEXT, max_size=2)})


@pytest.fixture(scope="module")
def engine(loaded):
    model, tok = loaded
    engine = pc_rag.Engine(model, tok, store=MemoryStore())
    engine.add_schema(SCHEMA)
    return engine


def _reply_or_pc_rag_error(call) -> None:
    """`call()`'s reply, checked for its token accounting, or a PCRagError (anything else fails the test)."""
    try:
        out = call()
    except pc_rag.PCRagError as e:
        event(type(e).__name__)
        return
    event("reply")
    generation = getattr(out, "generation", out)
    if isinstance(generation, pc_rag.Generation):
        assert generation.cached_tokens + generation.computed_tokens == generation.prompt_tokens


@FUZZ
@given(text=TEXT, pieces=hst.lists(hst.tuples(hst.booleans(), TEXT), min_size=1, max_size=4), options=OPTIONS,
       entry=hst.sampled_from(["generate", "stream", "explain", "split", "logits", "segments", "register", "warm",
                               "prefetch", "marked"]))
def test_plain_strings_and_segments(engine, text, pieces, options, entry):
    segments = [Chunk(t) if chunk else Text(t) for chunk, t in pieces] if all(
        pc_rag.segments.unicode_problem(t) is None for _, t in pieces) else None
    calls = {
        "generate": lambda: engine.generate(text, **options),
        "stream": lambda: list(engine.stream_generation(text, **options))[-1],
        "explain": lambda: engine.explain(text, mode=options["mode"]),
        "split": lambda: engine.split(text, chunk_texts=[t for _, t in pieces]),
        "logits": lambda: engine.next_token_logits(text, mode=options["mode"]),
        "segments": lambda: engine.generate(segments if segments is not None else [Text(t) for _, t in pieces],
                                            **options),
        "register": lambda: engine.register([text, *(t for _, t in pieces)]),
        "warm": lambda: engine.warm([t for _, t in pieces], progress=False),
        "prefetch": lambda: engine.prefetch([text]).result(timeout=60),
        "marked": lambda: engine.generate(completion_prompt(engine, text + DOC, [t for _, t in pieces]), **options),
    }
    _reply_or_pc_rag_error(calls[entry])


@FUZZ
@given(body=PML_BODY, schema=hst.booleans(), options=OPTIONS)
def test_pml_prompts_and_schemas(engine, body, schema, options):
    if schema:
        _reply_or_pc_rag_error(lambda: engine.add_schema(f'<schema name="t{abs(hash(body))}">{body}</schema>'))
    else:
        _reply_or_pc_rag_error(lambda: engine.generate(pc_rag.PML(f'<prompt schema="s">{body}</prompt>'), **options))


@FUZZ
@given(messages=MESSAGES, tools=TOOLS, tool_choice=hst.sampled_from([None, None, "auto", "required", "lookup", "none"]),
       chunks=hst.lists(TEXT, max_size=2), options=OPTIONS)
def test_chat_messages_and_tools(engine, messages, tools, tool_choice, chunks, options):
    opts = GenerationOptions(mode=options["mode"], max_new_tokens=options["max_new_tokens"], stop=options["stop"])

    def call():
        request = chat_request(engine, messages, opts, tools=tools, tool_choice=tool_choice, chunk_texts=chunks)
        return list(stream_chat(engine, request))[-1]

    _reply_or_pc_rag_error(call)


@pytest.mark.parametrize("call, words", [
    (lambda e: e.generate("Context.\n\n" + DOC + "\ud800\n\n" + DOC + "\n\nQ?"), "the prompt string holds a lone "
                                                                                "surrogate '\\\\ud800' at character"),
    (lambda e: e.generate(pc_rag.PML('<prompt schema="s">\n<doc/>\ud800</prompt>')),
     "PML prompt at line 2, column 6 holds a lone surrogate"),
    (lambda e: chat_request(e, [{"role": "user", "content": "hi"}, {"role": "user", "content": DOC + "\udc80"}],
                            GenerationOptions()), r"messages\[1\]\.content holds a lone surrogate"),
    (lambda e: chat_request(e, [{"role": "user", "content": "hi"}], GenerationOptions(),
                            tools=[{"function": {"name": "f", "description": "\ud800"}}]),
     r"tools\[0\]\.function\.description holds a lone surrogate"),
    (lambda e: chat_request(e, [{"role": "user", "content": "hi", "tool_calls": [{"function": {}}]}],
                            GenerationOptions()), r"messages\[0\]\.tool_calls\[0\] must be a dict naming its function"),
    (lambda e: chat_request(e, ["hi"], GenerationOptions()), r"messages\[0\] must be a role/content dict, got str"),
    (lambda e: e.prefetch(["ok", "x\ud800"]), r"texts\[1\] holds a lone surrogate"),
    (lambda e: e.split("hi", chunk_texts=["\ud800"]), r"chunk_texts\[0\] holds a lone surrogate"),
])
def test_text_a_tokenizer_cannot_take_is_a_prompt_error_naming_where_it_is(engine, call, words):
    """The cases of issue 56: before, a plain string whose passages were found, and chat content, raised the
    tokenizer's TypeError ("TextEncodeInput must be Union[...]") naming nothing; a malformed message an
    AttributeError or a KeyError."""
    with pytest.raises(pc_rag.PromptError, match=words):
        call(engine)


def test_a_template_that_refuses_the_messages_is_a_prompt_error(engine, monkeypatch):
    """Real chat templates refuse some conversations themselves (`raise_exception("Conversation roles must
    alternate user/assistant/user/assistant/...")`); that is the caller's input, named as such."""
    template = engine.tokenizer.chat_template
    monkeypatch.setattr(engine.tokenizer, "chat_template",
                        "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('roles must alternate') }}"
                        "{% endif %}" + template)
    with pytest.raises(pc_rag.PromptError, match="the model's chat template refused the messages: roles must "
                                                 "alternate"):
        chat_request(engine, [{"role": "assistant", "content": "hi"}], GenerationOptions())
    assert chat_request(engine, [{"role": "user", "content": "hi"}], GenerationOptions()).prompt
