"""Kept for earlier imports: the demo's retriever now lives in pc_rag.demo.retrieval."""

from .demo.retrieval import TEXT_SUFFIXES, VectorIndex, approx_tokens, chunk_text, corpus_chunks, read_documents

__all__ = ["TEXT_SUFFIXES", "VectorIndex", "approx_tokens", "chunk_text", "corpus_chunks", "read_documents"]
