"""The in-process drop-in classes decode concurrent calls together: LangChain's `abatch` and concurrent
`ainvoke`, LlamaIndex's async calls (each runs the engine in a worker thread; the threads meet in the engine's
batched decode loop).

Reference: the same calls through the same class over an engine that decodes one request at a time
(`pc_rag.testing.one_at_a_time`), greedy: the same text; and the engine's own count of the largest batch it decoded.
"""

from __future__ import annotations

import asyncio

import pytest

import pc_rag
from pc_rag.store import MemoryStore

QUESTIONS = [f"In one line: what does item {i} of the list do?" for i in range(6)]


def _engines(loaded):
    model, tok = loaded
    serial = pc_rag.testing.one_at_a_time(pc_rag.Engine(model, tok, store=MemoryStore()))
    return serial, pc_rag.Engine(model, tok, store=MemoryStore())


def test_langchain_abatch_and_concurrent_ainvoke_share_decode_steps(loaded, docs):
    pytest.importorskip("langchain_pc_rag")
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_pc_rag import ChatPromptCache

    serial, batched = _engines(loaded)
    inputs = [[SystemMessage(f"Answer from this text.\n\n{docs[i % 4]}"), HumanMessage(q)]
              for i, q in enumerate(QUESTIONS)]
    expected = [ChatPromptCache(engine=serial, max_tokens=16).invoke(m).content for m in inputs]
    llm = ChatPromptCache(engine=batched, max_tokens=16)
    assert [m.content for m in asyncio.run(llm.abatch(inputs))] == expected
    assert batched.stats()["decode"]["max_batch_seen"] >= 2

    async def concurrently():
        return await asyncio.gather(*[llm.ainvoke(m) for m in inputs])

    assert [m.content for m in asyncio.run(concurrently())] == expected


def test_llama_index_async_calls_share_decode_steps(loaded, docs):
    pytest.importorskip("llama_index.llms.pc_rag")
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.pc_rag import PromptCacheLLM

    serial, batched = _engines(loaded)
    chats = [[ChatMessage(role="system", content=f"Answer from this text.\n\n{docs[i % 4]}"),
              ChatMessage(role="user", content=q)] for i, q in enumerate(QUESTIONS)]
    ref_llm = PromptCacheLLM(engine=serial, max_new_tokens=16)
    expected_chat = [ref_llm.chat(m).message.content for m in chats]
    expected_complete = [ref_llm.complete(q).text for q in QUESTIONS]
    llm = PromptCacheLLM(engine=batched, max_new_tokens=16)

    async def concurrently():
        chat = [llm.achat(m) for m in chats]
        complete = [llm.acomplete(q) for q in QUESTIONS]
        return await asyncio.gather(*chat, *complete)

    results = asyncio.run(concurrently())
    assert [r.message.content for r in results[:6]] == expected_chat
    assert [r.text for r in results[6:]] == expected_complete
    assert batched.stats()["decode"]["max_batch_seen"] >= 2

    async def streamed(m):
        return "".join([r.delta async for r in await llm.astream_chat(m)])

    async def streams():
        return await asyncio.gather(*[streamed(m) for m in chats])

    assert asyncio.run(streams()) == expected_chat
