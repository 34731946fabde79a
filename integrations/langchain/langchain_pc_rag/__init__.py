"""LangChain integration of pc_rag: chat and completion models that reuse the KV of retrieved documents."""

from langchain_pc_rag.chat_models import ChatPromptCache
from langchain_pc_rag.llms import PromptCacheLLM
from langchain_pc_rag.retrievers import PromptCacheRetriever, register_documents

__all__ = ["ChatPromptCache", "PromptCacheLLM", "PromptCacheRetriever", "register_documents"]
