"""`pc-rag serve` for agents: OpenAI `tools`, `tool_choice`, `parallel_tool_calls`, `response_format`, tool messages,
through the `openai` client and ChatOpenAI against a real server process on the tiny model.

The random-weight model never calls a tool by itself, so the calls are forced (tool_choice "required" or a name):
the reply is then constrained to a valid call (pc_rag.tools), and must parse and validate every time. References:
each call's arguments against its tool's JSON schema; the next step's cached_tokens against the previous step's
prompt + reply tokens (the tokens it shares with it)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="pc-rag serve needs the serve extra (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="pc-rag serve needs the serve extra (fastapi, uvicorn)")
openai = pytest.importorskip("openai", reason="the openai client is in the test extra")
jsonschema = pytest.importorskip("jsonschema")

from pc_rag.serve.process import ServerProcess  # noqa: E402

from .conftest import worktree_env  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search_docs", "description": "Search the documentation.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 12}},
                   "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    env = worktree_env(tmp_path_factory.mktemp("serve_tools_cache"))
    with ServerProcess(tiny_path, extra=["--store", "memory"], env=env) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_forced_calls_validate_and_the_next_step_reuses_the_last(client):
    messages = [{"role": "system", "content": "You answer with the tools."},
                {"role": "user", "content": "Weather in Oslo this week?"}]
    previous = None
    for step in range(3):
        r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required",
                                           max_tokens=100, temperature=1.0, seed=step)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        if previous is not None:  # everything before this step's new tool message was the previous request
            assert r.usage.prompt_tokens_details.cached_tokens >= 0.9 * previous
        previous = r.usage.prompt_tokens + r.usage.completion_tokens
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": f"result {step}"}]


def test_a_named_tool_and_parallel_calls(client):
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Look it up."}], tools=TOOLS, max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "search_docs"}}, temperature=1.0, seed=1)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["search_docs"]
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Two cities?"}],
                                       tools=[WEATHER], tool_choice="required", parallel_tool_calls=True,
                                       max_tokens=150, temperature=1.0, seed=2)
    if r.choices[0].finish_reason == "tool_calls":
        assert all(c.function.name == "get_weather" for c in r.choices[0].message.tool_calls)


def test_streamed_tool_call_deltas(client):
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Weather?"}],
                                            tools=TOOLS,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            max_tokens=100, stream=True, stream_options={"include_usage": True})
    calls, finish, usage, text = {}, None, None, ""
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and text == "" and usage.completion_tokens > 0
    assert calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_weather"])


def test_auto_on_the_random_model_is_text(client):
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
                                       max_tokens=12, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_response_format_json_schema_and_json_object(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "score": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "score"]}
    for seed in range(5):
        r = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Well?"}], max_tokens=40, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}})
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "JSON?"}], max_tokens=40,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")


def test_bad_tools_are_400(client):
    with pytest.raises(openai.BadRequestError, match="not auto, none, required"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                                       tool_choice="nope")
    with pytest.raises(openai.BadRequestError, match="does not compile"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": 5}}})


def test_a_grammar_that_cannot_finish_is_a_400_or_an_error_reply_never_stop(client, server, tiny_path):
    """Issue 56: a schema whose string `pattern` is past llguidance's limits came back "stop" with the content `"`.
    Where the compile probe reaches it, a 400 naming the grammar; where only the model's choice reaches it (the
    string branch of an anyOf, pushed there by logit_bias on the quote), finish_reason "error" and the choice's
    `error`, streamed or not. Reference: the token id of `"` in the model's own tokenizer."""
    import httpx
    from transformers import AutoTokenizer

    def schema_format(schema):
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}

    huge = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^a{1000000}$"}}, "required": ["a"]}
    with pytest.raises(openai.BadRequestError, match="json_schema grammar cannot be completed: lexer error"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                       response_format=schema_format(huge))
    quote = AutoTokenizer.from_pretrained(tiny_path)('"', add_special_tokens=False)["input_ids"][0]
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "temperature": 0,
            "logit_bias": {str(quote): 100}, "response_format": schema_format(
                {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": "^a{1000000}$"}]})}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "error" and choice["message"]["content"].startswith('"')
    assert choice["error"]["type"] == "grammar_error" and "too many expressions" in choice["error"]["message"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    last = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert [c["finish_reason"] for c in last] == ["error"] and last[0]["error"] == choice["error"]


def test_chat_openai_bind_tools(server, tiny_path):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=tiny_path.name, temperature=1.0,
                        max_tokens=100, max_retries=0, seed=0)
    message = llm.bind_tools(TOOLS, tool_choice="any").invoke("Weather in Lima?")
    (call,) = message.tool_calls
    jsonschema.validate(call["args"], SCHEMAS[call["name"]])
