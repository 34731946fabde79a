"""LlamaIndex queries on the tiny Llama: which response modes keep retrieved nodes intact, and the answer.

Reference for the answer: `engine.generate(segments, mode="full")` on the very segments the LLM sent
(greedy), computing every token fresh; the LLM runs in "exact" mode (longest cached prefix), which must give
the same tokens, so the texts must be equal.
"""

from pydoc_data.topics import topics

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.schema import TextNode
from llama_index.llms.pc_rag import PromptCacheNodeRegistrar, prompt_cache_query_engine

from .recording import RecordingLLM, chunks_per_call
from .tiny_model import tiny_model_path

NODES = [TextNode(text=topics[k][:500], metadata={"topic": k}) for k in ("assert", "break", "continue")]


@pytest.fixture(scope="module")
def index():
    # Mock embeddings: retrieval order does not matter here, top_k=3 returns all three nodes.
    return VectorStoreIndex(NODES, embed_model=MockEmbedding(embed_dim=8))


def test_our_query_engine_hits_on_the_second_query_and_matches_full_mode(index):
    llm = RecordingLLM(model=tiny_model_path(), mode="exact", max_new_tokens=8)
    engine = prompt_cache_query_engine(index, llm, similarity_top_k=3)
    engine.query("What does assert do?")
    response = engine.query("When is break used?")

    assert chunks_per_call(llm) == [3, 3]
    second = llm.records[-1]
    assert second["raw"]["usage"]["cached_tokens"] > 0
    reference = llm.get_engine().generate(second["segments"], mode="full", max_new_tokens=8)
    assert second["text"] == reference.text
    assert str(response) == (reference.text or "Empty Response")


def test_streaming_query_engine(index):
    llm = RecordingLLM(model=tiny_model_path(), max_new_tokens=4)
    response = prompt_cache_query_engine(index, llm, streaming=True, similarity_top_k=3).query("Why?")
    assert "".join(response.response_gen) == llm.records[-1]["text"]
    assert chunks_per_call(llm) == [3]


@pytest.mark.parametrize(
    ("response_mode", "context_window", "expected"),
    [
        # All nodes fit in one repacked prompt: the "\n\n"-joined text survives repacking.
        ("compact", 3900, [3]),
        ("tree_summarize", 3900, [3]),
        # A context that forces re-splitting: node boundaries move, every hit is lost.
        ("compact", 700, [0, 0, 0, 0]),
        # One node per call: intact.
        ("refine", 3900, [1, 1, 1]),
        ("accumulate", 3900, [1, 1, 1]),
        # Its truncation step rewrites the joined text even when it fits: no hits.
        ("simple_summarize", 3900, [0]),
    ],
)
def test_stock_response_modes(index, response_mode, context_window, expected):
    llm = RecordingLLM(model=tiny_model_path(), max_new_tokens=1, context_window=context_window)
    query_engine = index.as_query_engine(
        llm=llm,
        response_mode=response_mode,
        node_postprocessors=[PromptCacheNodeRegistrar(llm=llm)],
        similarity_top_k=3,
    )
    query_engine.query("What does assert do?")
    assert chunks_per_call(llm) == expected
