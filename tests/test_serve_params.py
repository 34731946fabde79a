"""Every request field of OpenAI's chat completions and completions APIs, one test each: it works (checked against
the engine's own output for the same request, or what the field must do), or, where it changes nothing in the reply
by OpenAI's own definition, the reply is the one without it; or it is refused with a 400 naming it. None is ignored.

The parameters are those the installed `openai` client sends (its TypedDicts): a client that learns a new one fails
`test_every_openai_parameter_has_a_row` until the new field gets a row here (and a decision in schema.py).

In-process (FastAPI's TestClient over `create_app`), on the session's tiny model; greedy unless a row samples.
References: `Engine.generate` on the same prompt with the same options (a fresh engine, mode "exact", which is a
full prefill's reply within 1e-4), token for token; logprobs against the log-softmax of an HF forward (1e-4).
"""

from __future__ import annotations

import json
import typing

import pytest
import torch

pytest.importorskip("fastapi", reason="pc-rag serve needs the serve extra (fastapi, uvicorn)")
openai = pytest.importorskip("openai", reason="the openai client is in the test extra")

from fastapi.testclient import TestClient  # noqa: E402

import pc_rag  # noqa: E402
from pc_rag.adapters import chat_prompt, completion_prompt  # noqa: E402
from pc_rag.serve import ServerSettings, create_app  # noqa: E402
from pc_rag.serve.schema import EXTENSIONS, ChatCompletionRequest, CompletionRequest  # noqa: E402
from pc_rag.store import MemoryStore  # noqa: E402

MESSAGES = [{"role": "system", "content": "Answer from the notes."},
            {"role": "user", "content": "Notes: a for loop iterates over a sequence.\nQuestion: what does it do?"}]
PROMPT = "Notes: a while loop runs while its condition holds.\nQuestion: when does it stop?\nAnswer:"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}  # a schema the random model completes in a few tokens
TOKENS = 8  # max_tokens of every request


@pytest.fixture(scope="module")
def engine(loaded):
    model, tok = loaded
    return pc_rag.Engine(model, tok, store=MemoryStore())


@pytest.fixture(scope="module")
def http(engine):
    with TestClient(create_app(engine, ServerSettings("tiny"))) as client:
        yield client


@pytest.fixture(scope="module")
def reference(loaded):
    """The engine's reply to the same request, from an engine of its own (fresh store)."""
    model, tok = loaded
    ref = pc_rag.Engine(model, tok, store=MemoryStore())

    def run(endpoint: str, **options):
        prompt = (chat_prompt(ref, MESSAGES) if endpoint == "chat" else completion_prompt(ref, PROMPT))
        return ref.generate(prompt, mode="exact", **{"max_new_tokens": TOKENS, "temperature": 0.0, **options})

    run.engine = ref
    return run


def post(http, endpoint: str, **fields):
    body = {"model": "m", "max_tokens": TOKENS, "temperature": 0, "mode": "exact", **fields}
    if endpoint == "chat":
        body.setdefault("messages", MESSAGES)
        return http.post("/v1/chat/completions", json=body)
    body.setdefault("prompt", PROMPT)
    return http.post("/v1/completions", json=body)


