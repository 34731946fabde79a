"""Automatic node discovery: whatever any LlamaIndex retriever returns becomes a chunk pc_rag can reuse.

Importing `llama_index.llms.pc_rag` adds one `NodeDiscovery` event handler to LlamaIndex's root
instrumentation dispatcher, which sees the events of every dispatcher below it. On each `RetrievalEndEvent`
(fired by every `BaseRetriever.retrieve` / `aretrieve`: query engines, chat engines, retrievers called on their
own) it passes each node's text to `pc_rag.adapters.discover`, the process-wide bounded registry of
discovered documents. The text is `node.get_content(metadata_mode=MetadataMode.LLM)`: what the stock
synthesizers (compact, refine, ...) and the context / condense_plus_context chat engines put in the prompt,
metadata lines included.

Off switches: `PC_RAG_DISCOVERY=0` in the environment (the core's `discover` then registers nothing), or
`auto_chunks=False` on a PromptCacheLLM (its prompts ignore discovered documents).
"""

from __future__ import annotations

from typing import Any

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.schema import MetadataMode

from pc_rag.adapters import discover as _discover


class NodeDiscovery(BaseEventHandler):
    """Passes the text of every retrieved node to pc_rag's registry of discovered documents."""

    @classmethod
    def class_name(cls) -> str:
        return "PromptCacheNodeDiscovery"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, RetrievalEndEvent):
            _discover([n.node.get_content(metadata_mode=MetadataMode.LLM) for n in event.nodes])


def install() -> None:
    """Add the handler to the root dispatcher, once (importing the package calls this)."""
    root = get_dispatcher()
    if not any(isinstance(h, NodeDiscovery) for h in root.event_handlers):
        root.add_event_handler(NodeDiscovery())


install()
