"""Tool calling (pc_rag.tools, pc_rag.adapters.chat_request): tools rendered into the prompt, calls forced by a
grammar and parsed back, tool results in the history, and the next agent step reusing the previous one.

The random-weight tiny model never writes a call by itself (its free text is the reference: no call parses out
of it), so every call here is forced with tool_choice, which is how a client gets a call it can rely on."""

import json

import jsonschema
import pytest

from pc_rag.adapters import ChatReply, GenerationOptions, chat_request, render_chat, stream_chat
from pc_rag.errors import OptionError, ReplyCutError
from pc_rag.tools import CallFilter, CutCall, ToolCall, ToolFormat, parse_cut, parse_reply, tool_specs

# Bounded strings: a random model never closes a free string by itself (test_grammar.py).
SEARCH = {"type": "function", "function": {
    "name": "search_docs", "description": "Search the documentation.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 16},
                                                    "k": {"type": "integer", "minimum": 1, "maximum": 5}},
                   "required": ["query", "k"]}}}
WEATHER = {"name": "get_weather", "description": "Weather for a city.",  # the bare function form
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}},
                          "required": ["city"]}}
TOOLS = [SEARCH, WEATHER]
SCHEMAS = {s["function"]["name"]: s["function"]["parameters"] for s in tool_specs(TOOLS)}


def _chat(engine, messages, **kwargs):
    options = GenerationOptions(max_new_tokens=kwargs.pop("max_new_tokens", 60),
                                temperature=kwargs.pop("temperature", 0.0), seed=kwargs.pop("seed", None))
    request = chat_request(engine, messages, options, **kwargs)
    *pieces, reply = list(stream_chat(engine, request))
    assert isinstance(reply, ChatReply) and "".join(pieces) == reply.content
    return reply


def test_forced_calls_parse_and_validate_100_of_100(engine):
    messages = [{"role": "user", "content": "What does the documentation say about decorators?"}]
    names = []
    for seed in range(100):
        # 100 tokens: the random model spells "</tool_call>" and a 16-character string in many small tokens.
        reply = _chat(engine, messages, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
                      max_new_tokens=100)
        assert reply.generation.finish_reason == "stop", reply.content
        assert len(reply.tool_calls) == 1 and reply.content == "" and reply.finish_reason == "tool_calls"
        call = reply.tool_calls[0]
        jsonschema.validate(call.arguments, SCHEMAS[call.name])
        names.append(call.name)
    assert set(names) == {"search_docs", "get_weather"}  # sampled: the grammar leaves the choice to the model


def test_a_named_tool_choice_calls_that_tool(engine):
    messages = [{"role": "user", "content": "Weather?"}]
    for choice in ("get_weather", {"type": "function", "function": {"name": "get_weather"}}):
        reply = _chat(engine, messages, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=1)
        assert [c.name for c in reply.tool_calls] == ["get_weather"]


def test_parallel_calls_when_asked(engine):
    messages = [{"role": "user", "content": "Weather in two cities?"}]
    counts = set()
    for seed in range(12):
        reply = _chat(engine, messages, tools=[WEATHER], tool_choice="required", parallel_tool_calls=True,
                      temperature=1.0, seed=seed, max_new_tokens=80)
        if reply.generation.finish_reason == "stop":
            assert reply.tool_calls and all(c.name == "get_weather" for c in reply.tool_calls)
            counts.add(len(reply.tool_calls))
    assert counts and max(counts) >= 1


def test_free_decoding_with_tools_is_text(engine):
    """tool_choice auto on the random model: it writes no call, so the reply is text and no call is made up."""
    messages = [{"role": "user", "content": "Hello"}]
    for seed in range(5):
        reply = _chat(engine, messages, tools=TOOLS, temperature=1.0, seed=seed, max_new_tokens=20)
        assert reply.tool_calls == [] and reply.content == reply.generation.text
    none = _chat(engine, messages, tools=TOOLS, tool_choice="none", max_new_tokens=8)
    assert none.tool_calls == [] and none.content == none.generation.text


