"""Automatic document discovery: whatever any retriever returns becomes a chunk that pc_rag models can reuse.

Importing `langchain_pc_rag` attaches one `DocumentDiscovery` callback handler to every LangChain run in the
process, the way langchain-core attaches its own usage callback: `register_configure_hook` with a
`ContextVar` whose default is the handler, so every callback manager that LangChain configures (invoke,
ainvoke, stream, astream, batch; chains, retrievers called on their own) carries it. On `on_retriever_end`
it passes each document's `page_content` to `pc_rag.adapters.discover`, the process-wide bounded registry of
discovered documents; the prompt splitter of every engine then finds those texts in whatever prompt the
chain builds (the stuff chain puts `page_content` in the prompt; a document prompt that adds metadata around
it still contains it).

Off switches: `PC_RAG_DISCOVERY=0` in the environment (the core's `discover` then registers nothing), or
`auto_chunks=False` on a model (its prompts ignore discovered documents).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.tracers.context import register_configure_hook

from pc_rag.adapters import discover as _discover


class DocumentDiscovery(BaseCallbackHandler):
    """Passes the text of every document a retriever returns to pc_rag's registry of discovered documents."""

    # Registering a few strings is cheap and thread-safe: run in the caller's thread, also in async runs
    # (no executor hop), and ask LangChain to skip every event but the retriever's.
    run_inline = True
    ignore_llm = ignore_chat_model = ignore_chain = ignore_agent = ignore_retry = ignore_custom_event = True

    def on_retriever_end(
        self, documents: Sequence[Document], *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        _discover([d.page_content for d in documents if isinstance(getattr(d, "page_content", None), str)])


_HANDLER = DocumentDiscovery()
# One ContextVar whose default is the handler: LangChain attaches `var.get()` to every callback manager it
# configures, and attaches it once (it checks identity), however often this module is imported.
_DISCOVERY_VAR: ContextVar[DocumentDiscovery | None] = ContextVar("pc_rag_document_discovery", default=_HANDLER)
register_configure_hook(_DISCOVERY_VAR, inheritable=True)
