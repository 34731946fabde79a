"""PML schemas and prompts → Text/Chunk lists.

Reference for token ids and positions: each piece of text tokenized on its own with the tokenizer directly
(`add_special_tokens=False`), positions by summing those lengths from 1 (0 is the BOS sink). Chat role
strings are the literal Llama-3 strings of `pc_rag.testing.CHAT_TEMPLATE`, not the derived ones. Exact
equality everywhere: there is no float in this module.
"""

from __future__ import annotations

import copy
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from pc_rag import Chunk, PCRagError, PMLError, SchemaRegistry, Text
from pc_rag.pml import chat_roles, equivalent_plain_prompt, prompt_for, schema_for_chunks
from pc_rag.segments import SegmentTokenizer

SYS_H = "<|start_header_id|>system<|end_header_id|>\n\n"
USER_H = "<|start_header_id|>user<|end_header_id|>\n\n"
ASSIST_H = "<|start_header_id|>assistant<|end_header_id|>\n\n"
EOT = "<|eot_id|>"


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from pc_rag.testing import build_tiny_llama

    return AutoTokenizer.from_pretrained(build_tiny_llama(tmp_path_factory.mktemp("tiny_llama_pml")))


@pytest.fixture()
def st(tokenizer):
    return SegmentTokenizer(tokenizer)


@pytest.fixture()
def reg(st):
    return SchemaRegistry(st, max_positions=2048)


def ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokens(st, segs) -> list[tuple[int, int]]:
    """(token id, position id) of every token, as the engine will see them."""
    return [(t, s.start + i) for s in st.segments(segs) for i, t in enumerate(s.token_ids)]


def expect(tokenizer, parts: list[tuple[str, int]]) -> list[tuple[int, int]]:
    """Reference layout: BOS at 0, then each (text, start position) tokenized on its own."""
    out = [(tokenizer.bos_token_id, 0)]
    for text, start in parts:
        out += [(t, start + i) for i, t in enumerate(ids(tokenizer, text))]
    return out


LEGAL = """<schema name="legal">
  <system>You are a legal assistant.</system>
  <user>
    <module name="contract">Contract: the tenant may cancel with notice.</module>
    <module name="statute">Statute 12: notice must be given 30 days ahead.</module>
  </user>
</schema>"""


def test_legal_schema_two_documents_and_a_question(tokenizer, st, reg):
    schema = reg.add(LEGAL)
    head = SYS_H + "You are a legal assistant." + EOT + USER_H
    contract = "Contract: the tenant may cancel with notice."
    statute = "Statute 12: notice must be given 30 days ahead."
    p_contract = 1 + len(ids(tokenizer, head))
    p_statute = p_contract + len(ids(tokenizer, contract))
    p_eot = p_statute + len(ids(tokenizer, statute))
    assert schema.length == p_eot + 1
    assert schema.modules[("statute",)].start == p_statute

    question = USER_H + "Can the tenant cancel?" + EOT + ASSIST_H
    segs = reg.segments(
        '<prompt schema="legal"><contract/><statute/><user>Can the tenant cancel?</user><assistant/></prompt>'
    )
    assert segs == [
        Chunk(head, 1, 1),
        Chunk(contract, p_contract, p_contract),
        Chunk(statute, p_statute, p_statute),
        Chunk(EOT, p_eot, p_eot),
        Text(question, p_eot + 1),
    ]
    assert tokens(st, segs) == expect(
        tokenizer,
        [(head, 1), (contract, p_contract), (statute, p_statute), (EOT, p_eot), (question, p_eot + 1)],
    )

    # A subset keeps its schema positions (a gap where the contract was); the question follows the schema.
    segs = reg.segments(
        '<prompt schema="legal"><statute/><user>Can the tenant cancel?</user><assistant/></prompt>'
    )
    assert tokens(st, segs) == expect(
        tokenizer, [(head, 1), (statute, p_statute), (EOT, p_eot), (question, p_eot + 1)]
    )