def test_the_next_agent_step_reuses_the_previous_prompt_and_reply(engine):
    """Reference: the previous step's prompt and reply are the first tokens of the next step's prompt (the call
    written back as the model wrote it); at least 90% of those are reused (cache_read)."""
    messages = [{"role": "system", "content": "You answer from the documentation, using the tools."},
                {"role": "user", "content": "What does the documentation say about decorators?"}]
    steps = []
    for step in range(3):
        # 100 tokens, as above: a forced call of the random model can take more than 60.
        reply = _chat(engine, messages, tools=TOOLS, tool_choice="required", temperature=1.0, seed=step,
                      max_new_tokens=100)
        steps.append(reply)
        call = reply.tool_calls[0]
        messages = messages + [
            {"role": "assistant", "content": reply.content, "tool_calls": [call.openai()]},
            {"role": "tool", "tool_call_id": call.id, "content": f"result {step}: decorators wrap functions."}]
    for before, after in zip(steps, steps[1:], strict=False):
        shared = list(before.generation.prompt_ids) + list(before.generation.token_ids)
        prompt = list(after.generation.prompt_ids)
        n = next((i for i, (a, b) in enumerate(zip(shared, prompt, strict=False)) if a != b), min(len(shared),
                                                                                                   len(prompt)))
        assert n >= len(shared) - 2  # the reply's text comes back (its end-of-turn token may differ)
        assert after.generation.cached_tokens >= 0.9 * n, (after.generation.cached_tokens, n)


def test_fallback_rendering_describes_the_tools_and_writes_calls_back(engine):
    fmt = ToolFormat.detect(engine.tokenizer)
    assert fmt.name == "hermes" and not fmt.native  # the tiny model's template takes no tools
    call = ToolCall("get_weather", {"city": "Oslo"}, id="call_1")
    text = render_chat(engine.tokenizer, [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call.openai()]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], TOOLS)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


def test_a_template_that_takes_tools_renders_them_itself(loaded):
    import copy

    _, tok = loaded
    tok = copy.deepcopy(tok)
    tok.chat_template = (
        "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n# Tools\n<tools>{% for t in tools %}"
        "{{ t | tojson }}{% endfor %}</tools> Call with <tool_call></tool_call><|eot_id|>{% endif %}"
        "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|eot_id|>"
        "{% endfor %}<|start_header_id|>assistant<|end_header_id|>\n\n")
    fmt = ToolFormat.detect(tok)
    assert fmt.name == "hermes" and fmt.native
    call = ToolCall("get_weather", {"city": "Oslo"})
    text = render_chat(tok, [{"role": "user", "content": "Weather?"},
                             {"role": "assistant", "content": "", "tool_calls": [call.openai()]}], TOOLS)
    assert text.startswith("<|start_header_id|>system<|end_header_id|>\n\n# Tools\n<tools>")
    assert '"arguments": {"city": "Oslo"}' in text  # arguments given as JSON text reach the template as a dict


