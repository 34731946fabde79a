"""Registering documents with one engine explicitly (optional: any retriever's documents are discovered
automatically, see `discovery`). Registered documents are chunks even with `auto_chunks=False` or
PC_RAG_DISCOVERY=0, and stay registered with the engine rather than in the bounded discovery registry."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field

from pc_rag.adapters import register


def register_documents(llm, documents: Iterable[Document], public: bool = False) -> int:
    """Register documents' `page_content` as chunks of `llm`'s engine; return how many were new.

    `llm` is a ChatPromptCache or PromptCacheLLM. Register the exact text the chain will put into the prompt:
    a chain that rewrites documents (summarises, truncates) before formatting will not hit. `public=True`: their
    KV is shared by every `cache_salt` (users of a multi-user app); a user can then learn whether a public
    document is cached, nothing else. By default a document's KV is kept in the namespace of each request.
    """
    return register(llm._engine(), (d.page_content for d in documents), public=public)


class PromptCacheRetriever(BaseRetriever):
    """Wraps any retriever; every document it returns is registered with `llm`'s engine on the way out.

    Drop-in: `create_retrieval_chain(PromptCacheRetriever(retriever=vs.as_retriever(), llm=llm), ...)`.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: BaseRetriever = Field(description="The retriever whose documents are registered.")
    llm: Any = Field(description="The ChatPromptCache / PromptCacheLLM whose engine answers the chain.")
    public: bool = Field(default=False, description="Register the documents as public: shared by every "
                         "cache_salt (see register_documents).")

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        documents = self.retriever.invoke(query, config={"callbacks": run_manager.get_child()})
        register_documents(self.llm, documents, self.public)
        return documents

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun
    ) -> list[Document]:
        documents = await self.retriever.ainvoke(query, config={"callbacks": run_manager.get_child()})
        register_documents(self.llm, documents, self.public)
        return documents
