"""LlamaIndex integration of pc_rag. Importing it turns on automatic node discovery (see `discovery`)."""

from llama_index.llms.pc_rag import discovery as _discovery  # noqa: F401  (adds the retrieval event handler)
from llama_index.llms.pc_rag.base import PromptCacheLLM, UsageTotals, track_usage
from llama_index.llms.pc_rag.rag import (
    PromptCacheNodeRegistrar,
    PromptCacheSynthesizer,
    prompt_cache_query_engine,
    register_nodes,
)

__all__ = [
    "PromptCacheLLM",
    "PromptCacheNodeRegistrar",
    "PromptCacheSynthesizer",
    "UsageTotals",
    "prompt_cache_query_engine",
    "register_nodes",
    "track_usage",
]
