"""ChatPromptCache in LangChain's own agent (`langchain.agents.create_agent`) with a retriever tool, on the tiny Llama.

The random-weight model never chooses a tool by itself, so a middleware sets `tool_choice` for each model call:
"any" for the first steps (the reply is then constrained to a valid call: the agent runs the tool and calls the
model again with the call and its result in the history), "none" at the end (a text answer ends the loop). Every
other part is the framework's: the tool-calling loop, its messages, the tool node.

What is checked: each step's prompt starts with the previous step's prompt and reply, and the engine reuses them
(cache_read >= 90% of the previous step's prompt + reply tokens), so cache_read grows step by step."""

import json
from typing import Literal

import jsonschema
from langchain.agents import create_agent
from langchain.agents.middleware import wrap_model_call
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.retrievers import BaseRetriever
from langchain_core.tools import tool
from langchain_pc_rag import ChatPromptCache
from pydantic import BaseModel, Field

from .tiny_model import fresh_engine

DOCS = [Document(page_content="Decorators wrap a function in another function."),
        Document(page_content="A generator yields values one at a time.")]


class ListRetriever(BaseRetriever):
    documents: list[Document]

    def _get_relevant_documents(self, query, *, run_manager):
        return self.documents


RETRIEVER = ListRetriever(documents=DOCS)


class SearchArgs(BaseModel):
    # Bounded: a random model never closes a free string by itself.
    query: str = Field(max_length=12, description="What to look for.")


@tool(args_schema=SearchArgs)
def search_docs(query: str) -> str:
    """Search the Python documentation."""
    return "\n\n".join(d.page_content for d in RETRIEVER.invoke(query))


class UnitArgs(BaseModel):
    unit: Literal["celsius", "fahrenheit"]


@tool(args_schema=UnitArgs)
def set_unit(unit: str) -> str:
    """Set the temperature unit."""
    return f"unit set to {unit}"


TOOL_STEPS = 3


@wrap_model_call
def choose_for_the_random_model(request, handler):
    steps = sum(isinstance(m, AIMessage) for m in request.messages)
    return handler(request.override(tool_choice="any" if steps < TOOL_STEPS else "none"))


def run_agent(llm):
    agent = create_agent(llm, tools=[search_docs, set_unit], middleware=[choose_for_the_random_model],
                         system_prompt="You answer questions about Python from its documentation.")
    return agent.invoke({"messages": [{"role": "user", "content": "What do decorators do?"}]})["messages"]


def test_create_agent_runs_tool_steps_and_each_step_reuses_the_last():
    llm = ChatPromptCache(engine=fresh_engine(), max_tokens=100, temperature=1.0, seed=0)
    messages = run_agent(llm)
    replies = [m for m in messages if isinstance(m, AIMessage)]
    results = [m for m in messages if isinstance(m, ToolMessage)]
    assert len(replies) == TOOL_STEPS + 1 and len(results) == TOOL_STEPS
    schemas = {t.name: t.tool_call_schema.model_json_schema() for t in (search_docs, set_unit)}
    for reply, result in zip(replies, results, strict=False):
        (call,) = reply.tool_calls
        jsonschema.validate(call["args"], schemas[call["name"]])
        assert result.tool_call_id == call["id"] and result.status == "success"
        assert reply.response_metadata["finish_reason"] == "tool_calls"
    assert not replies[-1].tool_calls and replies[-1].content  # the final answer is text
    reads = [r.usage_metadata["input_token_details"]["cache_read"] for r in replies]
    for before, read in zip(replies, reads[1:], strict=False):
        previous = before.usage_metadata["input_tokens"] + before.usage_metadata["output_tokens"]
        assert read >= 0.9 * previous, (reads, previous)
    assert reads == sorted(reads) and reads[-1] > reads[1] > 0
    print("cache_read per step:", reads, "prompt tokens:", [r.usage_metadata["input_tokens"] for r in replies])


def test_with_structured_output_validates():
    llm = ChatPromptCache(engine=fresh_engine(), max_tokens=100, temperature=1.0)

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]
        confidence: int = Field(ge=0, le=9)

    for method in ("json_schema", "function_calling"):
        structured = llm.with_structured_output(Verdict, method=method)
        for seed in range(5):
            got = structured.invoke("Is Python dynamically typed?", seed=seed)
            assert isinstance(got, Verdict) and got.answer in ("yes", "no")
    raw = llm.with_structured_output(Verdict.model_json_schema(), include_raw=True).invoke("Well?")
    assert raw["parsing_error"] is None and json.loads(raw["raw"].content) == raw["parsed"]


def test_bind_tools_auto_on_the_random_model_is_text():
    llm = ChatPromptCache(engine=fresh_engine(), max_tokens=16)
    message = llm.bind_tools([search_docs, set_unit]).invoke("Hello")
    assert message.tool_calls == [] and message.content


def test_streamed_tool_call_chunks_add_up_to_the_call():
    llm = ChatPromptCache(engine=fresh_engine(), max_tokens=100, seed=3, temperature=1.0)
    chunks = list(llm.bind_tools([set_unit], tool_choice="set_unit").stream("Unit?"))
    total = chunks[0]
    for c in chunks[1:]:
        total += c
    assert total.tool_calls[0]["name"] == "set_unit" and total.tool_calls[0]["args"]["unit"] in ("celsius",
                                                                                                 "fahrenheit")
    assert total.content == ""  # a forced call streams no text