def test_roles_render_like_apply_chat_template(tokenizer, st, reg):
    """Reference: the tokenizer's own apply_chat_template for the same conversation, BOS removed."""
    reg.add('<schema name="chat"><system>Be brief.</system></schema>')
    segs = reg.segments('<prompt schema="chat"><user>  Hello there  </user><assistant/></prompt>')
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hello there  "}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert rendered.startswith(tokenizer.bos_token)
    assert "".join(s.text for s in segs) == rendered[len(tokenizer.bos_token) :]
    roles = chat_roles(tokenizer)
    assert roles.prefix == {"system": SYS_H, "user": USER_H, "assistant": ASSIST_H}
    assert roles.suffix == {"system": EOT, "user": EOT, "assistant": EOT}
    assert roles.trims  # the test template pipes contents through `trim`


def test_closed_assistant_turn_only_when_not_last(reg):
    reg.add('<schema name="c">Hi</schema>')
    segs = reg.segments('<prompt schema="c"><assistant>Sure</assistant><user>More</user></prompt>')
    assert segs[-1].text == ASSIST_H + "Sure" + EOT + USER_H + "More" + EOT
    segs = reg.segments('<prompt schema="c"><assistant>Sure, </assistant></prompt>')
    assert segs[-1].text == ASSIST_H + "Sure,"  # left open: the model continues the turn


UNION = """<schema name="tr">Translate the sentence. <union scaffold="english">
<module name="english">Reply in English.</module>
<module name="french">Réponds en français.</module>
<module name="german">Antworte auf Deutsch.</module>
</union> Sentence: </schema>"""


def test_union_members_share_their_start(tokenizer, st, reg):
    schema = reg.add(UNION)
    start = 1 + len(ids(tokenizer, "Translate the sentence. "))
    longest = max(
        len(ids(tokenizer, t)) for t in ("Reply in English.", "Réponds en français.", "Antworte auf Deutsch.")
    )
    assert [schema.modules[(m,)].start for m in ("english", "french", "german")] == [start] * 3
    assert schema.unions[0].scaffold == "english"
    assert schema.length == start + longest + len(ids(tokenizer, " Sentence: "))
    tail_pos = start + longest
    segs = reg.segments('<prompt schema="tr"><french/>Bonjour</prompt>')
    assert tokens(st, segs) == expect(
        tokenizer,
        [
            ("Translate the sentence. ", 1),
            ("Réponds en français.", start),
            (" Sentence: ", tail_pos),
            ("Bonjour", schema.length),
        ],
    )
    with pytest.raises(PMLError, match=r"line 1.*same <union> \(line 1\).*at most one"):
        reg.segments('<prompt schema="tr"><english/><french/>x</prompt>')


PLAN = """<schema name="travel"><module name="plan">I am planning a <parameter name="days" length="5"/>\
 day trip to <union>
<module name="maldives">the Maldives.</module>
<module name="alps">the Alps.</module>
</union> Suggest <parameter name="what" length="6"/> please.</module></schema>"""


def test_parameterised_module_and_nested_imports(tokenizer, st, reg):
    reg.add(PLAN)
    a = "I am planning a "
    b = " day trip to "
    p_days = 1 + len(ids(tokenizer, a))
    p_b = p_days + 5
    p_union = p_b + len(ids(tokenizer, b))
    union_len = max(len(ids(tokenizer, "the Maldives.")), len(ids(tokenizer, "the Alps.")))
    p_c = p_union + union_len
    p_what = p_c + len(ids(tokenizer, " Suggest "))
    p_d = p_what + 6
    segs = reg.segments('<prompt schema="travel"><plan days="3" what="hikes"><alps/></plan> Thanks!</prompt>')
    assert segs[1] == Text("3", p_days)  # arguments are fresh text at the parameter's reserved positions
    assert tokens(st, segs) == expect(
        tokenizer,
        [
            (a, 1),
            ("3", p_days),
            (b, p_b),
            ("the Alps.", p_union),
            (" Suggest ", p_c),
            ("hikes", p_what),
            (" please.", p_d),
            (" Thanks!", p_d + len(ids(tokenizer, " please."))),
        ],
    )
    too_long = "a very long list of outdoor activities"
    n = len(ids(tokenizer, too_long))
    with pytest.raises(
        PMLError, match=rf"<plan> at line 1: argument what=\.\.\. is {n} tokens.*length=6 tokens"
    ):
        reg.segments(f'<prompt schema="travel"><plan days="3" what="{too_long}"/></prompt>')
    with pytest.raises(PMLError, match=r"missing argument what="):
        reg.segments('<prompt schema="travel"><plan days="3"/></prompt>')
    with pytest.raises(PMLError, match=r"has no parameter 'weeks'"):
        reg.segments('<prompt schema="travel"><plan days="3" what="x" weeks="2"/></prompt>')
    with pytest.raises(PMLError, match=r"no module 'alps'.*available: plan"):
        reg.segments('<prompt schema="travel"><alps/></prompt>')


