"""ChatPromptCache: a LangChain chat model answered by a local pc_rag Engine that reuses document KV.

Messages are written with the model's own chat template into one string; documents registered in the
engine's ChunkIndex (by `PromptCacheRetriever`, or `register_documents`) are found in it and their KV is
reused, wherever the chain's prompt template put them. `_generate` is `_stream` collected, so both take
the same path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult

from pc_rag.adapters import chat_prompt, stream_generation, usage

from ._engine import EngineFields

_ROLES = {HumanMessage: "user", AIMessage: "assistant", SystemMessage: "system", ToolMessage: "tool"}


def _message_dict(message: BaseMessage) -> dict[str, str]:
    """A LangChain message as the role/content dict a chat template takes (text content only)."""
    if isinstance(message, ChatMessage):
        role = message.role
    else:
        role = next((r for cls, r in _ROLES.items() if isinstance(message, cls)), None)
    if role is None:
        kind = type(message).__name__
        raise ValueError(f"ChatPromptCache cannot send a {kind}; use system, human and ai messages")
    if isinstance(message.content, list):
        other = [b.get("type") for b in message.content if isinstance(b, dict) and b.get("type") != "text"]
        if other:
            raise ValueError(f"ChatPromptCache takes text only; the message has {other} content blocks")
    return {"role": role, "content": message.text}


def usage_metadata(counts: dict[str, int]) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=counts["prompt_tokens"],
        output_tokens=counts["completion_tokens"],
        total_tokens=counts["prompt_tokens"] + counts["completion_tokens"],
        input_token_details={"cache_read": counts["cached_tokens"]},
    )


class ChatPromptCache(EngineFields, BaseChatModel):
    """Chat model on a local Llama through pc_rag, reusing the KV of registered documents.

    ```python
    llm = ChatPromptCache(model="/models/llama-3.2-1b-instruct", max_tokens=128)
    retriever = PromptCacheRetriever(retriever=vectorstore.as_retriever(), llm=llm)
    ```
    Usage: `usage_metadata["input_token_details"]["cache_read"]` counts prompt tokens whose KV was reused.
    """

    @property
    def _llm_type(self) -> str:
        return "pc-rag-chat"

    _ls_model_type = "chat"

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        # BaseChatModel.stream reports each chunk to run_manager itself; reporting here would double it.
        engine = self._engine()
        prompt = chat_prompt(engine, [_message_dict(m) for m in messages])
        for item in stream_generation(engine, prompt, self._options(stop, kwargs)):
            if isinstance(item, str):
                yield ChatGenerationChunk(message=AIMessageChunk(content=item))
                continue
            generation = item
            yield ChatGenerationChunk(
                message=AIMessageChunk(
                    content="",
                    usage_metadata=usage_metadata(usage(generation)),
                    response_metadata={
                        "model_name": self.model_name,
                        "finish_reason": generation.finish_reason,
                        "mode": generation.mode,
                        "ttft_s": generation.ttft_s,
                        "model_provider": "pc_rag",
                    },
                    chunk_position="last",
                ),
                generation_info={"finish_reason": generation.finish_reason},
            )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        full: ChatGenerationChunk | None = None
        for chunk in self._stream(messages, stop, run_manager, **kwargs):
            full = chunk if full is None else full + chunk
        message = full.message
        return ChatResult(
            generations=[
                ChatGeneration(
                    message=AIMessage(
                        content=message.content,
                        usage_metadata=message.usage_metadata,
                        response_metadata=message.response_metadata,
                    ),
                    generation_info=full.generation_info,
                )
            ]
        )
