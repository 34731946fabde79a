"""LangChain integration of pc_rag: chat and completion models that reuse the KV of retrieved documents.

Importing it turns on automatic document discovery (see `langchain_pc_rag.discovery`): documents any retriever
returns are found in later prompts with no wrapper.
"""

from langchain_pc_rag import discovery as _discovery  # noqa: F401  (attaches the retriever callback)
from langchain_pc_rag.chat_models import ChatPromptCache
from langchain_pc_rag.llms import PromptCacheLLM
from langchain_pc_rag.retrievers import PromptCacheRetriever, register_documents

__all__ = ["ChatPromptCache", "PromptCacheLLM", "PromptCacheRetriever", "register_documents"]