def test_free_text_kept_in_order_and_bos_sink_before_a_late_first_import(tokenizer, st, reg):
    reg.add(
        '<schema name="ab"><module name="a">Alpha text.</module><module name="b">Beta text.</module></schema>'
    )
    p_b = 1 + len(ids(tokenizer, "Alpha text."))
    segs = reg.segments('<prompt schema="ab"><b/>Why?</prompt>')
    assert tokens(st, segs) == expect(
        tokenizer, [("Beta text.", p_b), ("Why?", p_b + len(ids(tokenizer, "Beta text.")))]
    )
    assert st.segments(segs)[0].kind == "bos"

    # Text between a and b would run into b's schema positions (a and b are adjacent), so the prompt is laid
    # out compactly: contiguous, in prompt order, b relocated from its schema position.
    segs = reg.segments('<prompt schema="ab">Intro <a/> and now a rather long middle part <b/> end</prompt>')
    assert [s.text for s in segs] == [
        "Intro ",
        "Alpha text.",
        " and now a rather long middle part ",
        "Beta text.",
        " end",
    ]
    layout, pos = [], 1
    for s in segs:
        layout.append((s.text, pos))
        pos += len(ids(tokenizer, s.text))
    assert tokens(st, segs) == expect(tokenizer, layout)
    assert segs[3] == Chunk("Beta text.", position=segs[3].position, encode_position=p_b)
    strict = SchemaRegistry(st, 2048, layout="schema")
    strict.add(
        '<schema name="ab"><module name="a">Alpha text.</module><module name="b">Beta text.</module></schema>'
    )
    with pytest.raises(PMLError, match=r"collides with the schema positions"):
        strict.segments('<prompt schema="ab"><a/> and now a rather long middle part <b/></prompt>')
    with pytest.raises(PMLError, match=r"<a> at line 1 is imported after <b>.*schema order"):
        reg.segments('<prompt schema="ab"><b/><a/></prompt>')


def test_thousands_of_chunks_are_compacted_so_the_question_fits(tokenizer, st):
    """A RAG schema far longer than the context: imported chunks are packed from position 1, each keeping
    its schema position as encode_position, and the question follows the last one."""
    reg = SchemaRegistry(st, max_positions=2048)
    docs = [f"Document {i} says the answer is {i * 7}." for i in range(3000)]
    schema = reg.add(schema_for_chunks("kb", docs))
    starts, pos = [], 1
    for d in docs:
        starts.append(pos)
        pos += len(ids(tokenizer, d + "\n\n"))
    assert schema.length == pos > 10 * 2048
    picked = [2999, 5, 1500]
    segs = reg.segments(prompt_for("kb", picked, "What does document 1500 say?"))
    expected_parts, cursor = [], 1
    for i in sorted(picked):
        assert segs[len(expected_parts)] == Chunk(
            docs[i] + "\n\n", position=cursor, encode_position=starts[i]
        )
        expected_parts.append((docs[i] + "\n\n", cursor))
        cursor += len(ids(tokenizer, docs[i] + "\n\n"))
    expected_parts.append(("What does document 1500 say?", cursor))
    assert tokens(st, segs) == expect(tokenizer, expected_parts)

    # Same schema, but a budget that allows schema positions: then the question lands past the context.
    wide = SchemaRegistry(st, max_positions=2048, schema_budget=10**6)
    wide.add(schema_for_chunks("kb", docs))
    with pytest.raises(PMLError, match=r"needs \d+ positions but max_positions is 2048"):
        wide.segments(prompt_for("kb", picked, "What does document 1500 say?"))


