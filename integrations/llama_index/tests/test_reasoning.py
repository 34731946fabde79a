"""PromptCacheLLM with a reasoning model's reply: the thinking is `message.additional_kwargs["reasoning_content"]`,
not content (streamed: the reasoning so far, each response's `additional_kwargs["reasoning_delta"]`). The random
tiny model never thinks by itself, so the reply is forced by a grammar (`<think>R</think>A`)."""

import dataclasses

import pytest
from llama_index.core.base.llms.types import ChatMessage
from llama_index.llms.pc_rag import PromptCacheLLM, base
from llama_index.llms.pc_rag.base import _message_parts

import pc_rag

from .tiny_model import fresh_engine

THINKS = "<think>[a-z ]{3,20}</think>[a-z][a-z ]{2,19}"


@pytest.fixture
def thinking(monkeypatch):
    original = base.chat_request

    def forced(engine, messages, options, **kwargs):
        return original(engine, messages, dataclasses.replace(options, grammar=pc_rag.Grammar.regex(THINKS)),
                        **kwargs)

    monkeypatch.setattr(base, "chat_request", forced)


def test_reasoning_content_apart_from_the_answer(thinking):
    llm = PromptCacheLLM(engine=fresh_engine(), max_new_tokens=60, temperature=1.0, seed=2)
    response = llm.chat([ChatMessage(role="user", content="Why?")])
    reasoning = response.message.additional_kwargs["reasoning_content"]
    content = response.message.content
    assert reasoning and content and "think>" not in content
    generated = response.raw["usage"]["completion_tokens"]
    assert generated > 0
    streamed = list(llm.stream_chat([ChatMessage(role="user", content="Why?")]))  # same seed, same reply
    deltas = "".join(r.additional_kwargs.get("reasoning_delta", "") for r in streamed)
    assert deltas == reasoning and "".join(r.delta or "" for r in streamed) == content
    assert streamed[-1].message.additional_kwargs["reasoning_content"] == reasoning
    assert streamed[-1].message.content == content


def test_plain_replies_have_no_reasoning_content():
    llm = PromptCacheLLM(engine=fresh_engine(), max_new_tokens=8)
    response = llm.chat([ChatMessage(role="user", content="Hi")])
    assert "reasoning_content" not in response.message.additional_kwargs


def test_reasoning_content_goes_back_to_the_template():
    out, _ = _message_parts(ChatMessage(role="assistant", content="ok", additional_kwargs={"reasoning_content": "hm"}))
    assert out == {"role": "assistant", "content": "ok", "reasoning_content": "hm"}