def text_of(body: dict, i: int = 0) -> str:
    choice = body["choices"][i]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def events(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def streamed_text(response, choice: int = 0) -> str:
    out = []
    for e in events(response):
        for c in e.get("choices", []):
            if c["index"] == choice:
                out.append((c.get("delta") or {}).get("content") or c.get("text") or "")
    return "".join(out)


# ---- the checks a row can ask for ------------------------------------------------------------------------------
def same_as_plain(http, endpoint, response, reference, field):
    """A field that by OpenAI's definition does not change the reply: the reply is the one without it."""
    assert response.status_code == 200, response.text
    assert text_of(response.json()) == text_of(post(http, endpoint).json()) == reference(endpoint).text


def like_engine(**options):
    """The reply equals the engine's with these options, and (so that the check can fail) differs from the plain
    reply where the options must change it."""
    def check(http, endpoint, response, reference, field):
        assert response.status_code == 200, response.text
        ref = reference(endpoint, **options)
        assert text_of(response.json()) == ref.text
        if field in ("frequency_penalty", "presence_penalty", "logit_bias", "stop", "seed", "top_p", "temperature"):
            assert ref.text != reference(endpoint).text, f"{field}: the reference does not tell it apart"
        usage = response.json()["usage"]
        assert usage["completion_tokens"] == ref.completion_tokens
    return check


def completion_tokens(n):
    def check(http, endpoint, response, reference, field):
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == n
    return check


def chat_logprobs(top):
    def check(http, endpoint, response, reference, field):
        assert response.status_code == 200, response.text
        got = response.json()["choices"][0]["logprobs"]["content"]
        ref = reference(endpoint, logprobs=top)
        assert [e["token"] for e in got] == [e.token for e in ref.logprobs]
        assert [e["logprob"] for e in got] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
        assert all(len(e["top_logprobs"]) == top for e in got)
        assert all(bytes(e["bytes"]).decode("utf-8", "replace") == e["token"] for e in got)
        _check_against_hf(reference.engine, ref)
    return check


def completion_logprobs(check_http, endpoint, response, reference, field):
    assert response.status_code == 200, response.text
    got = response.json()["choices"][0]["logprobs"]
    ref = reference(endpoint, logprobs=2)
    assert got["tokens"] == [e.token for e in ref.logprobs]
    assert got["token_logprobs"] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
    assert all(e.token in top for e, top in zip(ref.logprobs, got["top_logprobs"], strict=True))
    assert got["text_offset"][0] == 0 and got["text_offset"] == sorted(got["text_offset"])
    _check_against_hf(reference.engine, ref)


def n_choices(n):
    def check(http, endpoint, response, reference, field):
        assert response.status_code == 200, response.text
        body = response.json()
        assert [c["index"] for c in body["choices"]] == list(range(n))
        ref = reference(endpoint)  # greedy: every choice is the greedy reply
        assert [text_of(body, i) for i in range(n)] == [ref.text] * n
        assert body["usage"]["completion_tokens"] == n * len(ref.token_ids)
    return check


def best_of(http, endpoint, response, reference, field):
    """best_of=3, n=1, sampled: the one reply is the engine's choice whose tokens are likeliest on average."""
    assert response.status_code == 200, response.text
    ref = reference(endpoint, n=3, temperature=1.0, seed=5, logprobs=0)
    best = max(ref.choices, key=lambda c: sum(e.logprob for e in c.logprobs) / len(c.logprobs))
    assert len({c.text for c in ref.choices}) > 1, "the sampled choices do not differ: best_of would pass blindly"
    body = response.json()
    assert [text_of(body)] == [best.text] and body["choices"][0]["logprobs"] is None
    assert body["usage"]["completion_tokens"] == ref.completion_tokens  # all three, as OpenAI counts them


def echoed(http, endpoint, response, reference, field):
    assert response.status_code == 200, response.text
    assert text_of(response.json()) == PROMPT + reference(endpoint).text


def streamed(http, endpoint, response, reference, field):
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert streamed_text(response) == reference(endpoint).text


def usage_chunk(http, endpoint, response, reference, field):
    assert response.status_code == 200, response.text
    last = events(response)[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == len(reference(endpoint).token_ids)


def json_reply(http, endpoint, response, reference, field):
    assert response.status_code == 200, response.text
    assert json.loads(text_of(response.json()))["city"] in ("Paris", "Oslo")


def forced_call(http, endpoint, response, reference, field):
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert calls and all(c["function"]["name"] == "get_weather" for c in calls)
    assert all(json.loads(c["function"]["arguments"])["city"] in ("Paris", "Oslo") for c in calls)


def parallel_calls(http, endpoint, response, reference, field):
    """One or more calls: the random model may go on calling until max_tokens, when the last is cut (finish_reason
    "length", that call partial); every complete one is valid."""
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    calls = choice["message"]["tool_calls"]
    complete = calls if choice["finish_reason"] == "tool_calls" else calls[:-1]
    assert choice["finish_reason"] in ("tool_calls", "length") and calls and choice["message"]["content"] is None
    assert all(json.loads(c["function"]["arguments"])["city"] in ("Paris", "Oslo") for c in complete)


def model_echoed(http, endpoint, response, reference, field):
    assert response.status_code == 200 and response.json()["model"] == "tiny"  # the served id, one model per server


def refused(http, endpoint, response, reference, field):
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert field in error["message"] and error["type"] == "invalid_request_error"


def _check_against_hf(engine, generation):
    """Each token's logprob and top list against the log-softmax of an HF forward over the prompt and the reply so far
    (the engine's reference, no pc_rag cache), within 1e-4."""
    ids = list(generation.prompt_ids)
    for k, entry in enumerate(generation.logprobs):
        ref = torch.log_softmax(engine.runner.reference_logits(ids + list(generation.token_ids[:k])), dim=-1)
        assert entry.logprob == pytest.approx(float(ref[entry.token_id]), abs=1e-4)
        if entry.top:
            values, order = torch.topk(ref, len(entry.top))
            assert [t.logprob for t in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
            assert {t.token_id for t in entry.top} == set(order.tolist()) or len(set(values.tolist())) < len(values)


# ---- the table: (endpoint, field, value or fields, check) ------------------------------------------------------
TOKEN_THE = 96  # a token id of the tiny tokenizer (logit_bias)
CHAT = [
    ("audio", {"audio": {"voice": "alloy", "format": "wav"}}, refused),
    ("frequency_penalty", {"frequency_penalty": 2.0}, like_engine(frequency_penalty=2.0)),
    ("function_call", {"function_call": "auto"}, refused),
    ("functions", {"functions": [{"name": "f", "parameters": {}}]}, refused),
    ("logit_bias", {"logit_bias": {str(TOKEN_THE): 100}}, like_engine(logit_bias={TOKEN_THE: 100})),
    ("logprobs", {"logprobs": True}, chat_logprobs(0)),
    ("max_completion_tokens", {"max_completion_tokens": 3}, completion_tokens(3)),
    ("max_tokens", {"max_tokens": 2}, completion_tokens(2)),
    ("messages", {}, like_engine()),
    ("metadata", {"metadata": {"team": "a"}}, same_as_plain),
    ("modalities", {"modalities": ["text", "audio"]}, refused),
    ("modalities", {"modalities": ["text"]}, same_as_plain),
    ("model", {"model": "gpt-4o"}, model_echoed),
    ("moderation", {"moderation": {"model": "omni-moderation-latest"}}, refused),
    ("n", {"n": 3}, n_choices(3)),
    ("parallel_tool_calls", {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": True,
                             "max_tokens": 60}, parallel_calls),
    ("prediction", {"prediction": {"type": "content", "content": "x"}}, refused),
    ("presence_penalty", {"presence_penalty": 2.0}, like_engine(presence_penalty=2.0)),
    ("prompt_cache_key", {"prompt_cache_key": "k1"}, same_as_plain),
    ("prompt_cache_options", {"prompt_cache_options": {"mode": "implicit"}}, same_as_plain),
    ("prompt_cache_retention", {"prompt_cache_retention": "24h"}, same_as_plain),
    ("reasoning_effort", {"reasoning_effort": "high"}, refused),  # the tiny template does not read it
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
                         "max_tokens": 40}, json_reply),
    ("safety_identifier", {"safety_identifier": "user-1"}, same_as_plain),
    ("seed", {"seed": 3, "temperature": 1.0}, like_engine(seed=3, temperature=1.0)),
    ("service_tier", {"service_tier": "flex"}, refused),
    ("service_tier", {"service_tier": "auto"}, same_as_plain),
    ("stop", {"stop": ["its"]}, like_engine(stop=["its"])),
    ("store", {"store": True}, refused),
    ("store", {"store": False}, same_as_plain),
    ("stream", {"stream": True}, streamed),
    ("stream_options", {"stream": True, "stream_options": {"include_usage": True}}, usage_chunk),
    ("stream_options", {"stream": True, "stream_options": {"include_obfuscation": True}}, refused),
    ("temperature", {"temperature": 1.5, "seed": 1}, like_engine(temperature=1.5, seed=1)),
    ("tool_choice", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                     "max_tokens": 60}, forced_call),
    ("tools", {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 60}, forced_call),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 3}, chat_logprobs(3)),
    ("top_logprobs", {"top_logprobs": 3}, refused),  # without logprobs
    ("top_p", {"top_p": 0.05, "temperature": 1.0, "seed": 2}, like_engine(top_p=0.05, temperature=1.0, seed=2)),
    ("user", {"user": "u-42"}, same_as_plain),
    ("verbosity", {"verbosity": "low"}, refused),
    ("verbosity", {"verbosity": "medium"}, same_as_plain),
    ("web_search_options", {"web_search_options": {}}, refused),
]
COMPLETIONS = [
    ("best_of", {"best_of": 3, "temperature": 1.0, "seed": 5}, best_of),
    ("best_of", {"best_of": 3, "stream": True}, refused),
    ("echo", {"echo": True}, echoed),
    ("echo", {"echo": True, "logprobs": 1}, refused),
    ("frequency_penalty", {"frequency_penalty": 2.0}, like_engine(frequency_penalty=2.0)),
    ("logit_bias", {"logit_bias": {str(TOKEN_THE): 100}}, like_engine(logit_bias={TOKEN_THE: 100})),
    ("logprobs", {"logprobs": 2}, completion_logprobs),
    ("max_tokens", {"max_tokens": 3}, completion_tokens(3)),
    ("model", {"model": "davinci-002"}, model_echoed),
    ("n", {"n": 2}, n_choices(2)),
    ("presence_penalty", {"presence_penalty": 2.0}, like_engine(presence_penalty=2.0)),
    ("prompt", {}, like_engine()),
    ("seed", {"seed": 3, "temperature": 1.0}, like_engine(seed=3, temperature=1.0)),
    ("stop", {"stop": "exec"}, like_engine(stop=["exec"])),
    ("stream", {"stream": True}, streamed),
    ("stream_options", {"stream": True, "stream_options": {"include_usage": True}}, usage_chunk),
    ("suffix", {"suffix": "end"}, refused),
    ("temperature", {"temperature": 1.5, "seed": 1}, like_engine(temperature=1.5, seed=1)),
    ("top_p", {"top_p": 0.05, "temperature": 1.0, "seed": 2}, like_engine(top_p=0.05, temperature=1.0, seed=2)),
    ("user", {"user": "u-42"}, same_as_plain),
]
ROWS = [("chat", *row) for row in CHAT] + [("completions", *row) for row in COMPLETIONS]