def test_schema_for_chunks_escapes_markup_exactly(tokenizer, reg):
    nasty = [
        "a < b && c > d",
        '</module><module name="evil">injected</module>',
        "<![CDATA[x]]> and ]]> and &amp; literally",
        "line one\r\nline two\rthree",
        '<!DOCTYPE x [<!ENTITY e "boom">]>&e;',
        "  leading and trailing spaces  ",
    ]
    schema = reg.add(schema_for_chunks("docs", nasty))
    assert sorted(m[0] for m in schema.modules) == sorted(f"chunk-{i}" for i in range(len(nasty)))
    segs = reg.segments(prompt_for("docs", range(len(nasty)), "Summarise <all> & more.", chat=True))
    assert [s.text for s in segs[:-1]] == [t + "\n\n" for t in nasty]
    assert segs[-1].text == USER_H + "Summarise <all> & more." + EOT + ASSIST_H
    with pytest.raises(PMLError, match=r"chunk 1 contains the control character U\+000C"):
        schema_for_chunks("bad", ["fine", "page\x0cbreak"])


def test_equivalent_plain_prompt_has_the_same_tokens_and_positions(st, reg):
    """The reference a `full` prefill runs: every segment fresh, identical token ids and position ids."""
    reg.add(LEGAL)
    segs = reg.segments('<prompt schema="legal"><statute/><user>Q?</user><assistant/></prompt>')
    plain = equivalent_plain_prompt(segs)
    assert all(type(s) is Text for s in plain)
    assert tokens(st, plain) == tokens(st, segs)


def test_whitespace_layout_rule(tokenizer, reg):
    reg.add(
        '<schema name="w">\n  <module name="m">  two  spaces  </module>\n'
        '  <module name="n">\nx\n</module>\n</schema>'
    )
    segs = reg.segments('<prompt schema="w">\n  <m/>\n  <n/>\n  question \n</prompt>')
    # indentation-only runs vanish; text with content is verbatim, line breaks included
    assert [s.text for s in segs] == ["  two  spaces  ", "\nx\n", "\n  question \n"]


def test_registry_bookkeeping(st, reg):
    a = reg.add('<schema name="s"><module name="m">x</module></schema>')
    assert reg.add('<schema name="s"><module name="m">x</module></schema>') is a
    with pytest.raises(PMLError, match=r"<schema name=\"s\"> at line 1: a different schema named 's'"):
        reg.add('<schema name="s"><module name="m">y</module></schema>')
    assert a.chunks() == [Chunk("x", 1, 1)]
    no_template = copy.deepcopy(st.tokenizer)
    no_template.chat_template = None
    bare = SchemaRegistry(SegmentTokenizer(no_template), 2048)
    with pytest.raises(PMLError, match=r"<user> at line 1: role tags need a tokenizer with a chat template"):
        bare.add('<schema name="r"><user>hi</user></schema>')
    with pytest.raises(PMLError, match="no tokens"):
        reg.segments('<prompt schema="s"></prompt>')


BILLION_LAUGHS = (
    '<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol">'
    + "".join(
        f'<!ENTITY lol{i} "{("&lol" + (str(i - 1) if i > 1 else "") + ";") * 10}">' for i in range(1, 10)
    )
    + ']><schema name="s">&lol9;</schema>'
)

