"""ChatPromptCache and PromptCacheLLM with OpenAI's options (logprobs, penalties, logit_bias) and a forced call or
JSON reply cut by max_tokens, on the tiny Llama.

References: the engine's own reply to the same prompt with the same options (a fresh engine: `chat_prompt`), token
for token and logprob for logprob; for a cut call, the call the same request makes with room to finish (greedy:
the cut call's arguments are its beginning), and no markup anywhere in the content."""

import json

import pytest
from langchain.agents import create_agent
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langchain_pc_rag import ChatPromptCache, PromptCacheLLM
from pydantic import BaseModel, Field

from pc_rag.adapters import chat_prompt, completion_prompt

from .tiny_model import fresh_engine

QUESTION = "What does the for statement iterate over?"


class City(BaseModel):
    city: str = Field(json_schema_extra={"enum": ["Paris", "Oslo"]})


@tool(args_schema=City)
def get_weather(city: str) -> str:
    """Weather for a city."""
    return f"sunny in {city}"


def test_logprobs_and_penalties_in_response_metadata():
    llm = ChatPromptCache(engine=fresh_engine(), max_tokens=8, logprobs=True, top_logprobs=2, frequency_penalty=1.5,
                          logit_bias={7: 1.0})
    reference = fresh_engine()
    expected = reference.generate(chat_prompt(reference, [{"role": "user", "content": QUESTION}]), mode="modular",
                                  max_new_tokens=8, logprobs=2, frequency_penalty=1.5, logit_bias={7: 1.0})
    message = llm.invoke([HumanMessage(QUESTION)])
    assert message.content == expected.text
    content = message.response_metadata["logprobs"]["content"]
    assert [e["token"] for e in content] == [e.token for e in expected.logprobs]
    assert [e["logprob"] for e in content] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    assert all(len(e["top_logprobs"]) == 2 for e in content)
    streamed = None
    for chunk in llm.stream([HumanMessage(QUESTION)]):
        streamed = chunk if streamed is None else streamed + chunk
    assert [e["token"] for e in streamed.response_metadata["logprobs"]["content"]] == [e["token"] for e in content]
    plain = ChatPromptCache(engine=fresh_engine(), max_tokens=8).invoke([HumanMessage(QUESTION)])
    assert "logprobs" not in plain.response_metadata


def test_the_completion_class_reports_openai_completions_logprobs():
    llm = PromptCacheLLM(engine=fresh_engine(), max_tokens=6, logprobs=True, top_logprobs=1)
    reference = fresh_engine()
    expected = reference.generate(completion_prompt(reference, QUESTION), max_new_tokens=6, logprobs=1)
    result = llm.generate([QUESTION]).generations[0][0]
    assert result.text == expected.text
    logprobs = result.generation_info["logprobs"]
    assert logprobs["tokens"] == [e.token for e in expected.logprobs]
    assert logprobs["token_logprobs"] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)


def test_a_forced_call_cut_by_max_tokens_is_an_invalid_tool_call_never_markup():
    whole = ChatPromptCache(engine=fresh_engine(), max_tokens=100).bind_tools([get_weather], tool_choice="any")
    (call,) = whole.invoke([HumanMessage("Weather?")]).tool_calls
    cut = ChatPromptCache(engine=fresh_engine(), max_tokens=8).bind_tools([get_weather], tool_choice="any")
    message = cut.invoke([HumanMessage("Weather?")])
    assert message.content == "" and message.tool_calls == []
    assert message.response_metadata["finish_reason"] == "length"
    (invalid,) = message.invalid_tool_calls
    assert "max_tokens=8" in invalid["error"] and "get_weather".startswith(invalid["name"])
    assert json.dumps(call["args"]).startswith(invalid["args"])  # greedy: the whole call's beginning
    streamed = None
    for chunk in cut.stream([HumanMessage("Weather?")]):
        assert "<tool_call>" not in chunk.text
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.tool_calls == [] and len(streamed.invalid_tool_calls) == 1  # not completed into a call


def test_create_agent_does_not_take_a_cut_call_for_an_answer_or_a_call():
    from langchain.agents.middleware import wrap_model_call

    @wrap_model_call
    def forced(request, handler):
        return handler(request.override(tool_choice="any"))

    llm = ChatPromptCache(engine=fresh_engine(), max_tokens=8)
    agent = create_agent(llm, tools=[get_weather], middleware=[forced])
    messages = agent.invoke({"messages": [{"role": "user", "content": "Weather?"}]})["messages"]
    last = messages[-1]
    assert isinstance(last, AIMessage) and "<tool_call>" not in last.text
    assert last.invalid_tool_calls and not last.tool_calls  # the tool never ran on a truncated call


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_structured_output_cut_by_max_tokens_says_so(method):
    llm = ChatPromptCache(engine=fresh_engine(), max_tokens=4)
    with pytest.raises(OutputParserException, match="max_tokens"):
        llm.with_structured_output(City, method=method).invoke("Which city?")
    raw = llm.with_structured_output(City, method=method, include_raw=True).invoke("Which city?")
    assert raw["parsed"] is None and "max_tokens" in str(raw["parsing_error"])
