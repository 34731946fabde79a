"""Reasoning models (pc_rag.reasoning): the text between the thinking markers is reported apart from the answer,
tool calls inside the thinking are not calls, text without markers is unchanged, and the next turn reuses the
previous prompt (and answer) when the template drops earlier thinking.

The random-weight tiny model never writes `<think>` by itself, so the splitting is tested on pieces split at every
position (the reference: the whole text's parts, known by construction), and end to end by forcing the reply with a
grammar through the engine, the adapters and the server."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import pytest

import pc_rag
from pc_rag.adapters import ChatReply, GenerationOptions, Reasoning, chat_request, render_chat, stream_chat
from pc_rag.reasoning import CONTENT, REASONING, ThinkingFilter, ThinkingMarkers
from pc_rag.store import MemoryStore

THINK = ThinkingMarkers()
# A template modelled on Qwen3's: an assistant turn's thinking is dropped unless it follows the last user message
# (content holding `</think>` keeps only what follows it); the generation prompt is left to the model
# (GENERATION_PROMPT) or opens the thinking itself, as DeepSeek-R1's does.
QWEN3_LIKE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content or '' %}{%- set reasoning = m.reasoning_content or '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- if loop.index0 > ns.last_query and reasoning %}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}GENERATION_PROMPT"
    "{%- endif %}"
)
THINKS = "<think>[a-z ]{3,20}</think>[a-z][a-z ]{2,19}"  # a reply with a thinking block, then an answer
QUESTION = [{"role": "system", "content": "You think, then answer."}, {"role": "user", "content": "Why is it so?"}]


def split(parts, markers=THINK, inside=False):
    """Feed `parts` to a ThinkingFilter: (reasoning, content) joined, and the kinds in order."""
    f = ThinkingFilter(markers, inside)
    out = [x for p in parts for x in f.feed(p)] + f.finish()
    reasoning = "".join(t for k, t in out if k == REASONING)
    content = "".join(t for k, t in out if k == CONTENT)
    return reasoning, content, [k for k, _ in out]


def every_split(text):
    """`text` as pieces cut at every position (one cut and two cuts), and one character a piece."""
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
        for j in range(i, len(text) + 1):
            yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize("text,inside,reasoning,content", [
    ("<think>plan a b</think>\n\nthe answer", False, "plan a b", "the answer"),
    ("\n<think>\nstep one\n</think>answer <think> here", False, "\nstep one\n", "answer <think> here"),
    ("<think></think>just this", False, "", "just this"),
    ("<think>cut off by max_tokens </th", False, "cut off by max_tokens </th", ""),
    ("step one</think>\n\nthe answer", True, "step one", "the answer"),
    ("never closed", True, "never closed", ""),
    # no markers: unchanged, whatever starts like one
    ("plain text, no thinking", False, "", "plain text, no thinking"),
    ("  <thin", False, "", "  <thin"),
    ("<", False, "", "<"),
    ("\n\n", False, "", "\n\n"),
    ("a <think>later</think> b", False, "", "a <think>later</think> b"),
    ("<thinking>x</thinking>", False, "", "<thinking>x</thinking>"),
])
def test_pieces_split_at_every_position(text, inside, reasoning, content):
    for parts in every_split(text):
        got = split(parts, inside=inside)
        assert got[:2] == (reasoning, content), parts
        assert got[2] == sorted(got[2], key=[REASONING, CONTENT].index)  # the reasoning comes first, once


def test_other_markers():
    seed = ThinkingMarkers("<seed:think>", "</seed:think>")
    for parts in every_split("<seed:think>hm</seed:think>ok"):
        assert split(parts, seed)[:2] == ("hm", "ok")


class _Tok:
    def __init__(self, vocab=(), template=""):
        self.vocab, self.chat_template = {t: i for i, t in enumerate(vocab)}, template

    def get_vocab(self):
        return self.vocab


def test_markers_from_the_vocabulary_or_the_template():
    assert ThinkingMarkers.detect(_Tok(["a", "b"])) == THINK  # the default
    assert ThinkingMarkers.detect(_Tok(["<seed:think>", "</seed:think>"])).close == "</seed:think>"
    assert ThinkingMarkers.detect(_Tok([], "{{ '<|START_THINKING|>' }}")).open == "<|START_THINKING|>"
    assert THINK.starts_inside("<|Assistant|><think>\n") and not THINK.starts_inside("x<think>\n\n</think>\n\n")
    assert not THINK.starts_inside("<|start_header_id|>assistant<|end_header_id|>\n\n")


def _engine(loaded, generation_prompt=""):
    model, tok = loaded
    tok = copy.deepcopy(tok)
    tok.chat_template = QWEN3_LIKE.replace("GENERATION_PROMPT", generation_prompt)
    return pc_rag.Engine(model, tok, store=MemoryStore())


def _chat(engine, messages, grammar=None, **kwargs):
    options = GenerationOptions(max_new_tokens=kwargs.pop("max_new_tokens", 60), temperature=1.0,
                                seed=kwargs.pop("seed", 0), grammar=grammar)
    request = chat_request(engine, messages, options, **kwargs)
    *pieces, reply = list(stream_chat(engine, request))
    assert isinstance(reply, ChatReply)
    assert "".join(p for p in pieces if isinstance(p, Reasoning)) == reply.reasoning
    assert "".join(p for p in pieces if not isinstance(p, Reasoning)) == reply.content
    return reply


def test_a_forced_thinking_reply_is_split(engine):
    """Reference: the generated text, which the grammar makes `<think>R</think>A`: reasoning R, answer A."""
    for seed in range(5):
        reply = _chat(engine, QUESTION, pc_rag.Grammar.regex(THINKS), seed=seed)
        m = re.fullmatch(r"<think>(.*)</think>(.*)", reply.generation.text, re.S)
        assert m, reply.generation.text
        assert (reply.reasoning, reply.content) == (m.group(1), m.group(2).lstrip())
        assert reply.content and "<think>" not in reply.content


def test_a_reply_that_starts_inside_the_thinking(loaded):
    """The generation prompt opened `<think>` (DeepSeek-R1's template): the reply is thinking up to `</think>`."""
    engine = _engine(loaded, "<think>\n")
    reply = _chat(engine, QUESTION, pc_rag.Grammar.regex("[a-z ]{3,20}</think>[a-z][a-z ]{2,19}"))
    before, after = reply.generation.text.split("</think>")
    assert (reply.reasoning, reply.content) == (before, after.lstrip()) and reply.content
    # a forced call is the whole reply, even after a generation prompt that opened the thinking
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"]}}}
    called = _chat(engine, QUESTION, tools=[tool], tool_choice="required")
    assert [c.name for c in called.tool_calls] == ["f"] and called.reasoning == ""


def test_text_without_markers_is_unchanged(engine):
    for seed in range(3):
        reply = _chat(engine, QUESTION, pc_rag.Grammar.regex("[a-z <]{3,20}"), seed=seed)
        assert reply.reasoning == "" and reply.content == reply.generation.text
        free = _chat(engine, QUESTION, seed=seed, max_new_tokens=12)
        assert free.reasoning == "" and free.content == free.generation.text


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_call_inside_the_thinking_is_not_a_call(engine):
    inside = _chat(engine, QUESTION, pc_rag.Grammar.regex(re.escape(f"<think>{CALL}</think>") + "[a-z]{3,9}"),
                   tools=[WEATHER], max_new_tokens=120)
    assert inside.tool_calls == [] and inside.reasoning == CALL and inside.finish_reason == "stop"
    after = _chat(engine, QUESTION, pc_rag.Grammar.regex("<think>[a-z]{3,9}</think>" + re.escape(CALL)),
                  tools=[WEATHER], max_new_tokens=120)
    assert [(c.name, c.arguments) for c in after.tool_calls] == [("get_weather", {"city": "Oslo"})]
    assert after.content == "" and after.reasoning


def test_the_next_turn_reuses_the_prompt_when_the_template_drops_the_thinking(loaded):
    """Turn 2's prompt holds turn 1's answer without its thinking (the template drops it): its cached tokens
    cover turn 1's whole prompt and the answer. Reference: turn 1's prompt ids, and the answer's ids, as the
    first tokens of turn 2's prompt."""
    engine = _engine(loaded)
    first = _chat(engine, QUESTION, pc_rag.Grammar.regex(THINKS))
    assert first.reasoning and first.content
    messages = QUESTION + [{"role": "assistant", "content": first.content},
                           {"role": "user", "content": "And then?"}]
    text = render_chat(engine.tokenizer, messages)
    assert "<think>" not in text and first.reasoning not in text  # the template dropped the thinking
    second = _chat(engine, messages, max_new_tokens=4)
    prompt1 = list(first.generation.prompt_ids)
    prompt2 = list(second.generation.prompt_ids)
    answer = engine.segmenter.ids(first.content)
    assert prompt2[: len(prompt1) + len(answer)] == prompt1 + list(answer)
    assert second.generation.cached_tokens >= len(prompt1) + len(answer), (second.generation.cached_tokens,
                                                                           len(prompt1), len(answer))


# ---- the server (in process), forced through the request's options -------------------------------------------
@pytest.fixture
def served(engine, monkeypatch):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from pc_rag.serve import app as app_module

    original = app_module.chat_request

    def forced(engine_, messages, options, **kwargs):
        return original(engine_, messages, dataclasses.replace(options, grammar=pc_rag.Grammar.regex(THINKS)),
                        **kwargs)

    monkeypatch.setattr(app_module, "chat_request", forced)
    with TestClient(app_module.create_app(engine, app_module.ServerSettings(model_id="m"))) as client:
        yield client


def test_the_server_answers_reasoning_content(served):
    body = {"model": "m", "messages": QUESTION, "max_tokens": 60, "temperature": 1.0, "seed": 3}
    r = served.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"] and "think>" not in message["content"]

    with served.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    thought = "".join(d.get("reasoning_content", "") for d in deltas)
    said = "".join(d.get("content") or "" for d in deltas)
    assert (thought, said) == (message["reasoning_content"], message["content"])  # same seed, same reply
    kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
    assert kinds.index("content") > kinds.index("reasoning_content")