@pytest.mark.parametrize("endpoint, field, fields, check", ROWS,
                         ids=[f"{e}-{f}-{json.dumps(v)[:30]}" for e, f, v, _ in ROWS])
def test_each_parameter_works_or_is_refused(http, reference, endpoint, field, fields, check):
    check(http, endpoint, post(http, endpoint, **fields), reference, field)


def test_every_openai_parameter_has_a_row():
    """The reference: the parameters the installed openai client knows (its request TypedDicts), and the fields
    declared in schema.py; each needs a row above."""
    from openai.types import completion_create_params as completions
    from openai.types.chat import completion_create_params as chat

    rows = {"chat": {f for e, f, *_ in ROWS if e == "chat"}, "completions": {f for e, f, *_ in ROWS if e != "chat"}}
    for endpoint, params, request in (("chat", chat.CompletionCreateParamsBase, ChatCompletionRequest),
                                      ("completions", completions.CompletionCreateParamsBase, CompletionRequest)):
        known = set(typing.get_type_hints(params)) | {"stream"}
        assert known - rows[endpoint] == set(), f"{endpoint}: the openai client sends these, with no row here"
        declared = set(request.model_fields) - set(EXTENSIONS)
        assert declared - rows[endpoint] == set(), f"{endpoint}: declared in schema.py, with no row here"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("fields, name", [
    ({"top_k": 40}, "top_k"),  # vLLM's, not OpenAI's: ignoring it would sample without the cut asked for
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"ignore_eos": True}, "ignore_eos"),
    ({"tempreature": 0.5}, "tempreature"),
    ({"logit_bias": {"99999": 5}}, "logit_bias"),  # beyond the vocabulary
    ({"logit_bias": {"the": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"n": 99}, "n"),  # beyond the engine's batch
    ({"stream_options": {"include_usage": True, "extra": 1}}, "stream_options.extra"),
])
def test_unknown_fields_and_bad_values_are_400_naming_them(http, endpoint, fields, name):
    refused(http, endpoint, post(http, endpoint, **fields), None, name)