HOSTILE = {
    "malformed": ('<schema name="s"><module name="m">x</schema>', r"malformed PML schema at line 1"),
    "unclosed": ('<schema name="s">\n<module name="m">x', r"line 2"),
    "duplicate_module": (
        '<schema name="s"><module name="m">x</module>\n<module name="m">y</module></schema>',
        r'<module name="m"> at line 2: duplicate module name .* line 1',
    ),
    "duplicate_param": (
        '<schema name="s"><module name="m"><parameter name="p" length="2"/>\n'
        '<parameter name="p" length="2"/></module></schema>',
        r'<parameter name="p"> at line 2: duplicate parameter',
    ),
    "bad_length": (
        '<schema name="s"><module name="m"><parameter name="p" length="'
        + "9" * 5000
        + '"/></module></schema>',
        r"line 1: length=.* whole number",
    ),
    "param_outside_module": (
        '<schema name="s"><parameter name="p" length="2"/></schema>',
        r"line 1.*inside a",
    ),
    "union_text": (
        '<schema name="s"><union>hi<module name="a">x</module></union></schema>',
        r"<union> at line 1",
    ),
    "schema_in_schema": ('<schema name="s"><schema name="t"/></schema>', r'<schema name="t"> at line 1'),
    "billion_laughs": (BILLION_LAUGHS, r"<!DOCTYPE lolz> at line 1 .*: DTDForbidden"),
    "external_entity": (
        '<?xml version="1.0"?><!DOCTYPE s [<!ENTITY x SYSTEM "file:///etc/passwd">]>'
        '<schema name="s">&x;</schema>',
        r"<!DOCTYPE s> at line 1 .*: DTDForbidden",
    ),
    "undeclared_entity": ('<schema name="s">&x;</schema>', r"line 1.*undefined entity"),
    "huge_attribute": (
        '<schema name="' + "a" * (50 * 2**20) + '"/>',
        r"over the 16,000,000 limit \(<schema> starting at line 1\)",
    ),
    "deep_nesting": (
        '<schema name="s">' + "<module name='m'>" * 100 + "</module>" * 100 + "</schema>",
        r"line 1.*nested more than 64",
    ),
    "module_longer_than_context": (
        '<schema name="s">\n<module name="m">' + "word " * 3000 + "</module></schema>",
        r'<module name="m"> at line 2: a run of \d+ tokens cannot fit in max_positions=2048',
    ),
    "not_a_string": (b"<schema/>", r"a str, not bytes"),
    "reserved_name": ('<schema name="s"><module name="user">x</module></schema>', r"line 1.*not usable"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_bad_schemas_raise_pml_error_fast(case, reg):
    text, pattern = HOSTILE[case]
    t0 = time.perf_counter()
    with pytest.raises(PMLError, match=pattern) as info:
        reg.add(text)
    assert time.perf_counter() - t0 < 1.0
    assert isinstance(info.value, PCRagError) and isinstance(info.value, ValueError)


BAD_PROMPTS = {
    "unknown_schema": ('<prompt schema="nope"><m/></prompt>', r"<prompt> at line 1: unknown schema 'nope'"),
    "unknown_module": (
        '<prompt schema="s">\n<zz/></prompt>',
        r"<zz> at line 2: schema 's' has no module 'zz'",
    ),
    "schema_in_prompt": (
        '<prompt schema="s"><schema name="t"/></prompt>',
        r'<schema name="t"> at line 1.*inside a <prompt>',
    ),
    "import_in_role": (
        '<prompt schema="s"><user><m/></user></prompt>',
        r"<m> at line 1: a prompt's role tag holds only text",
    ),
    "text_in_import": (
        '<prompt schema="s"><m>hello</m></prompt>',
        r"<m> at line 1: text 'hello' inside an import",
    ),
    "twice": ('<prompt schema="s"><m/><m/></prompt>', r"imported twice"),
    "no_schema_attr": ("<prompt><m/></prompt>", r"<prompt> at line 1 needs schema="),
    "not_prompt": ('<schema name="s"/>', r"root element must be <prompt"),
    "huge": ('<prompt schema="s" x="' + "a" * (50 * 2**20) + '"/>', r"over the 1,000,000 limit"),
}


@pytest.mark.parametrize("case", sorted(BAD_PROMPTS))
def test_bad_prompts_raise_pml_error_fast(case, reg):
    reg.add('<schema name="s"><module name="m">x</module></schema>')
    text, pattern = BAD_PROMPTS[case]
    t0 = time.perf_counter()
    with pytest.raises(PMLError, match=pattern):
        reg.segments(text)
    assert time.perf_counter() - t0 < 1.0


SOUP = [
    '<schema name="s">',
    '<schema name="t">',
    "</schema>",
    '<prompt schema="s">',
    "</prompt>",
    '<module name="m">',
    '<module name="n">',
    "</module>",
    "<union>",
    '<union scaffold="m">',
    "</union>",
    '<parameter name="p" length="3"/>',
    '<parameter name="q" len="x"/>',
    "<user>",
    "</user>",
    "<system>",
    "</system>",
    "<assistant/>",
    "<m/>",
    '<m p="hi"/>',
    "<n>",
    "</n>",
    "&amp;",
    "&lt;",
    "&bogus;",
    "&#0;",
    "<!DOCTYPE s>",
    '<!ENTITY e "x">',
    "<![CDATA[<m/>]]>",
    "<?pi x?>",
    "<!-- c -->",
    "text",
    " ",
    "\n",
    "<",
    ">",
    "&",
    '"',
    "\x00",
    "\ud800",
]


@settings(max_examples=150, deadline=1000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pieces=hst.lists(hst.one_of(hst.sampled_from(SOUP), hst.text(max_size=8)), max_size=25),
    as_prompt=hst.booleans(),
)
def test_random_text_and_tag_soup_only_raise_pml_error(reg, pieces, as_prompt):
    if "s" not in reg.schemas:
        reg.add(
            '<schema name="s"><module name="m"><parameter name="p" length="3"/>'
            '<module name="n">y</module></module></schema>'
        )
    text = "".join(pieces)
    try:
        result = reg.segments(text) if as_prompt else reg.add(text)
    except PMLError:
        return
    assert result is not None


TAGS = ["schema", "prompt", "module", "parameter", "union", "user", "system", "assistant", "m", "n", "x"]
ATTRS = ["name", "length", "len", "scaffold", "schema", "p"]
VALUES = ["s", "m", "n", "p", "3", "0", "-1", "x y", "", "99999999999", "user"]


def _element(children):
    return hst.builds(
        lambda tag, attrs, kids, text: (
            f"<{tag}" + "".join(f' {k}="{v}"' for k, v in attrs.items()) + f">{text}{''.join(kids)}</{tag}>"
        ),
        hst.sampled_from(TAGS),
        hst.dictionaries(hst.sampled_from(ATTRS), hst.sampled_from(VALUES), max_size=3),
        hst.lists(children, max_size=4),
        hst.sampled_from(["", "hi", " ", "\n  ", "&lt;x&gt;"]),
    )


WELL_FORMED = hst.recursive(hst.sampled_from(["", "text", "<m/>", '<m p="v"/>']), _element, max_leaves=12)


@settings(max_examples=150, deadline=1000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=WELL_FORMED, root=hst.sampled_from(['<schema name="t">', '<prompt schema="s">']))
def test_random_well_formed_trees_only_raise_pml_error(reg, body, root):
    """Well-formed but arbitrary trees reach the schema and prompt checks, not just the XML parser."""
    if "s" not in reg.schemas:
        reg.add('<schema name="s"><module name="m"><parameter name="p" length="3"/></module></schema>')
    close = "</schema>" if root.startswith("<schema") else "</prompt>"
    reg.schemas.pop("t", None)  # a fresh name each example
    try:
        result = reg.add(root + body + close) if close == "</schema>" else reg.segments(root + body + close)
    except PMLError:
        return
    assert result is not None


def test_the_tokenizer_memo_is_bounded_by_characters_and_entries(tokenizer):
    """Reference: the memo's size, counted by hand; a forgotten text still tokenizes to the same ids."""
    st = SegmentTokenizer(tokenizer, max_entries=3, max_chars=160)  # texts over 160 // 16 characters: not kept
    first = st.ids("alpha")
    for word in ("one", "two", "three"):
        st.ids(word)
    assert st.memo_size() == (3, len("one") + len("two") + len("three"))  # "alpha" went first
    st.ids("x" * 11)
    assert st.memo_size() == (3, 11) and st.ids("alpha") == first
    st = SegmentTokenizer(tokenizer, max_entries=100, max_chars=160)
    for i in range(20):
        st.ids(f"text {i:05d}")  # 10 characters each: 200 in all
    assert st.memo_size() == (16, 160)
    st.ids("same", namespace="a")
    st.ids("same", namespace="b")  # one entry per namespace: 168 characters, so the oldest text goes
    assert st.memo_size() == (17, 15 * 10 + 2 * 4)
