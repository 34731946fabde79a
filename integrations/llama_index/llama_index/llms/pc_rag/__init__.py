from llama_index.llms.pc_rag.base import PromptCacheLLM
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
    "prompt_cache_query_engine",
    "register_nodes",
]
