"""Keeping several intact retrieved nodes in one prompt, so their cached KV is found.

Stock response modes and what they do to node texts (measured in tests/test_query_engine.py):
- `compact` (the default), `compact_accumulate`, `tree_summarize` join node texts with "\n\n" and repack
  them to fill the context window: while everything fits in one prompt the texts survive (hits); once the
  nodes need more than one prompt they are re-split at token counts, boundaries move and every hit is lost.
- `refine`, `accumulate`: one node per LLM call, each intact (hits, but one document per prompt).
- `simple_summarize`: one prompt, but its truncation step rewrites the joined text even when it fits
  (no hits).
`PromptCacheSynthesizer` is simple_summarize without the truncation: all nodes intact in one prompt, and an
error from the engine (naming the context size) instead of a silently cut document.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.bridge.pydantic import Field, SerializeAsAny
from llama_index.core.llms import LLM
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers import SimpleSummarize
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle
from llama_index.core.types import RESPONSE_TEXT_TYPE

from pc_rag.adapters import register

from .base import PromptCacheLLM


def register_nodes(llm: PromptCacheLLM, nodes, public: bool = False) -> int:
    """Register the text of nodes (NodeWithScore or BaseNode) with `llm`'s engine; return how many were new.

    The text registered is the node's content without metadata: metadata lines that LlamaIndex writes before
    it (MetadataMode.LLM) stay ordinary prompt text. `public=True`: their KV is shared by every `cache_salt`
    (users of a multi-user app); a user can then learn whether a public node is cached, nothing else. By
    default a node's KV is kept in the namespace of each request.
    """
    texts = (getattr(n, "node", n).get_content(metadata_mode=MetadataMode.NONE) for n in nodes)
    return register(llm.get_engine(), texts, public=public)


class PromptCacheNodeRegistrar(BaseNodePostprocessor):
    """Node postprocessor that registers every retrieved node with the LLM's engine; nodes pass unchanged."""

    llm: SerializeAsAny[LLM] = Field(description="The PromptCacheLLM that answers the query.")
    public: bool = Field(default=False, description="Register the nodes as public: shared by every cache_salt "
                         "(see register_nodes).")

    @classmethod
    def class_name(cls) -> str:
        return "PromptCacheNodeRegistrar"

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        register_nodes(self.llm, nodes, self.public)
        return nodes


class PromptCacheSynthesizer(SimpleSummarize):
    """All retrieved nodes, intact, in one text_qa prompt (simple_summarize without truncation)."""

    def get_response(self, query_str: str, text_chunks, **kwargs: Any) -> RESPONSE_TEXT_TYPE:
        template = self._text_qa_template.partial_format(query_str=query_str)
        context = "\n\n".join(text_chunks)
        if self._streaming:
            return self._llm.stream(template, context_str=context, **kwargs)
        return self._llm.predict(template, context_str=context, **kwargs) or "Empty Response"

    async def aget_response(self, query_str: str, text_chunks, **kwargs: Any) -> RESPONSE_TEXT_TYPE:
        template = self._text_qa_template.partial_format(query_str=query_str)
        context = "\n\n".join(text_chunks)
        if self._streaming:
            return await self._llm.astream(template, context_str=context, **kwargs)
        return await self._llm.apredict(template, context_str=context, **kwargs) or "Empty Response"


def prompt_cache_query_engine(index, llm: PromptCacheLLM, streaming: bool = False, **retriever_kwargs):
    """A query engine over `index` whose retrieved nodes are registered and answered in one intact prompt."""
    return RetrieverQueryEngine(
        retriever=index.as_retriever(**retriever_kwargs),
        response_synthesizer=PromptCacheSynthesizer(llm=llm, streaming=streaming),
        node_postprocessors=[PromptCacheNodeRegistrar(llm=llm)],
    )