def test_the_fields_a_router_adds_at_their_defaults_are_taken(http, reference):
    """SGLang's router forwards every request with its own fields at their defaults (recorded from sglang-router
    0.3.2): they ask for what pc_rag does, so the reply is the plain one."""
    router = {"continue_final_message": False, "ignore_eos": False, "logprobs": False, "no_stop_trim": False,
              "return_hidden_states": False, "separate_reasoning": True, "skip_special_tokens": True,
              "stream_reasoning": True}
    same_as_plain(http, "chat", post(http, "chat", **router), reference, "router")
    completions = {k: router[k] for k in ("ignore_eos", "no_stop_trim", "return_hidden_states", "skip_special_tokens")}
    same_as_plain(http, "completions", post(http, "completions", echo=False, **completions), reference, "router")


def test_reasoning_effort_reaches_a_template_that_reads_it(loaded, tiny_path):
    """A template that writes `reasoning_effort` into the system turn: the server's prompt is the engine's with it
    (its prompt_tokens and its greedy reply), and one that does not read it refuses it (above)."""
    from transformers import AutoTokenizer

    model, _ = loaded
    tok = AutoTokenizer.from_pretrained(tiny_path)
    tok.chat_template = ("{% if reasoning_effort %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
                         + tok.chat_template)
    engine = pc_rag.Engine(model, tok, store=MemoryStore())
    ref = pc_rag.Engine(model, tok, store=MemoryStore())
    with TestClient(create_app(engine, ServerSettings("m"))) as http:
        got = post(http, "chat", reasoning_effort="low").json()
        plain = post(http, "chat").json()
        bad = post(http, "chat", reasoning_effort="extreme")
    expected = ref.generate(tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                                    reasoning_effort="low"), mode="exact", max_new_tokens=TOKENS)
    assert got["usage"]["prompt_tokens"] == expected.prompt_tokens > plain["usage"]["prompt_tokens"]
    assert text_of(got) == expected.text
    assert bad.status_code == 400 and "reasoning_effort" in bad.json()["error"]["message"]


