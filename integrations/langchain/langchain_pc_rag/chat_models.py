"""ChatPromptCache: a LangChain chat model answered by a local pc_rag Engine that reuses document KV.

Messages are written with the model's own chat template into one string; documents found in it become
chunks whose KV is reused wherever the chain's prompt template put them: documents any retriever returned
(discovered automatically, see `discovery`), text blocks marked with `cache_control`, and documents
registered with the engine (`PromptCacheRetriever`, `register_documents`). `_generate` is `_stream`
collected, so both take the same path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
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
from langchain_core.tools import BaseTool

from pc_rag.adapters import chat_prompt, stream_generation, usage

from ._engine import EngineFields

_ROLES = {HumanMessage: "user", AIMessage: "assistant", SystemMessage: "system", ToolMessage: "tool"}


def _message_dict(message: BaseMessage) -> tuple[dict[str, str], list[str]]:
    """A LangChain message as the role/content dict a chat template takes (text content only), and the texts
    of its content blocks marked with `cache_control` (Anthropic's convention), which are chunks."""
    if isinstance(message, ChatMessage):
        role = message.role
    else:
        role = next((r for cls, r in _ROLES.items() if isinstance(message, cls)), None)
    if role is None:
        kind = type(message).__name__
        raise ValueError(f"ChatPromptCache cannot send a {kind}; use system, human and ai messages")
    if isinstance(message, AIMessage) and (message.tool_calls or message.invalid_tool_calls):
        # Rendering them would need a chat template that writes tool calls and a model that was shown the
        # tools; dropping them would change what the conversation says.
        raise ValueError(
            "ChatPromptCache cannot send an AIMessage with tool_calls: it has no tool calling, and dropping "
            "the calls would change the conversation. Remove the tool calls (and their ToolMessages) from the "
            "history, or put their results in the text of an ordinary message."
        )
    marked: list[str] = []
    if isinstance(message.content, list):
        blocks = [b for b in message.content if isinstance(b, dict)]
        other = [b.get("type") for b in blocks if b.get("type") != "text"]
        if other:
            raise ValueError(f"ChatPromptCache takes text only; the message has {other} content blocks")
        marked = [b["text"] for b in blocks if b.get("cache_control") and isinstance(b.get("text"), str)]
    return {"role": role, "content": message.text}, marked


def usage_metadata(counts: dict[str, int]) -> UsageMetadata:
    """pc_rag's token counts as LangChain reports them (as ChatAnthropic: `input_tokens` includes cached)."""
    return UsageMetadata(
        input_tokens=counts["prompt_tokens"],
        output_tokens=counts["completion_tokens"],
        total_tokens=counts["prompt_tokens"] + counts["completion_tokens"],
        input_token_details={
            "cache_read": counts["cached_tokens"],  # prompt tokens whose KV was reused
            "cache_creation": counts["cache_creation_tokens"],  # prompt tokens whose KV this request stored
        },
    )


class ChatPromptCache(EngineFields, BaseChatModel):
    """Chat model on a local Llama through pc_rag, reusing the KV of registered documents.

    ```python
    llm = ChatPromptCache(model="/models/llama-3.2-1b-instruct", max_tokens=128)
    retriever = PromptCacheRetriever(retriever=vectorstore.as_retriever(), llm=llm)
    ```
    Documents returned by any retriever in the process are found in the prompt with no wrapper
    (`auto_chunks=False` to ignore them). Usage: `usage_metadata["input_token_details"]` has `cache_read`
    (prompt tokens whose KV was reused) and `cache_creation` (prompt tokens whose KV this request stored).
    No tool calling and no structured output: both raise NotImplementedError before anything runs.
    """

    @property
    def _llm_type(self) -> str:
        return "pc-rag-chat"

    _ls_model_type = "chat"

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: str | None = None,
        **kwargs: Any,
    ):
        raise NotImplementedError(
            "ChatPromptCache does not support tool calling (bind_tools): pc_rag decodes free text, with no "
            "tool-call format or constrained decoding. Describe the tools in the prompt and parse the reply "
            "yourself, or use a chat model with tool calling for the agent steps."
        )

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        # BaseChatModel.stream reports each chunk to run_manager itself; reporting here would double it.
        engine = self._engine()
        parts = [_message_dict(m) for m in messages]
        marked = [text for _, texts in parts for text in texts]
        options = self._options(stop, kwargs)
        prompt = chat_prompt(engine, [d for d, _ in parts], chunk_texts=marked, discovered=self.auto_chunks,
                             cache_salt=options.cache_salt)
        for item in stream_generation(engine, prompt, options):
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