@pytest.mark.parametrize("text,name,content", [
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>', "hermes",
     "Let me look."),
    ('{"name": "get_weather", "parameters": {"city": "Lima"}}', "llama3_json", ""),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}', "llama3_json", ""),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lima"}}]', "mistral", ""),
])
def test_each_family_format_parses(text, name, content):
    for fmt in ("hermes", "llama3_json", "mistral"):  # whatever the template's own format, each is understood
        got, calls = parse_reply(text, ToolFormat(fmt, True), tool_specs(TOOLS))
        assert got == content and [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Lima"})]


@pytest.mark.parametrize("text", [
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>{"name": "no_such_tool", "arguments": {}}</tool_call>',
    '{"name": "get_weather", "parameters": [1, 2]}',
    '{"answer": 42}',
    "[TOOL_CALLS] nothing",
    "plain words",
])
def test_malformed_calls_are_text(text):
    assert parse_reply(text, ToolFormat("hermes", False), tool_specs(TOOLS)) == (text, [])


def test_streaming_holds_back_only_what_may_be_a_call():
    specs = tool_specs(TOOLS)
    flt = CallFilter(ToolFormat("hermes", False), specs)
    sent = "".join(flt.feed(p) for p in ["Sure, ", "<tool", "_call>\n{\"name\": \"get_weather\", ",
                                         "\"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"])
    rest, calls = flt.finish()
    assert sent == "Sure, " and rest == "" and calls[0].arguments == {"city": "Oslo"}
    flt = CallFilter(ToolFormat("hermes", False), specs)
    sent = "".join(flt.feed(p) for p in ["a <to", "y> b"])
    assert sent + flt.finish()[0] == "a <toy> b"


def test_tool_choice_and_response_format_are_checked(engine):
    options = GenerationOptions()
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(OptionError, match="not auto, none, required"):
        chat_request(engine, messages, options, tools=TOOLS, tool_choice="nope")
    with pytest.raises(OptionError, match="needs tools"):
        chat_request(engine, messages, options, tool_choice="required")
    with pytest.raises(OptionError, match="unique"):
        chat_request(engine, messages, options, tools=[WEATHER, WEATHER])
    with pytest.raises(OptionError, match="both"):
        chat_request(engine, messages, options, tools=TOOLS, tool_choice="required",
                     response_format={"type": "json_object"})
    with pytest.raises(OptionError, match="response_format type"):
        chat_request(engine, messages, options, response_format={"type": "yaml"})


def test_response_format_json_schema(engine):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "score": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "score"]}
    for seed in range(10):
        reply = _chat(engine, [{"role": "user", "content": "Well?"}], temperature=1.0, seed=seed,
                      response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
        jsonschema.validate(json.loads(reply.content), schema)


# ---- a reply the token budget cut inside its call ---------------------------------------------------------------
HERMES, LLAMA3, MISTRAL = ToolFormat("hermes", False), ToolFormat("llama3_json", True), ToolFormat("mistral", True)


@pytest.mark.parametrize("fmt, text, forced, content, complete, cut", [
    # (format, the reply as cut, forced?, the text before the calls, complete calls' names, the cut call)
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', True, "", [],
     ("get_weather", '{"city": "Pa')),
    (HERMES, '<tool_call>\n{"name": "get_wea', True, "", [], ("get_wea", "")),
    (HERMES, "<tool_c", True, "", [], ("", "")),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call>\n'
             '{"name": "search_docs", "arguments": {"query": "de', True, "", ["get_weather"],
     ("search_docs", '{"query": "de')),
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "search_docs", "arg', False, "Let me look.\n", [],
     ("search_docs", "")),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Li', True, "", [], ("get_weather", '{"city": "Li')),
    (MISTRAL, '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_', True, "", ["get_weather"],
     ("get_", "")),
])
def test_a_cut_call_is_a_cut_call_never_text(fmt, text, forced, content, complete, cut):
    """Reference: the reply's own text, cut where the budget cut it; what was complete is a call, what was not a
    CutCall with the name and the arguments as far as written, and no markup is left as text."""
    calls = CallFilter(fmt, tool_specs(TOOLS), forced=forced)
    sent = calls.feed(text)
    rest, found = calls.finish(cut=True)
    assert sent + rest == content
    assert [c.name for c in found if isinstance(c, ToolCall)] == complete
    assert isinstance(found[-1], CutCall) and (found[-1].name, found[-1].arguments) == cut
    assert found[-1].openai()["function"] == {"name": cut[0], "arguments": cut[1]}


def test_text_cut_by_the_budget_with_no_call_stays_text():
    calls = CallFilter(HERMES, tool_specs(TOOLS))
    assert calls.feed("Plain words, cut") == "Plain words, cut"
    assert calls.finish(cut=True) == ("", [])
    assert parse_cut("Plain words", HERMES, tool_specs(TOOLS)) is None


def test_a_forced_call_cut_by_max_new_tokens_is_reported_as_cut(engine):
    """End to end on the tiny model: a forced call with room for a few tokens only. The reply is a CutCall with
    finish_reason "length", `cut` set and no text; `check_complete` raises naming max_new_tokens. With room, the
    same call is complete (reference: the first tokens of the complete call are the cut call's)."""
    messages = [{"role": "user", "content": "Weather?"}]
    whole = _chat(engine, messages, tools=[WEATHER], tool_choice="required")
    (call,) = whole.tool_calls
    assert isinstance(call, ToolCall) and whole.finish_reason == "tool_calls" and not whole.cut
    for budget in (2, 6, 10):
        reply = _chat(engine, messages, tools=[WEATHER], tool_choice="required", max_new_tokens=budget)
        assert reply.content == "" and reply.finish_reason == "length" and reply.cut
        (cut,) = reply.tool_calls
        assert isinstance(cut, CutCall) and "get_weather".startswith(cut.name)
        assert json.dumps(call.arguments).startswith(cut.arguments)  # greedy: the complete call's beginning
        with pytest.raises(ReplyCutError, match=f"max_new_tokens={budget}"):
            reply.check_complete(budget)
    json_reply = _chat(engine, messages, response_format={"type": "json_object"}, max_new_tokens=3)
    assert json_reply.cut and json_reply.finish_reason == "length"