def test_streamed_logprobs_and_choices(http, reference):
    """n=2 and logprobs streamed: each choice's deltas join into its text, and their logprobs into the non-streamed
    reply's, token for token."""
    whole = post(http, "chat", n=2, logprobs=True, top_logprobs=1).json()
    stream = post(http, "chat", n=2, logprobs=True, top_logprobs=1, stream=True)
    got = {0: [], 1: []}
    for e in events(stream):
        for c in e["choices"]:
            got[c["index"]] += (c.get("logprobs") or {}).get("content") or []
    for i in (0, 1):
        assert streamed_text(stream, i) == text_of(whole, i) == reference("chat").text
        assert [x["token"] for x in got[i]] == [x["token"] for x in whole["choices"][i]["logprobs"]["content"]]
        assert [x["logprob"] for x in got[i]] == pytest.approx(
            [x["logprob"] for x in whole["choices"][i]["logprobs"]["content"]], abs=1e-5)
    completions = post(http, "completions", n=2, logprobs=1, stream=True)
    tokens = {0: [], 1: []}
    for e in events(completions):
        for c in e["choices"]:
            tokens[c["index"]] += (c.get("logprobs") or {}).get("tokens") or []
    ref = reference("completions", logprobs=1)
    assert tokens == {0: [x.token for x in ref.logprobs], 1: [x.token for x in ref.logprobs]}


# ---- a forced call or JSON reply cut by max_tokens -----------------------------------------------------------------
def test_a_cut_forced_call_is_length_with_the_partial_call_never_markup(http):
    for stream in (False, True):
        r = post(http, "chat", tools=[WEATHER], tool_choice="required", max_tokens=6, stream=stream)
        assert r.status_code == 200, r.text
        if stream:
            chunks = [c for e in events(r) for c in e["choices"]]
            content = "".join((c["delta"].get("content") or "") for c in chunks)
            calls = [call for c in chunks for call in c["delta"].get("tool_calls") or []]
            finish = [c["finish_reason"] for c in chunks if c["finish_reason"]]
        else:
            message = r.json()["choices"][0]["message"]
            content, calls, finish = message["content"] or "", message["tool_calls"], [
                r.json()["choices"][0]["finish_reason"]]
        assert finish == ["length"] and "<tool_call>" not in content and content == ""
        (call,) = calls
        assert call["type"] == "function" and not call["function"]["arguments"].startswith('{"name"')
        assert "get_weather".startswith(call["function"]["name"])  # the name as far as it was written
        with pytest.raises(ValueError):
            json.loads(call["function"]["arguments"] or "{")  # partial arguments, as OpenAI gives them
    # Room for the whole call: complete, "tool_calls".
    assert post(http, "chat", tools=[WEATHER], tool_choice="required", max_tokens=60).json()["choices"][0][
        "finish_reason"] == "tool_calls"


def test_a_cut_json_reply_is_length(http):
    r = post(http, "chat", response_format={"type": "json_object"}, max_tokens=3).json()
    assert r["choices"][0]["finish_reason"] == "length"
    with pytest.raises(ValueError):
        json.loads(r["choices"][0]["message"]["content"])
