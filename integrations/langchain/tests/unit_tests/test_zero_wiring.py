"""Reuse with no wiring, on an engine double: which texts a stock chain's prompt sends as chunks.

Reference: the `Chunk` segments the double was sent, compared with the documents' texts exactly. Every test
uses documents no other test retrieved (a uuid in the text), since discovered documents are process-wide.
"""

import uuid

import pytest
from langchain_classic.chains import create_retrieval_chain
from langchain_classic.chains.combine_documents import create_stuff_documents_chain
from langchain_core.callbacks import AsyncCallbackManager, CallbackManager
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_pc_rag import ChatPromptCache, PromptCacheLLM, discovery

from pc_rag.segments import Chunk

from .fake_engine import FakeEngine

PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer from the context.\n\n{context}"), ("human", "{input}")]
)


class ListRetriever(BaseRetriever):
    documents: list[Document]

    def _get_relevant_documents(self, query, *, run_manager):
        return self.documents


def new_docs(n=3):
    tag = uuid.uuid4().hex[:8]
    return [Document(page_content=f"Document {tag}-{i} says the river number {i} is long.") for i in range(n)]


def sent_chunks(engine):
    segments, _ = engine.calls[-1]
    return [s.text for s in segments if isinstance(s, Chunk)]


async def run_chain(chain, how, inputs):
    if how == "invoke":
        return chain.invoke(inputs)
    if how == "ainvoke":
        return await chain.ainvoke(inputs)
    if how == "stream":
        return list(chain.stream(inputs))
    return [part async for part in chain.astream(inputs)]


@pytest.mark.parametrize("how", ["invoke", "ainvoke", "stream", "astream"])
async def test_stock_retrieval_chain_sends_retrieved_documents_as_chunks(how):
    docs = new_docs()
    engine = FakeEngine()
    chain = create_retrieval_chain(
        ListRetriever(documents=docs), create_stuff_documents_chain(ChatPromptCache(engine=engine), PROMPT)
    )
    await run_chain(chain, how, {"input": "Which river is long?"})
    assert sent_chunks(engine) == [d.page_content for d in docs]


def test_auto_chunks_false_ignores_discovered_documents():
    docs = new_docs()
    off, on = FakeEngine(), FakeEngine()
    for engine, auto in ((off, False), (on, True)):
        llm = ChatPromptCache(engine=engine, auto_chunks=auto)
        create_retrieval_chain(ListRetriever(documents=docs), create_stuff_documents_chain(llm, PROMPT)).invoke(
            {"input": "q"}
        )
    assert sent_chunks(off) == []
    assert sent_chunks(on) == [d.page_content for d in docs]  # the same documents were discovered


def test_environment_switch_turns_discovery_off(monkeypatch):
    docs = new_docs()
    engine = FakeEngine()
    llm = ChatPromptCache(engine=engine)
    monkeypatch.setenv("PC_RAG_DISCOVERY", "0")
    chain = create_retrieval_chain(ListRetriever(documents=docs), create_stuff_documents_chain(llm, PROMPT))
    chain.invoke({"input": "q"})
    assert sent_chunks(engine) == []
    monkeypatch.delenv("PC_RAG_DISCOVERY")
    create_stuff_documents_chain(llm, PROMPT).invoke({"context": docs, "input": "q"})  # no retriever ran
    assert sent_chunks(engine) == []  # nothing was registered while discovery was off


def test_handler_hears_retrievers_called_on_their_own(monkeypatch):
    heard = []
    monkeypatch.setattr(discovery, "_discover", lambda texts: heard.append(list(texts)))
    docs = new_docs(2)
    ListRetriever(documents=docs).invoke("q")
    assert heard == [[d.page_content for d in docs]]


async def test_handler_hears_async_retrievers(monkeypatch):
    heard = []
    monkeypatch.setattr(discovery, "_discover", lambda texts: heard.append(list(texts)))
    docs = new_docs(2)
    await ListRetriever(documents=docs).ainvoke("q")
    assert heard == [[d.page_content for d in docs]]


def test_handler_is_attached_once_to_every_run():
    import importlib

    importlib.import_module("langchain_pc_rag.discovery")  # a second import changes nothing
    for manager in (CallbackManager.configure(), AsyncCallbackManager.configure()):
        assert sum(isinstance(h, discovery.DocumentDiscovery) for h in manager.handlers) == 1
        assert sum(isinstance(h, discovery.DocumentDiscovery) for h in manager.inheritable_handlers) == 1


def test_cache_control_block_marks_a_chunk_even_with_auto_chunks_off():
    doc = new_docs(1)[0].page_content
    engine = FakeEngine()
    message = HumanMessage(
        content=[
            {"type": "text", "text": doc, "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "\n\nWhich river?"},
        ]
    )
    ChatPromptCache(engine=engine, auto_chunks=False).invoke([SystemMessage("Be brief."), message])
    assert sent_chunks(engine) == [doc]


def test_tool_calls_in_the_history_are_sent_as_the_model_writes_them():
    """The fake tokenizer's template takes no tools: the fallback writes the call back in the Hermes format and the
    tool result as a <tool_response> (pc_rag.tools)."""
    engine = FakeEngine()
    call = AIMessage(content="", tool_calls=[{"name": "lookup", "args": {"q": "x"}, "id": "call-1"}])
    result = ToolMessage(content="found it", tool_call_id="call-1")
    ChatPromptCache(engine=engine).invoke([HumanMessage("hi"), call, result])
    text = "".join(s.text for s in engine.calls[-1][0])
    assert '<assistant><tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call></assistant>' in text
    assert "<user><tool_response>\nfound it\n</tool_response></user>" in text


def test_the_completion_model_refuses_structured_output_before_running():
    engine = FakeEngine()
    with pytest.raises(NotImplementedError, match="PromptCacheLLM does not support structured output"):
        PromptCacheLLM(engine=engine).with_structured_output({"title": "T", "type": "object"})
    assert engine.calls == []
