"""ChatPromptCache with a reasoning model's reply: the thinking is `additional_kwargs["reasoning_content"]` (in
streamed chunks too), not content. The random tiny model never thinks by itself, so the reply is forced by a grammar
(`<think>R</think>A`); the reference is the engine's generated text, which holds both parts."""

import dataclasses
import re

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_pc_rag import ChatPromptCache, chat_models
from langchain_pc_rag.chat_models import _message_dict

import pc_rag

from .tiny_model import fresh_engine

THINKS = "<think>[a-z ]{3,20}</think>[a-z][a-z ]{2,19}"


@pytest.fixture
def thinking(monkeypatch):
    original = chat_models.chat_request

    def forced(engine, messages, options, **kwargs):
        return original(engine, messages, dataclasses.replace(options, grammar=pc_rag.Grammar.regex(THINKS)),
                        **kwargs)

    monkeypatch.setattr(chat_models, "chat_request", forced)


def test_reasoning_content_apart_from_the_answer(thinking):
    llm = ChatPromptCache(engine=fresh_engine(), max_tokens=60, temperature=1.0, seed=2)
    message = llm.invoke([HumanMessage("Why?")])
    reasoning = message.additional_kwargs["reasoning_content"]
    assert reasoning and message.content and "think>" not in message.content
    chunks = list(llm.stream([HumanMessage("Why?")]))  # the same seed: the same reply
    thought = [c.additional_kwargs.get("reasoning_content", "") for c in chunks]
    assert "".join(thought) == reasoning and "".join(c.content for c in chunks) == message.content
    first_text = next(i for i, c in enumerate(chunks) if c.content)
    assert all(not t for t in thought[first_text:])  # the thinking streams before the answer
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert full.additional_kwargs["reasoning_content"] == reasoning
    text = re.fullmatch(r"<think>(.*)</think>(.*)", f"<think>{reasoning}</think>{message.content}", re.S)
    assert text  # the parts are as the grammar made them


def test_plain_replies_have_no_reasoning_content():
    llm = ChatPromptCache(engine=fresh_engine(), max_tokens=8)
    message = llm.invoke([HumanMessage("Hi")])
    assert "reasoning_content" not in message.additional_kwargs


def test_reasoning_content_goes_back_to_the_template():
    out, _ = _message_dict(AIMessage("the answer", additional_kwargs={"reasoning_content": "hm"}))
    assert out == {"role": "assistant", "content": "the answer", "reasoning_content": "hm"}
