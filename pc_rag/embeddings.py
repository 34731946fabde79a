"""Kept for earlier imports: the demo's sentence embedder now lives in pc_rag.demo.embeddings."""

from .demo.embeddings import DEMO_EXTRA_HINT, MAX_TOKENS, SentenceEmbedder, minilm_path

__all__ = ["DEMO_EXTRA_HINT", "MAX_TOKENS", "SentenceEmbedder", "minilm_path"]
