"""Stock LlamaIndex query and chat engines on the tiny Llama, only the LLM swapped: retrieved nodes are reused.

Reference: each node's text as LlamaIndex formats it for the LLM (`get_content(MetadataMode.LLM)`, metadata
lines included), which must be sent as `Chunk` segments from the first request on; and their token counts,
which the next request must read from the cache (modular mode). Every test retrieves nodes no other test
retrieves (discovered documents are process-wide) and answers on an engine with an empty store.
"""

from pydoc_data.topics import topics

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.base.llms.types import CacheControl, CachePoint, ChatMessage, TextBlock
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.schema import MetadataMode, TextNode
from llama_index.llms.pc_rag import discovery, track_usage

from pc_rag.adapters import completion_prompt
from pc_rag.segments import Chunk

from .recording import RecordingLLM, chunk_texts, chunks_per_call
from .tiny_model import fresh_engine

FLOWS = [
    # (engine, how it is called, the topics its nodes come from)
    ("query", "query", ("try", "with", "import")),
    ("query", "aquery", ("class", "function", "return")),
    ("query", "stream", ("global", "nonlocal", "pass")),
    ("query", "astream", ("del", "raise", "yield")),
    ("context", "chat", ("lambda", "while", "for")),
    ("context", "achat", ("if", "else", "in")),
    ("context", "stream_chat", ("dict", "lists", "strings")),
    ("context", "astream_chat", ("numbers", "integers", "floating")),
    ("condense_plus_context", "chat", ("calls", "slicings", "subscriptions")),
    ("condense_plus_context", "astream_chat", ("unary", "binary", "power")),
]


def make_index(keys):
    nodes = [TextNode(text=topics[k][:400], metadata={"topic": k}) for k in keys]
    # Mock embeddings: every node scores the same, similarity_top_k=3 returns all three.
    return nodes, VectorStoreIndex(nodes, embed_model=MockEmbedding(embed_dim=8))


def llm_text(node):
    return node.get_content(metadata_mode=MetadataMode.LLM).strip()


async def drain(response):
    if hasattr(response, "async_response_gen"):
        return [t async for t in response.async_response_gen()]
    if getattr(response, "response_gen", None) is not None:
        return list(response.response_gen)
    return str(response)


async def ask(engine, how, question):
    if how in ("query", "chat"):
        return getattr(engine, how)(question)
    if how in ("aquery", "achat"):
        return await getattr(engine, how)(question)
    if how == "stream":  # a streaming query engine
        return await drain(engine.query(question))
    if how == "astream":
        return await drain(await engine.aquery(question))
    if how == "stream_chat":
        return await drain(engine.stream_chat(question))
    return await drain(await engine.astream_chat(question))


def stock_engine(kind, how, index, llm):
    if kind == "query":
        return index.as_query_engine(llm=llm, similarity_top_k=3, streaming=how in ("stream", "astream"))
    return index.as_chat_engine(chat_mode=kind, llm=llm, similarity_top_k=3)


@pytest.mark.parametrize(("kind", "how", "keys"), FLOWS, ids=[f"{k}-{h}" for k, h, _ in FLOWS])
async def test_stock_engine_sends_retrieved_nodes_as_chunks_and_reuses_them(kind, how, keys):
    nodes, index = make_index(keys)
    llm = RecordingLLM(engine=fresh_engine(), max_new_tokens=4)  # modular, auto_chunks: the defaults
    engine = stock_engine(kind, how, index, llm)
    await ask(engine, how, "What does it do?")
    first = llm.records[-1]
    assert sorted(chunk_texts(first)) == sorted(llm_text(n) for n in nodes)  # the texts compact/context send

    await ask(engine, how, "And when is it used?")
    answer = next(r for r in reversed(llm.records) if chunk_texts(r))  # condense_plus_context condenses first
    node_tokens = sum(len(llm.get_engine().segmenter.ids(llm_text(n))) for n in nodes)
    assert answer["raw"]["usage"]["cached_tokens"] >= node_tokens


def test_auto_chunks_false_sends_no_discovered_node():
    nodes, index = make_index(("assignment", "augassign", "comparisons"))
    llm = RecordingLLM(engine=fresh_engine(), max_new_tokens=2, auto_chunks=False)
    index.as_query_engine(llm=llm, similarity_top_k=3).query("What is it?")
    assert chunks_per_call(llm) == [0]
    on = RecordingLLM(engine=fresh_engine(), max_new_tokens=2)
    index.as_query_engine(llm=on, similarity_top_k=3).query("What is it?")
    assert chunks_per_call(on) == [3]  # the same nodes, discovered


def test_environment_switch_turns_discovery_off(monkeypatch):
    nodes, index = make_index(("booleans", "truth", "conversions"))
    monkeypatch.setenv("PC_RAG_DISCOVERY", "0")
    llm = RecordingLLM(engine=fresh_engine(), max_new_tokens=2)
    index.as_query_engine(llm=llm, similarity_top_k=3).query("What is it?")
    assert chunks_per_call(llm) == [0]
    monkeypatch.delenv("PC_RAG_DISCOVERY")
    found = completion_prompt(fresh_engine(), "\n\n".join(llm_text(n) for n in nodes))
    assert not any(isinstance(s, Chunk) for s in found)  # nothing was registered while it was off


def test_handler_hears_retrievers_called_on_their_own(monkeypatch):
    heard = []
    monkeypatch.setattr(discovery, "_discover", lambda texts: heard.append(list(texts)))
    nodes, index = make_index(("exceptions", "execmodel", "naming"))
    index.as_retriever(similarity_top_k=3).retrieve("q")
    assert sorted(heard[0]) == sorted(n.get_content(metadata_mode=MetadataMode.LLM) for n in nodes)


def test_handler_is_added_once():
    discovery.install()
    discovery.install()
    assert sum(isinstance(h, discovery.NodeDiscovery) for h in get_dispatcher().event_handlers) == 1


def test_cache_point_marks_the_text_block_before_it():
    doc = topics["shifting"][:300]
    llm = RecordingLLM(engine=fresh_engine(), max_new_tokens=2, auto_chunks=False)
    marked = ChatMessage(
        role="user",
        blocks=[TextBlock(text=doc), CachePoint(cache_control=CacheControl(type="ephemeral")), TextBlock(text="Why?")],
    )
    llm.chat([ChatMessage(role="system", content="Be brief."), marked])
    assert chunk_texts(llm.records[-1]) == [doc.strip()]
    whole = ChatMessage(role="user", content=doc, additional_kwargs={"cache_control": {"type": "ephemeral"}})
    llm.chat([whole, ChatMessage(role="user", content="Why?")])
    assert chunk_texts(llm.records[-1]) == [doc.strip()]


def test_track_usage_counts_a_streaming_chat_answered_in_a_thread():
    # The context chat engine's stream_chat consumes the LLM stream in a thread of its own.
    _, index = make_index(("bitwise", "operator-summary", "identifiers"))
    llm = RecordingLLM(engine=fresh_engine(), max_new_tokens=3)
    with track_usage() as usage:
        response = index.as_chat_engine(chat_mode="context", llm=llm, similarity_top_k=3).stream_chat("Why?")
        list(response.response_gen)
    assert usage.requests == 1
    assert usage.prompt_tokens == llm.last_usage["prompt_tokens"] == llm.records[-1]["raw"]["usage"]["prompt_tokens"]
